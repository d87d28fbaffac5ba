"""tvm_einweld: a plugin for Apache TVM 0.27.

Derivation-based graph transformations (EinNet), tile-graph memory scheduling (Welder),
adaptive layout-strategy tuning (AL-Ansor) and TASO-style verification of every rewrite.
Importing the package registers the "einweld" Relax pipeline; sub-packages load lazily.
"""

__version__ = "0.2.0"

# TVM's pool runs one thread on a 2-core x86 VM by default and pins the main thread to one CPU;
# configure it (one thread per physical core, unpinned) before anything starts it.
from .threads import configure_thread_pool  # noqa: E402

configure_thread_pool()

# Importing the package registers the "einweld" Relax pipeline, so that
# `tvm.compile(mod, target, relax_pipeline="einweld")` works after `import tvm_einweld`.
from .einweld_pipeline import EinweldOptimize, lowering, pipeline  # noqa: E402
from .einweld_pipeline import register as _register_pipeline  # noqa: E402

_register_pipeline()

# Registers the numpy-BLAS GEMM that derived programs may call (R.call_dps_packed), so any
# process that imports tvm_einweld can run modules and exported libraries that use it.
from .relay_passes import numpy_gemm as _numpy_gemm  # noqa: E402,F401
