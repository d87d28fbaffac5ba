"""CPU (llvm target) schedule rules, analytic and near the machine's limits without tuning:
convolutions (conv.py), the GEMM class (gemm.py; with a row epilogue such as softmax or
LayerNorm in its tiles, gemm_rows.py), memory-bound kernels (memory_bound.py and
the injective / reduction / fast_math modules it uses); compile-time weight packing in apply.py;
which rows of a product each core writes, from how its readers split their loops, in
affinity.py.

    mod = ApplyCPURules(target)(mod)     # after LegalizeOps / FuseOps / FuseTIR
    name, func = schedule_cpu(func, target) or (None, func)

`ApplyCPURules` then schedules again, with `gemm.ROWS_PER_CORE_ATTR`, the GEMM-class kernels
whose every reader splits their output by channel ranges (`affinity.rows_per_core_hints`).

`CPU_RULE_FAMILIES` is the table of rule families, tried in order on every PrimFunc that is not
yet scheduled: the first that returns a function gives it (marked `tirx.is_scheduled`); a
function no family claims, or that TVM refuses as a Schedule's input, is left as it is (stock
lowering then handles it), so the pass composes with TileGraphFusion, dlight and MetaSchedule.
Each family's module argues why its schedules compute what the function computes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, FrozenSet, Optional, Sequence, Tuple

import tvm
from tvm import s_tir, tirx
from tvm.target import Target
from tvm_ffi import structural_equal, structural_hash

from tvm.s_tir.dlight.base import ScheduleRule

from .. import is_scheduled, mark_scheduled
from .affinity import rows_per_core_hints
from .conv import Conv2D
from .fast_math import rewrite_fast_math
from .gemm import GEMM, ROWS_PER_CORE_ATTR
from .gemm_rows import GemmRows
from .isa import VectorISA, vector_isa
from .memory_bound import schedule_memory_bound

Family = Callable[[tirx.PrimFunc, Target], Optional[Tuple[str, tirx.PrimFunc]]]


def dlight_family(rule: ScheduleRule, name: Optional[str] = None) -> Family:
    """A dlight-style rule (`apply(func, target, tunable) -> Schedule | None`) as a family.
    Its epilogues' exp/erf/tanh/sigmoid (a GEMM's GELU, a conv's sigmoid) are then made
    vectorisable (`fast_math`), as in the memory-bound rules: libm's scalar erff in the
    write-back of BERT's FFN GEMM cost as much as the GEMM itself."""
    label = name or type(rule).__name__.lower()

    def family(func: tirx.PrimFunc, target: Target) -> Optional[Tuple[str, tirx.PrimFunc]]:
        sch = rule.apply(func, target, False)
        if sch is None:
            return None
        scheduled = rewrite_fast_math(sch.mod["main"], target)[0]
        return label, mark_scheduled(scheduled)

    return family


# Convolutions first: an NCHW convolution also has the einsum form the GEMM rule accepts, but
# the direct schedule measured ~2x faster on a 64-channel 3x3 convolution. The memory-bound
# rules decline anything whose reduction multiplies two loaded tensors.
CPU_RULE_FAMILIES: Tuple[Tuple[str, Family], ...] = (
    ("conv", dlight_family(Conv2D(), "conv")),
    ("gemm", dlight_family(GEMM(), "gemm")),
    ("gemm-rows", dlight_family(GemmRows(), "gemm-rows")),
    ("memory-bound", schedule_memory_bound),
)


# Scheduling is a pure function of (function, target): the derivation's costing, the fusion
# pass's claims and pricing and the analytic stage ask for the same kernels again and again
# (GCN: ~250 calls, ~45 ms each for the rules that decline a convolution). Results are kept
# per process, keyed by structural hash and confirmed by structural equality.
_MEMO: "OrderedDict[tuple, list]" = OrderedDict()
_MEMO_SIZE = 1024


def schedule_cpu(func: tirx.PrimFunc, target: Target,
                 families: Optional[Sequence[Tuple[str, Family]]] = None
                 ) -> Optional[Tuple[str, tirx.PrimFunc]]:
    """(rule name, scheduled function) from the first family that claims `func`, or None.
    With the default families the answer is remembered (see `_MEMO`)."""
    if is_scheduled(func):
        return None
    if families is not None:
        return _first_claim(func, target, families)
    key = (structural_hash(func), str(target))
    for seen, result in _MEMO.get(key, ()):
        if structural_equal(seen, func):
            _MEMO.move_to_end(key)
            return result
    result = _first_claim(func, target, CPU_RULE_FAMILIES)
    _MEMO.setdefault(key, []).append((func, result))
    while len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return result


def _schedulable(func: tirx.PrimFunc) -> bool:
    """Whether `s_tir.Schedule` accepts `func`. One it refuses as ill-formed (a function that
    holds a kernel scheduled before it was fused, whose loop_partition pieces define a block's
    variables twice: see `rules.scheduled_kernel`) is one no rule can schedule; it is left to
    TVM's lowering, which accepts it."""
    try:
        s_tir.Schedule(func)
        return True
    except tvm.error.InternalError:  # TVM 0.27's error for an ill-formed function
        return False


def _first_claim(func, target, families) -> Optional[Tuple[str, tirx.PrimFunc]]:
    if not _schedulable(func):
        return None
    for _family, rule in families:
        result = rule(func, target)
        if result is not None:
            return result
    return None


@tvm.transform.module_pass(opt_level=0, name="ApplyCPURules")
class ApplyCPURules:  # pylint: disable=too-few-public-methods
    """IRModule pass: `schedule_cpu` on every PrimFunc (with `families`, default all) but
    those named in `skip` (left to stock lowering: how the pipeline leaves out a kernel whose
    schedule made the module disagree). After a run, `scheduled` maps each scheduled
    function's name to the rule that scheduled it."""

    def __init__(self, target: Target | str | dict,
                 families: Optional[Sequence[Tuple[str, Family]]] = None,
                 skip: FrozenSet[str] = frozenset()) -> None:
        self.target = target if isinstance(target, Target) else Target(target)
        self.families = families
        self.skip = frozenset(skip)
        self.scheduled: Dict[str, str] = {}

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        self.scheduled = {}
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or gvar.name_hint in self.skip:
                continue
            result = schedule_cpu(func, self._target_of(func), self.families)
            if result is not None:
                self.scheduled[gvar.name_hint], updates[gvar] = result
        updates.update(self._rows_per_core(mod, updates))
        if not updates:
            return mod
        mod = mod.clone()  # a pass leaves its input as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    def _rows_per_core(self, mod: tvm.IRModule, updates: dict) -> dict:
        """The GEMM-class kernels whose readers all split their output by channel ranges
        (`affinity.rows_per_core_hints`), scheduled again with that hint."""
        kernels = {gvar.name_hint: updates.get(gvar, func)
                   for gvar, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc) and (gvar in updates or is_scheduled(func))}
        gemms = {gvar.name_hint: gvar for gvar in updates
                 if self.scheduled.get(gvar.name_hint) == "gemm"}
        again = {}
        for name in rows_per_core_hints(mod, kernels, frozenset(gemms)) if gemms else ():
            func = mod[gemms[name]]
            result = schedule_cpu(func.with_attr(ROWS_PER_CORE_ATTR, True),
                                  self._target_of(func), self.families)
            if result is not None:
                self.scheduled[name], again[gemms[name]] = result
        return again

    def _target_of(self, func: tirx.PrimFunc) -> Target:
        """The function's own `target` attribute where it has one, else the pass's."""
        return func.attrs.get("target", self.target) if func.attrs is not None \
            else self.target


__all__ = ["VectorISA", "vector_isa", "CPU_RULE_FAMILIES", "Family", "dlight_family",
           "schedule_cpu", "ApplyCPURules"]
