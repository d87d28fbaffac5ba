"""The CPU build function our LocalBuilder workers run.

MetaSchedule's ``default_build`` imports ``tvm.s_tir.tensor_intrin`` in every builder process;
that registers every target's tensor intrinsics and takes 30-80 s on a 2-core machine, longer
than the builder's timeout, and LocalBuilder starts fresh processes for every batch. CPU float32
schedules never tensorize, so this function does the same build without that import.
"""
from __future__ import annotations

import tvm
from tvm.target import Target


def build_cpu_kernel(mod: tvm.IRModule, target: Target, _params=None):
    """Same as MetaSchedule's default build: strip compile-time layout blocks, then build."""
    # pylint: disable=import-outside-toplevel
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)
