"""Simplification of index functions under iterator ranges, by TVM's arithmetic analyzer.

`(i0*1568 + i1) // 196 % 8` with i0 ∈ [0,1), i1 ∈ [0,1568) is just `i1 // 196`. Rules and
canonical builders produce such forms mechanically; simplifying them keeps expressions readable
and lets operator matching see affine index functions. TVM's analyzer (`tvm.sym.Analyzer`,
formerly `tvm.arith`) only applies rewrites that are valid for the bound ranges, and the result
is converted back only when it uses the operators index functions have, so a simplified
function equals the original on the iteration space.
"""
from __future__ import annotations

from typing import Mapping, Tuple

import tvm
from tvm import tirx
from tvm.sym import Analyzer

from . import index as ix
from .expression import Access, Expr, Scope, map_accesses
from .lowering import lower_index

_FROM_TIR = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%"}


def _from_tir(e) -> ix.IndexExpr:
    if isinstance(e, tirx.IntImm):
        return ix.IConst(int(e.value))
    if isinstance(e, tirx.Var):
        return ix.IVar(str(e.name))
    op = _FROM_TIR.get(type(e))
    if op is None:
        raise ValueError(f"no index-function form for {type(e).__name__}")
    return ix.build(op, _from_tir(e.a), _from_tir(e.b))


def simplify_index(e: ix.IndexExpr, ranges: Mapping[str, Tuple[int, int]]) -> ix.IndexExpr:
    """`e` simplified for iterators ranging over `ranges` ([lo, hi) each)."""
    names = ix.free_vars(e)
    if not names:
        return e
    analyzer = Analyzer()
    env = {}
    for name in names:
        var = tirx.Var(name, "int64")
        lo, hi = ranges[name]
        analyzer.bind(var, tvm.ir.Range(tirx.const(lo, "int64"), tirx.const(hi, "int64")))
        env[name] = var
    lowered = lower_index(e, env, dtype="int64")
    try:
        return _from_tir(analyzer.simplify(lowered))
    except ValueError:
        return e


def simplify_expr(expr: Expr) -> Expr:
    """Simplify every index function of `expr` (and of its scopes) under its ranges."""
    ranges = expr.ranges

    def visit(acc: Access) -> Access:
        src = acc.source
        if isinstance(src, Scope):
            src = Scope(simplify_expr(src.expr), src.pad)
        return Access(src, tuple(simplify_index(i, ranges) for i in acc.indices))

    return Expr(expr.traversals, expr.sums, map_accesses(expr.body, visit), expr.dtype)
