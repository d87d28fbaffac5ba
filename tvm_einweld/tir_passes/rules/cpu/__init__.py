"""CPU (llvm target) schedule rules, analytic and near the machine's limits without tuning.

    mod = ApplyCPURules(target)(mod)     # after LegalizeOps / FuseOps / FuseTIR
    name, func = schedule_cpu(func, target) or (None, func)

`CPU_RULE_FAMILIES` is the table of rule families, tried in order on every PrimFunc that is not
yet scheduled: the first that returns a function gives it (marked `tirx.is_scheduled`); a
function no family claims is left as it is (stock lowering then handles it), so the pass
composes with TileGraphFusion, dlight and MetaSchedule. Each family's module argues why its
schedules compute what the function computes.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import tvm
from tvm import tirx
from tvm.target import Target

from .isa import VectorISA, vector_isa
from .memory_bound import schedule_memory_bound

Family = Callable[[tirx.PrimFunc, Target], Optional[Tuple[str, tirx.PrimFunc]]]

CPU_RULE_FAMILIES: Tuple[Tuple[str, Family], ...] = (
    ("memory-bound", schedule_memory_bound),
)


def schedule_cpu(func: tirx.PrimFunc, target: Target) -> Optional[Tuple[str, tirx.PrimFunc]]:
    """(rule name, scheduled function) from the first family that claims `func`, or None."""
    if func.attrs is not None and "tirx.is_scheduled" in func.attrs and \
            int(func.attrs["tirx.is_scheduled"]) == 1:
        return None
    for _family, rule in CPU_RULE_FAMILIES:
        result = rule(func, target)
        if result is not None:
            return result
    return None


@tvm.transform.module_pass(opt_level=0, name="ApplyCPURules")
class ApplyCPURules:  # pylint: disable=too-few-public-methods
    """IRModule pass: `schedule_cpu` on every PrimFunc. After a run, `scheduled` maps each
    scheduled function's name to the rule that scheduled it."""

    def __init__(self, target: Target | str | dict) -> None:
        self.target = target if isinstance(target, Target) else Target(target)
        self.scheduled: Dict[str, str] = {}

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        self.scheduled = {}
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            target = func.attrs.get("target", self.target) if func.attrs is not None \
                else self.target
            result = schedule_cpu(func, target)
            if result is not None:
                self.scheduled[gvar.name_hint], updates[gvar] = result
        if not updates:
            return mod
        mod = mod.clone()  # a pass leaves its input as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


__all__ = ["VectorISA", "vector_isa", "CPU_RULE_FAMILIES", "schedule_cpu", "ApplyCPURules"]
