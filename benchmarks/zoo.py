"""The zoo benchmark: `python benchmarks/zoo.py [--quick]`.

The same code as `python -m tvm_einweld bench`; see `--help`. `--quick` measures three
small models without tuning in a few minutes on 2 cores; without it every zoo model is
measured with 256 MetaSchedule trials per model for each tuned runner (hours on 2 cores:
`--resume` continues a cut-short run from its report and tuning databases).
`--trials`, `--models`, `--runners`, `--batch` override either preset.

Every runner runs in its own worker process with every runtime given the physical cores
(`--threads` to change; the report lists each runner's settings as read back from its
runtime), in rounds that alternate across the processes; the report gives each runner's
spread across rounds and the load before and after. `--in-process` times them all in one
process instead, to show what that costs.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from tvm_einweld.cli import UserError, show_progress
from tvm_einweld.commands import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/zoo.py", description=bench.HELP)
    bench.add_arguments(parser)
    args = parser.parse_args()
    show_progress()
    args.command_line = "python benchmarks/zoo.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    try:
        sys.exit(bench.run(args))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
