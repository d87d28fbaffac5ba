"""Module-level entry points for the GEMM-class CPU rules with compile-time weight packing.

`ScheduleGEMM(target)` is `ApplyCPURules` (the package's pass) with the GEMM-class rule only.

`prepack_weights(target, rules)` is the compile-time weight packing (the LC layout strategy)
for a whole Relax module after LegalizeOps/FuseOps/FuseTIR, built from stock TVM's machinery
the same way `relax.pipeline.static_shape_tuning_pipeline(cpu_weight_prepack=True)` chains it,
with our analytic schedules where MetaSchedule's tuned ones would be:

    AttachAttrLayoutFreeBuffers   mark PrimFunc params bound to Relax constants / weights
    ApplyCPURules                 the rules pack such a B into panels in a block annotated
                                  `meta_schedule.layout_rewrite_preproc`
    SplitLayoutRewritePreproc     move those blocks into separate `*_weight_prepack` PrimFuncs
                                  called from Relax before the `*_prepacked` kernel
    LiftTransformParams           (functions with a `num_input` attr) weights' packing goes into
                                  `<func>_transform_params`, run once by the user
    FoldDataMovement              packing of Relax constants is evaluated at compile time, in
                                  numpy (`relay_passes.fold_data_movement`: it only copies)
    FoldConstant                  what numpy does not evaluate, with TVM's build

so no packing runs at inference for constant weights.
"""
from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ....relay_passes.fold_data_movement import FoldDataMovement
from . import ApplyCPURules, dlight_family
from .gemm import GEMM


@tvm.transform.module_pass(opt_level=0, name="KernelsWithoutSymbols")
def _kernels_without_symbols(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """PrimFuncs called from Relax lose their `global_symbol` (the build's AttachGlobalSymbol
    names every kernel after its GlobalVar): SplitLayoutRewritePreproc copies a kernel's
    attributes into the two functions it makes, and one symbol on both fails the build."""
    if not any(isinstance(f, relax.Function) for _, f in mod.functions_items()):
        return mod  # a TIR-only module: its symbols are its entry points
    updates = {gv: f.without_attr("global_symbol") for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
               and "global_symbol" in f.attrs}
    if not updates:
        return mod
    mod = mod.clone()
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


def ScheduleGEMM(target: Target | str | dict) -> tvm.transform.Pass:  # pylint: disable=invalid-name
    """IRModule pass: the GEMM-class analytic schedule on every matching PrimFunc."""
    return ApplyCPURules(target, [("gemm", dlight_family(GEMM()))])


def prepack_weights(target: Target | str | dict,
                    rules: Sequence[ScheduleRule] | None = None,
                    scheduler: ApplyCPURules | None = None) -> tvm.transform.Pass:
    """Relax module pass (after LegalizeOps/FuseOps/FuseTIR): schedule with `rules` (default:
    every CPU rule family; or with the given `scheduler` pass, to read its report) and move the
    packing of constant / weight operands out of inference (see the module docstring)."""
    if scheduler is None:
        families = None if rules is None else [(type(r).__name__, dlight_family(r))
                                               for r in rules]
        scheduler = ApplyCPURules(target, families)
    return tvm.transform.Sequential(
        [
            relax.transform.AttachAttrLayoutFreeBuffers(),
            scheduler,
            _kernels_without_symbols,
            relax.transform.SplitLayoutRewritePreproc(),
            relax.transform.LiftTransformParams(),
            FoldDataMovement,  # the packing kernels, in numpy: FoldConstant compiles each
            relax.transform.FoldConstant(),
        ],
        name="PrepackWeights",
    )


def cpu_gemm_pipeline(target: Target | str | dict, prepack: bool = True
                      ) -> tvm.transform.Pass:
    """A Relax pipeline for `tvm.compile(mod, target, relax_pipeline=...)`: stock CPU
    legalisation and fusion, our analytic schedules (with compile-time weight packing when
    `prepack`), then stock lowering, the kernels built as the einweld pipeline builds them
    (`parallel_build.PrebuiltKernels`). Functions no rule takes keep stock TVM's default
    schedule (built the same way)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu  # pylint: disable=import-outside-toplevel

    from ....parallel_build import PrebuiltKernels  # pylint: disable=import-outside-toplevel

    target = target if isinstance(target, Target) else Target(target)
    schedule = prepack_weights(target) if prepack else ApplyCPURules(target)

    @tvm.transform.module_pass(opt_level=0, name="CPUGemmPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(
                cpu.library_dispatch_passes(target) + cpu.legalize_passes(target) + [schedule]
                + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target)
                + [PrebuiltKernels()]
            )(mod)

    return _pipeline
