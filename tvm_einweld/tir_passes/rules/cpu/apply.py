"""Module-level entry points for the analytic CPU rules.

`ApplyCPURules(target, rules)` is an IRModule pass: every PrimFunc not yet scheduled (attr
`tirx.is_scheduled`) is offered to the rules in order; the first schedule returned replaces
it, functions no rule takes are left untouched. `ScheduleGEMM(target)` is that pass with the
GEMM-class rule only.

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
    FoldConstant                  packing of Relax constants is evaluated at compile time

so no packing runs at inference for constant weights.
"""
from __future__ import annotations

from collections.abc import Sequence

import tvm
from tvm import relax, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .conv import Conv2D
from .gemm import GEMM


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs
    return attrs is not None and "tirx.is_scheduled" in attrs and bool(attrs["tirx.is_scheduled"])


def default_rules() -> list[ScheduleRule]:
    """The rules of this package's CPU GEMM class. Convolutions first: an NCHW convolution also
    has the einsum form the GEMM rule accepts (an implicit im2col with the output channels in
    the vector lanes), but the direct schedule, vectorised along the output row, measured ~2x
    faster on a 64-channel 3x3 convolution."""
    return [Conv2D(), GEMM()]


@tvm.transform.module_pass(opt_level=0, name="ApplyCPURules")
class ApplyCPURules:  # pylint: disable=too-few-public-methods
    """Schedule every unscheduled PrimFunc that one of `rules` accepts, for `target`."""

    def __init__(self, target: Target | str | dict, rules: Sequence[ScheduleRule] | None = None):
        self.target = target if isinstance(target, Target) else Target(target)
        self.rules = list(rules) if rules is not None else default_rules()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext
                         ) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or _is_scheduled(func):
                continue
            for rule in self.rules:
                sch = rule.apply(func, self.target, False)
                if sch is not None:
                    updates[gvar] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
                    break
        if not updates:
            return mod
        mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else mod
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def ScheduleGEMM(target: Target | str | dict) -> tvm.transform.Pass:  # pylint: disable=invalid-name
    """IRModule pass: the GEMM-class analytic schedule on every matching PrimFunc."""
    return ApplyCPURules(target, [GEMM()])


def prepack_weights(target: Target | str | dict,
                    rules: Sequence[ScheduleRule] | None = None) -> tvm.transform.Pass:
    """Relax module pass (after LegalizeOps/FuseOps/FuseTIR): schedule with `rules` and move the
    packing of constant / weight operands out of inference (see the module docstring)."""
    return tvm.transform.Sequential(
        [
            relax.transform.AttachAttrLayoutFreeBuffers(),
            ApplyCPURules(target, rules),
            relax.transform.SplitLayoutRewritePreproc(),
            relax.transform.LiftTransformParams(),
            relax.transform.FoldConstant(),
        ],
        name="PrepackWeights",
    )


def cpu_gemm_pipeline(target: Target | str | dict, prepack: bool = True
                      ) -> tvm.transform.Pass:
    """A Relax pipeline for `tvm.compile(mod, target, relax_pipeline=...)`: stock CPU
    legalisation and fusion, our analytic schedules (with compile-time weight packing when
    `prepack`), then stock lowering. Functions no rule takes keep stock TVM's default."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu  # pylint: disable=import-outside-toplevel

    target = target if isinstance(target, Target) else Target(target)
    schedule = prepack_weights(target) if prepack else ApplyCPURules(target)

    @tvm.transform.module_pass(opt_level=0, name="CPUGemmPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(
                cpu.library_dispatch_passes(target) + cpu.legalize_passes(target) + [schedule]
                + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target)
            )(mod)

    return _pipeline
