"""Analytic schedule rules: one folder per target, one module per kernel class (in the spirit
of TVM's `s_tir/dlight`). A rule looks at one PrimFunc and returns a schedule for it, or None
when the function is not of its class; nothing here needs tuning.

A scheduled function carries TVM's own mark, the attribute `tirx.is_scheduled` (dlight and
MetaSchedule read it too): `is_scheduled` / `mark_scheduled` are the one place that reads and
writes it, for the rules, tile-graph fusion, tuning-task extraction and the reference
schedules of the checks."""
from __future__ import annotations

import tvm
from tvm import tirx

SCHEDULED_ATTR = "tirx.is_scheduled"


def is_scheduled(func_or_mod: tirx.PrimFunc | tvm.IRModule) -> bool:
    """Whether a PrimFunc (or any PrimFunc of a module) carries the scheduled mark: such a
    function is never re-scheduled, re-tiled or re-tuned (that would discard its schedule)."""
    if isinstance(func_or_mod, tvm.IRModule):
        return any(isinstance(f, tirx.PrimFunc) and is_scheduled(f)
                   for f in func_or_mod.functions.values())
    attrs = func_or_mod.attrs
    return attrs is not None and SCHEDULED_ATTR in attrs and bool(int(attrs[SCHEDULED_ATTR]))


def same_code(a: tirx.PrimFunc, b: tirx.PrimFunc) -> bool:
    """Whether two kernels are the same code, whatever their attributes (task extraction and
    weight marking add some, a name or layout-free parameters, that change neither what a
    kernel computes nor how)."""
    from tvm_ffi import structural_equal  # pylint: disable=import-outside-toplevel

    def code(func):
        return tirx.PrimFunc(func.params, func.body, func.ret_type)

    return structural_equal(code(a), code(b))


def mark_scheduled(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with the scheduled mark."""
    return func.with_attr(SCHEDULED_ATTR, True)


# Relax's OpPatternKind.kOpaque: FuseOps never puts such a function into a group.
OPAQUE_PATTERN = 8


def scheduled_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` marked scheduled and opaque to FuseOps, for a kernel scheduled before the Relax
    module around it is fused (an eOperator, a tile group's kernel). Fused with a neighbour it
    would lose its mark inside a new function that the rules would schedule afresh, over loops
    that are no longer a block's axes in order (an IndexError in the injective rule), or that
    no Schedule accepts at all: TVM 0.27's loop_partition gives each piece a copy of the block
    with the same iteration variables, a function that lowers but that `s_tir.Schedule`
    refuses as ill-formed ("multiple definitions of variable")."""
    return mark_scheduled(func).with_attr("op_pattern", OPAQUE_PATTERN)
