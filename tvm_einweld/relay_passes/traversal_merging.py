"""Traversal merging (EinNet §4.1): inline a scope into the expression that reads it.

    L_x Σ_y {L_z Σ_w g}[Φ(x, y)]  ↦  L_x Σ_{y, w'} g[z := Φ(x, y)]

Side condition Φ(X×Y) ⊆ Z (z3, `prove_image_within`): every read of the scope lands inside
its range, so the inlined body computes exactly the values that were read.

A scope with zero padding may be read in that padding (after boundary tightening, say). Its
padding then moves onto the tensors: the scope's range is first relaxed over its padded box Z'
(side condition: its body is zero on the added slabs, `prove_constant_region`, so the relaxed
scope has the same values everywhere it can be read), and the reads only need Φ(X×Y) ⊆ Z'.
The inlined body's tensors are padded as far as the new index functions reach (widening only
adds zeros).

A scope with its own summation can only be inlined when the outer body is that single access
(the inner sum then joins the outer sum); otherwise the sum would be pulled through f.
"""
from __future__ import annotations

from typing import Dict, Iterable

from ..expr import index as ix
from ..expr.expression import (
    Access, Expr, Iterator, Scope, accesses, map_accesses, substitute_body,
)
from ..verify.smt import prove_constant_region, prove_image_within
from .derivation import LevelRewrite, Rule, fresh_name, widen_padding, with_ranges


def inline_scope(expr: Expr, access: Access) -> LevelRewrite:
    """Inline the scope read by `access` (an access of `expr`'s body)."""
    scope = access.source
    if not isinstance(scope, Scope):
        raise ValueError("traversal merging needs an access to a scope")
    inner = scope.expr
    if inner.sums and expr.body != access:
        raise ValueError("a scope with a summation can only be inlined when it is the whole body")
    # Relax the scope over its padding, so that reads of the padding read its (zero) body.
    padded = {it.name: (it.lo - pl, it.hi + ph)
              for it, (pl, ph) in zip(inner.traversals, scope.pad) if pl or ph}
    relaxed = widen_padding(with_ranges(inner, padded)) if padded else inner
    slabs = []
    for it in inner.traversals:
        if it.name in padded:
            lo, hi = padded[it.name]
            slabs += [(it.name, (lo, it.lo))] if lo < it.lo else []
            slabs += [(it.name, (it.hi, hi))] if it.hi < hi else []
    taken = {it.name for it in expr.iterators}
    renamed: Dict[str, ix.IndexExpr] = {}
    new_sums = []
    for it in relaxed.sums:
        name = fresh_name(taken, it.name) if it.name in taken else it.name
        taken.add(name)
        renamed[it.name] = ix.IVar(name)
        new_sums.append(Iterator(name, it.lo, it.hi))
    mapping = {it.name: idx for it, idx in zip(relaxed.traversals, access.indices)}
    mapping.update(renamed)
    inlined = substitute_body(relaxed.body, mapping)
    body = map_accesses(expr.body, lambda a: inlined if a == access else a)
    result = widen_padding(Expr(expr.traversals, expr.sums + tuple(new_sums), body, expr.dtype))
    box = [(it.lo, it.hi) for it in relaxed.traversals]
    domain = expr.iterators

    def within():
        return prove_image_within(access.indices, domain, box)

    zero_slabs = tuple((lambda n=n, r=r: prove_constant_region(relaxed, {n: r}))
                       for n, r in slabs)
    moved = " (its padding moved onto the tensors)" if padded else ""
    return LevelRewrite(result, zero_slabs + (within,),
                     f"inline scope read at [{', '.join(map(str, access.indices))}]{moved}")


class TraversalMerging(Rule):
    """Inline any scope read by the expression level (one candidate per distinct access)."""

    name = "traversal_merging"

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        seen = []
        for acc in accesses(expr.body):
            if isinstance(acc.source, Scope) and acc not in seen:
                seen.append(acc)
                try:
                    yield inline_scope(expr, acc)
                except ValueError:
                    continue
