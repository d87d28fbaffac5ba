"""The module-level entry of the memory-bound CPU rules.

    mod = apply_memory_bound_rules(target)(mod)      # a Relax or TIR IRModule, after FuseTIR

For every PrimFunc of `mod` that is not yet scheduled (attr `tirx.is_scheduled`), the rules of
`MEMORY_BOUND_RULES` are tried in order; the first that returns a schedule replaces the function
(marked scheduled) and functions no rule claims are left untouched, so the pass composes with
other rule sets (the GEMM rule, dlight, MetaSchedule) run before or after it. With `fast_math`
(the default) a claimed function's float32 exp/erf/tanh/sigmoid calls are then rewritten into
the vectorisable formulas of fast_math.py (stated error bounds there); unclaimed functions keep
their libm calls.

Correctness: each rule only applies TensorIR schedule primitives (see the rules' docstrings), and
the fast-math rewrite replaces a call by a formula with a tested error bound; nothing else in a
function changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import tvm
from tvm import s_tir, tirx
from tvm.target import Target

from .fast_math import rewrite_fast_math
from .injective import schedule_injective
from .reduction import schedule_reduction

Rule = Callable[[tirx.PrimFunc, Target], Optional[s_tir.Schedule]]

# Order matters only for functions two rules could claim; the two rules exclude each other
# (row reductions vs. everything else), so this is just the cheaper check first.
MEMORY_BOUND_RULES: tuple[tuple[str, Rule], ...] = (
    ("injective", schedule_injective),
    ("reduction", schedule_reduction),
)


def schedule_memory_bound(func: tirx.PrimFunc, target: Target, fast_math: bool = True
                          ) -> tuple[str, tirx.PrimFunc] | None:
    """(rule name, scheduled function) for one PrimFunc, or None when no rule claims it."""
    if _is_scheduled(func):
        return None
    for name, rule in MEMORY_BOUND_RULES:
        sch = rule(func, target)
        if sch is not None:
            # After scheduling: the rules still see the calls (softmax's exp is kept per row
            # because it is a transcendental call; a polynomial would look cheap and be inlined
            # twice).
            scheduled = sch.mod["main"]
            if fast_math:
                scheduled = rewrite_fast_math(scheduled)[0]
            return name, scheduled.with_attr("tirx.is_scheduled", True)
    return None


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs is not None and "tirx.is_scheduled" in func.attrs
                and int(func.attrs["tirx.is_scheduled"]) == 1)


@dataclass
class MemoryBoundReport:
    """What the last run scheduled: {function name: rule name}."""

    scheduled: dict


@tvm.transform.module_pass(opt_level=0, name="ApplyMemoryBoundRules")
class ApplyMemoryBoundRules:  # pylint: disable=too-few-public-methods
    """IRModule pass: `schedule_memory_bound` on every PrimFunc (see the module docstring).
    `report` says which functions were scheduled by which rule after a run."""

    def __init__(self, target: Target | str | dict, fast_math: bool = True) -> None:
        self.target = target if isinstance(target, Target) else Target(target)
        self.fast_math = fast_math
        self.report = MemoryBoundReport({})

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        updates = {}
        scheduled = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            target = func.attrs.get("target", self.target) if func.attrs is not None \
                else self.target
            result = schedule_memory_bound(func, target, self.fast_math)
            if result is not None:
                scheduled[gvar.name_hint] = result[0]
                updates[gvar] = result[1]
        self.report = MemoryBoundReport(scheduled)
        if not updates:
            return mod
        mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else mod
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def apply_memory_bound_rules(target: Target | str | dict, fast_math: bool = True
                             ) -> ApplyMemoryBoundRules:
    """The pass, for `tvm.transform.Sequential([...])` or to call on a module directly."""
    return ApplyMemoryBoundRules(target, fast_math)
