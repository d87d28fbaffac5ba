"""The memory-bound CPU rules as one: `schedule_memory_bound(func, target)`.

For a PrimFunc that is not yet scheduled (attr `tirx.is_scheduled`), the rules of
`MEMORY_BOUND_RULES` are tried in order; the first that returns a schedule gives the function
(marked scheduled). With `fast_math` (the default) a claimed function's float32
exp/erf/tanh/sigmoid calls are then rewritten into the vectorisable formulas of fast_math.py
(stated error bounds there); unclaimed functions keep their libm calls. The module pass that
applies every CPU rule family is `rules.cpu.ApplyCPURules`.

Correctness: each rule only applies TensorIR schedule primitives (see the rules' docstrings), and
the fast-math rewrite replaces a call by a formula with a tested error bound; nothing else in a
function changes.
"""
from __future__ import annotations

from typing import Callable, Optional

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
