"""Simplification of index functions with floor division and modulo.

Rules that substitute iterators produce functions such as (t1 + 2·t2) // 2 − t1 // 2, which is
t2, or (t1 + 2·t2) % 2 + 2·(t1 // 2), which is t1. Interval bounds and operator matching need
the simple forms, so this module rewrites an index function as a linear combination of atoms
(iterators and irreducible floor terms) using three identities, valid for every integer a and
positive constant d:
    (d·q + a) // d = q + a // d,        (d·q + a) % d = a % d,
    d·(a // d) + a % d = a,
and, given iterator ranges, a // d = k and a % d = a − k·d when a lies in [k·d, (k+1)·d).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from . import index as ix
from .expression import Access, Expr, map_accesses
from .index import IndexExpr

Form = Tuple[Dict[IndexExpr, int], int]
Ranges = Optional[Mapping[str, Tuple[int, int]]]


def _combine(a: Form, b: Form, sign: int = 1) -> Form:
    coeffs = dict(a[0])
    for atom, c in b[0].items():
        coeffs[atom] = coeffs.get(atom, 0) + sign * c
    return {k: v for k, v in coeffs.items() if v}, a[1] + sign * b[1]


def _scale(a: Form, k: int) -> Form:
    return {atom: c * k for atom, c in a[0].items() if c * k}, a[1] * k


def build(form: Form) -> IndexExpr:
    """Rebuild `Σ c·atom + const` in a stable order."""
    out: IndexExpr = ix.IConst(0)
    for atom in sorted(form[0], key=str):
        c = form[0][atom]
        term = ix.mul(atom, abs(c))
        out = ix.add(out, term) if c > 0 else ix.sub(out, term)
    return ix.add(out, form[1])


def atom_form(e: IndexExpr, ranges: Ranges = None) -> Form:
    """`e` as a linear combination of atoms, simplified."""
    if isinstance(e, ix.IConst):
        return {}, e.value
    if isinstance(e, ix.IVar):
        return {e: 1}, 0
    if e.op in ("+", "-"):
        return _recombine(_combine(atom_form(e.lhs, ranges), atom_form(e.rhs, ranges),
                                   1 if e.op == "+" else -1))
    if e.op == "*":
        left, right = atom_form(e.lhs, ranges), atom_form(e.rhs, ranges)
        if not left[0]:
            return _scale(right, left[1])
        if not right[0]:
            return _scale(left, right[1])
        return {ix.mul(build(left), build(right)): 1}, 0
    return _recombine(_floor(e.op, atom_form(e.lhs, ranges), e.rhs.value, ranges))


def _floor(op: str, inner: Form, d: int, ranges: Ranges) -> Form:
    whole = {a: c // d for a, c in inner[0].items() if c % d == 0}
    rest = ({a: c for a, c in inner[0].items() if c % d}, inner[1] % d)
    q_const = inner[1] // d
    rest_expr = build(rest)
    k = None
    if not rest[0]:
        k = rest[1] // d
    elif ranges is not None and ix.free_vars(rest_expr) <= set(ranges):
        lo, hi = ix.bounds(rest_expr, ranges)
        if lo // d == hi // d:
            k = lo // d
    if op == "//":
        base = (whole, q_const)
        if k is not None:
            return base[0], base[1] + k
        return _combine(base, ({ix.floordiv(rest_expr, d): 1}, 0))
    if k is not None:
        return _combine(rest, ({}, -k * d))
    return {ix.floormod(rest_expr, d): 1}, 0


def _recombine(form: Form) -> Form:
    """Apply d·(a // d) + a % d = a wherever both terms appear with matching coefficients."""
    coeffs, const = dict(form[0]), form[1]
    changed = True
    while changed:
        changed = False
        for atom in list(coeffs):
            if not (isinstance(atom, ix.IBin) and atom.op == "%") or atom not in coeffs:
                continue
            d, c = atom.rhs.value, coeffs[atom]
            div = ix.floordiv(atom.lhs, d)
            if coeffs.get(div) == c * d:
                del coeffs[atom], coeffs[div]
                inner = atom_form(atom.lhs)
                coeffs_form = _combine((coeffs, const), _scale(inner, c))
                coeffs, const = dict(coeffs_form[0]), coeffs_form[1]
                changed = True
                break
    return coeffs, const


def simplify_index(e: IndexExpr, ranges: Ranges = None) -> IndexExpr:
    """The simplest equivalent form this module finds (ranges enable range-based folding)."""
    return build(atom_form(e, ranges))


def simplify_expr(expr: Expr) -> Expr:
    """`expr` with every index function of its body simplified under its iterator ranges
    (nested scopes untouched)."""
    ranges = expr.ranges
    body = map_accesses(expr.body, lambda a: Access(a.source, tuple(simplify_index(i, ranges)
                                                                   for i in a.indices)))
    return Expr(expr.traversals, expr.sums, body, expr.dtype)
