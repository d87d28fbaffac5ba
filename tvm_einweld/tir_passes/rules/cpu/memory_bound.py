"""The memory-bound CPU rules as one: `schedule_memory_bound(func, target)`.

For a PrimFunc that is not yet scheduled (attr `tirx.is_scheduled`), the rules of
`MEMORY_BOUND_RULES` are tried in order; the first that returns a schedule gives the function
(marked scheduled). With `fast_math` (the default) a claimed function's float32
exp/erf/tanh/sigmoid calls are then rewritten into the vectorisable formulas of fast_math.py
(stated error bounds there); unclaimed functions keep their libm calls. The module pass that
applies every CPU rule family is `rules.cpu.ApplyCPURules`.

`schedule_eoperator(func, target)` schedules an eOperator (a kernel compiled from an expression,
`relay_passes.eoperator`; memory-bound but for the G2BMM kernel, which Relax has no operator
for): with the injective rule where it claims the function, else with the same loop nest
(`injective.schedule_spatial_block`; `parallel_rows` for a contraction) on every block where it
stands, and marked scheduled (`tirx.is_scheduled`) as every rule's output is.

Correctness: each rule only applies TensorIR schedule primitives (see the rules' docstrings), and
the fast-math rewrite replaces a call by a formula with a tested error bound; nothing else in a
function changes. An eOperator gets neither the fast-math rewrite nor the reduction rule's
rfactor (which re-associates a sum): its schedule only reorders, splits, fuses, vectorises and
parallelises spatial loops, so every output is computed by the same operations in the same
order as the unscheduled function.
"""
from __future__ import annotations

from typing import Callable, Optional

from tvm import s_tir, tirx
from tvm.target import Target

from .. import is_scheduled, mark_scheduled, scheduled_kernel
from .fast_math import rewrite_fast_math
from .injective import (DATA_PAR, CpuParams, block_bytes, cpu_params, is_gemm_like,
                        loops_match_iters, schedule_injective, schedule_spatial_block)
from .pooling import schedule_max_pool
from .reduction import schedule_reduction

Rule = Callable[[tirx.PrimFunc, Target], Optional[s_tir.Schedule]]

# Order matters only for functions two rules could claim. Max pooling, which the injective rule
# would also take as a window reduction, goes to its own two-pass form first (pooling.py);
# the other two exclude each other (row reductions vs. everything else; of gathered
# contractions, those with a contiguous innermost output axis vs. those reducing along rows).
MEMORY_BOUND_RULES: tuple[tuple[str, Rule], ...] = (
    ("pooling", schedule_max_pool),
    ("injective", schedule_injective),
    ("reduction", schedule_reduction),
)


def schedule_memory_bound(func: tirx.PrimFunc, target: Target, fast_math: bool = True
                          ) -> tuple[str, tirx.PrimFunc] | None:
    """(rule name, scheduled function) for one PrimFunc, or None when no rule claims it."""
    if is_scheduled(func):
        return None
    for name, rule in MEMORY_BOUND_RULES:
        sch = rule(func, target)
        if sch is not None:
            # After scheduling: the rules still see the calls (softmax's exp is kept per row
            # because it is a transcendental call; a polynomial would look cheap and be inlined
            # twice).
            scheduled = sch.mod["main"]
            if fast_math:
                scheduled = rewrite_fast_math(scheduled, target)[0]
            return name, mark_scheduled(scheduled)
    return None


def schedule_eoperator(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc:
    """The scheduled `func` of an eOperator (see the module docstring). The injective rule when
    it claims `func` (intermediates inlined: one pass over memory); otherwise (a row
    reduction, a small contraction or G2BMM kernel, stages that feed each other) each block
    in its own loop nest: `schedule_spatial_block`, or `parallel_rows` for a contraction,
    whose vector lanes would gather one operand at every step of the reduction (a G2BMM
    kernel ran 2x slower so). Both only need the loops to be the block's axes in order (true
    of every `te.create_prim_func`); a block that is not so is left as it is."""
    sch = schedule_injective(func, target)
    if sch is None:
        sch = s_tir.Schedule(func)
        params = cpu_params(target)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            if not loops_match_iters(sch, block):
                continue
            if is_gemm_like(sch.get(block)):
                parallel_rows(sch, block, params)
            else:
                schedule_spatial_block(sch, block, params)
    # Marked like every rule's output (later passes leave it as it is) and opaque to FuseOps:
    # it is scheduled before the module around it is fused (`scheduled_kernel`).
    return scheduled_kernel(sch.mod["main"])


def parallel_rows(sch: s_tir.Schedule, block, params: CpuParams) -> None:
    """Spatial axes but the innermost fused into one parallel loop (when the block moves
    enough bytes for more than one task); the innermost spatial axis and the reduction stay
    serial, so each output is one contiguous dot product in its original order."""
    kinds = [int(iv.iter_type) for iv in sch.get(block).iter_vars]
    rows = [lp for lp, k in zip(sch.get_loops(block), kinds) if k == DATA_PAR][:-1]
    if rows and params.tasks(block_bytes(sch.get(block))) > 1:
        sch.parallel(sch.fuse(*rows) if len(rows) > 1 else rows[0])
