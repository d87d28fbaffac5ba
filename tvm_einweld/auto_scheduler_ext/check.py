"""Check tuned programs against the task as written, on fixed random inputs.

MetaSchedule's schedule primitives preserve semantics by construction, but a compiler bug or a
wrong layout rewrite would still give a fast wrong kernel. A program must pass this check
before it can become the best record of its task, so ``MetaScheduleApplyDatabase`` never
deploys an unchecked program.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from tvm_einweld.verify.inputs import random_array
from tvm_einweld.verify.random_testing import TestResult, compare_arrays


def _run(mod: tvm.IRModule, target: Target, arrays: list) -> list:
    """Build ``mod`` as it is (layout transforms stay inside) and run it on copies."""
    kernel = tvm.tirx.build(mod, target=target)
    args = [tvm.runtime.tensor(a.copy()) for a in arrays]
    kernel["main"](*args)
    return [a.numpy() for a in args]


class ProgramChecker:
    """Runs the task's unscheduled PrimFunc once; ``check`` compares a program against it
    over all arguments (inputs must stay unchanged, outputs must match)."""

    def __init__(self, mod: tvm.IRModule, target: Target, seed: int = 0) -> None:
        infos = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
        rng = np.random.default_rng(seed)
        self.dtype = str(infos[-1].dtype)
        self.target = target
        self.inputs = [random_array(rng, [int(d) for d in i.shape], str(i.dtype)) for i in infos]
        self.expected = _run(mod, target, self.inputs)

    def check(self, sch: s_tir.Schedule) -> TestResult:
        try:
            got = _run(sch.mod, self.target, self.inputs)
        except Exception as err:  # pylint: disable=broad-except
            return TestResult(False, f"tuned program failed to build or run: {err}", 1, float("inf"),
                              float("inf"), 0.0)
        pairs = [(f"argument {i}", g, e) for i, (g, e) in enumerate(zip(got, self.expected))]
        return compare_arrays(pairs, self.dtype, "tuned program vs the task as written")
