"""A faster build of the reference module, computing exactly what the default build computes.

A whole-module check (`module_check`) runs the module a stage was given, and that module's
kernels are usually unscheduled: TVM's default build of a matmul is a scalar i-j-k loop nest on
one thread (BERT-base's layer: 6.5 s a call on a 2-core AVX2 machine, five input sets per
check). `reference_schedule` gives every PrimFunc that is not yet scheduled three schedule
primitives, nothing else:

- `reorder` moves the reduction loops of a reduction block in front of its innermost spatial
  loop (i, j, k becomes i, k, j), so the innermost loop writes consecutive outputs and LLVM's
  loop vectoriser can vectorise it without reassociating any sum;
- `decompose_reduction` hoists the block's init into its own loop nest in front of the
  reduction loops (instead of a test on the reduction iterators inside them);
- `parallel` runs the outermost spatial loop on TVM's thread pool.

Why the results are the ones of the default build, bit for bit: each primitive checks its own
preconditions (affine bindings, a loop chain, a data-parallel loop for `parallel`) and raises
instead of changing what the function computes; `reorder` never moves a reduction loop past
another reduction loop, so every output element still accumulates its terms in the same order,
and spatial loops only decide which element is computed when. A function whose blocks are not
in the normal form (loops shared between blocks, opaque iterators) or where a primitive refuses
is left exactly as it was. Scheduled functions (`tirx.is_scheduled`) are never touched: they
run as the pipeline will run them.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from ..tir_passes.rules import is_scheduled


def schedule_reference_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its loops reordered, reductions decomposed and outer loops parallel (see the
    module docstring), or `func` itself where any of that does not apply."""
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    if is_scheduled(func):
        return func
    try:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return func
        for info in infos:
            kinds = [it.kind for it in info.iters]
            loops = [it.loop_rv for it in info.iters]
            if not loops or "O" in kinds:
                continue
            spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
            reduce = [lp for lp, k in zip(loops, kinds) if k == "R"]
            if reduce and spatial:
                order = spatial[:-1] + reduce + spatial[-1:]
                if order != loops:
                    sch.reorder(*order)
            # Outer spatial loops (all but the innermost, or the only one of an injective
            # block) are fused into one parallel loop: batch-1 models have leading extents 1.
            # `parallel` needs the block whole, so it comes before the init is split off.
            outer = spatial[:-1] if reduce else (spatial[:-1] or spatial)
            if outer:
                sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
            if reduce and spatial:
                sch.decompose_reduction(info.block_rv, reduce[0])
        return sch.mod["main"]
    except Exception:  # pylint: disable=broad-except  # a refused primitive: keep the default
        return func


def reference_schedule(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with `schedule_reference_func` applied to each of its unscheduled PrimFuncs."""
    updated = {}
    for gvar, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and not is_scheduled(func):
            new = schedule_reference_func(func)
            if new is not func:
                updated[gvar] = new
    if not updated:
        return mod
    # A new module (the caller's stays as it was) keeping the attributes and global infos.
    return tvm.IRModule({**dict(mod.functions), **updated}, attrs=mod.attrs,
                        global_infos=mod.global_infos)


@tvm.transform.module_pass(opt_level=0, name="ReferenceSchedule")
def _reference_schedule_pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    return reference_schedule(mod)


def reference_build_pipeline() -> tvm.transform.Pass:
    """TVM's default Relax build pipeline with `reference_schedule` applied right after
    legalisation: `tvm.compile(mod, target, relax_pipeline=reference_build_pipeline())` builds
    what the default pipeline builds, with faster loops (CPU targets)."""
    from tvm import relax

    return tvm.transform.Sequential([
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        relax.transform.LegalizeOps(),
        _reference_schedule_pass,
        relax.pipeline.default_build_pipeline(),
    ], name="reference_build")


__all__ = ["reference_build_pipeline", "reference_schedule", "schedule_reference_func"]
