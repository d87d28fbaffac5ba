"""Whole vectors where a lane-varying predicate holds on every lane: a TIR pass for CPU code.

What it rewrites
----------------
A vectorised loop whose block carries a predicate that depends on the lane,

    for v in T.vectorized(L):
        with T.sblock(...):
            T.where(P(i) and base(i) + c * v < N)       # c >= 0
            ...

is what a padded tile's crop looks like (a GEMM whose N is padded to whole panels writes its
tile back under `column < N`). TVM's `VectorizeLoop` cannot express a lane-varying condition,
so it scalarises the loop: every tile, not only the last, is written back element by element
(ViT's 6 x 197 x 197 attention scores: 104 us, against 78 us for a 197 x 224 output). Here the
loop becomes

    if base(i) + c * (L - 1) < N:                       # every lane passes
        for v in T.vectorized(L):
            with T.sblock(...):
                T.where(P(i))                           # lane-invariant: stays a scalar `if`
                ...
    else:
        <the loop as it was>

so whole vectors are stored wherever the predicate holds on every lane, and only the partial
vector at the edge is written lane by lane.

Why it is correct
-----------------
Split the predicate into its conjuncts. Those that do not mention v are P. Each one that does
must be `a < b` or `a <= b` (or `b > a`, `b >= a`) where b does not mention v and a is linear in
v with a non-negative constant coefficient (`tvm.sym.detect_linear_equation`), so a is
non-decreasing in v and the conjunct, true at the last lane v = min + L - 1, is true at every
lane. Hence under the new `if` the original predicate equals P for every lane, and the
then-branch does exactly what the loop did; the else-branch is the loop unchanged. A loop
with any other lane-varying conjunct (`!=`, `%`, a decreasing coefficient, a condition that
is not a conjunction) is left alone. The condition reads only loop variables outside the
vectorised loop (it is the block predicate with v replaced by a constant), so evaluating it
once before the loop changes no value.

When: first in `deinterleave.TIR_PIPELINE`, before TVM's lowering (whose `VectorizeLoop`
then sees a lane-invariant predicate), on functions whose `target` is a CPU.
"""
from __future__ import annotations

import tvm
from tvm import ir, s_tir, tirx
from tvm.sym import detect_linear_equation
from tvm_ffi import structural_map, structural_mutate


def _conjuncts(expr) -> list:
    if isinstance(expr, tirx.And):
        return _conjuncts(expr.a) + _conjuncts(expr.b)
    return [expr]


def uses_var(expr, var) -> bool:
    """Whether `expr` reads the variable `var`."""
    return any(var.same_as(u) for u in tirx.analysis.undefined_vars(expr, []))


def _substitute(expr, var, value):
    return structural_map(expr, [(ir.Var, lambda node: value if node.same_as(var) else node)])


def _nondecreasing(expr, var) -> bool:
    """`expr` is c * var + rest with a constant c >= 0 and rest free of `var`."""
    coefficients = detect_linear_equation(expr, [var])
    if len(coefficients) != 2 or uses_var(coefficients[1], var):
        return False
    return isinstance(coefficients[0], tirx.IntImm) and int(coefficients[0]) >= 0


def _monotone(conjunct, var) -> bool:
    """A bound that holds at every lane once it holds at the last (module docstring)."""
    if isinstance(conjunct, (tirx.LT, tirx.LE)):
        grows, fixed = conjunct.a, conjunct.b
    elif isinstance(conjunct, (tirx.GT, tirx.GE)):
        grows, fixed = conjunct.b, conjunct.a
    else:
        return False
    return not uses_var(fixed, var) and _nondecreasing(grows, var)


def _and(conditions: list):
    out = conditions[0]
    for condition in conditions[1:]:
        out = tirx.And(out, condition)
    return out


def tested_lane(loop: tirx.For) -> tirx.Expr:
    """The lane whose bounds imply every lane's (they grow with the lane): the last."""
    return loop.min + loop.extent - 1


def split_loop(loop: tirx.For) -> tirx.Stmt:
    """The module docstring's rewrite of one vectorised `loop`, or `loop` itself."""
    realize = loop.body
    if loop.kind != tirx.ForKind.VECTORIZED or not isinstance(realize, s_tir.SBlockRealize) \
            or not isinstance(loop.extent, tirx.IntImm):
        return loop
    var = loop.loop_var
    conjuncts = _conjuncts(realize.predicate)
    varying = [c for c in conjuncts if uses_var(c, var)]
    if not varying or not all(_monotone(c, var) for c in varying):
        return loop
    every_lane = _and([_substitute(c, var, tested_lane(loop)) for c in varying])
    invariant = [c for c in conjuncts if not uses_var(c, var)]
    predicate = _and(invariant) if invariant else tirx.const(True, "bool")
    whole = tirx.For(var, loop.min, loop.extent, loop.kind,
                     s_tir.SBlockRealize(realize.iter_values, predicate, realize.block),
                     annotations=loop.annotations)
    return tirx.IfThenElse(every_lane, whole, loop)


def split_function(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`split_loop` on every vectorised loop of `func`."""

    def loop(node, mutator):
        return split_loop(mutator.default_mutate(node))

    return structural_mutate(func, [(tirx.For, loop)])


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="SplitLanePredicates")
class SplitLanePredicates:  # pylint: disable=too-few-public-methods
    """Function pass: `split_function` on every CPU function (scheduled TIR, before lowering)."""

    def transform_function(self, func: tirx.PrimFunc, _mod, _ctx=None) -> tirx.PrimFunc:
        from .rules.cpu.isa import cpu_target  # pylint: disable=import-outside-toplevel

        return func if cpu_target(func) is None else split_function(func)
