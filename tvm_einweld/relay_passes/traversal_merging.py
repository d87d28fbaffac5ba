"""Traversal merging (EinNet §4.1): inline a scope into the expression that reads it.

    L_x Σ_y {L_z Σ_w g}[Φ(x, y)]  ↦  L_x Σ_{y, w'} g[z := Φ(x, y)]

Side condition Φ(X×Y) ⊆ Z (z3, `prove_image_within`): every read of the scope lands inside its
range, never in its zero padding, so the inlined body computes exactly the values that were
read. Tensors in the inlined body keep their padding (widened where interval bounds of the new
index functions ask for it; widening only adds zeros that the proven reads never reach).

A scope with its own summation can only be inlined when the outer body is that single access
(the inner sum then joins the outer sum); otherwise the sum would be pulled through f.
"""
from __future__ import annotations

from typing import Dict, Iterable

from ..expr import index as ix
from ..expr.expression import (
    Access, Expr, Iterator, Scope, accesses, map_accesses, substitute_body,
)
from ..verify.smt import prove_image_within
from .derivation import Candidate, Rule, fresh_name, widen_padding


def inline_scope(expr: Expr, access: Access) -> Candidate:
    """Inline the scope read by `access` (an access of `expr`'s body)."""
    scope = access.source
    if not isinstance(scope, Scope):
        raise ValueError("traversal merging needs an access to a scope")
    inner = scope.expr
    if inner.sums and expr.body != access:
        raise ValueError("a scope with a summation can only be inlined when it is the whole body")
    taken = {it.name for it in expr.iterators}
    renamed: Dict[str, ix.IndexExpr] = {}
    new_sums = []
    for it in inner.sums:
        name = fresh_name(taken, it.name) if it.name in taken else it.name
        taken.add(name)
        renamed[it.name] = ix.IVar(name)
        new_sums.append(Iterator(name, it.lo, it.hi))
    mapping = {it.name: idx for it, idx in zip(inner.traversals, access.indices)}
    mapping.update(renamed)
    inlined = substitute_body(inner.body, mapping)
    body = map_accesses(expr.body, lambda a: inlined if a == access else a)
    result = widen_padding(Expr(expr.traversals, expr.sums + tuple(new_sums), body, expr.dtype))
    box = [(it.lo, it.hi) for it in inner.traversals]
    domain = expr.iterators

    def within():
        return prove_image_within(access.indices, domain, box)

    return Candidate(result, (within,),
                     f"inline scope read at [{', '.join(map(str, access.indices))}]")


class TraversalMerging(Rule):
    """Inline any scope read by the expression level (one candidate per distinct access)."""

    name = "traversal_merging"

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[Candidate]:
        seen = []
        for acc in accesses(expr.body):
            if isinstance(acc.source, Scope) and acc not in seen:
                seen.append(acc)
                try:
                    yield inline_scope(expr, acc)
                except ValueError:
                    continue
