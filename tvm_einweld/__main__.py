"""`python -m tvm_einweld ...`"""
import sys

from .cli import main

sys.exit(main())
