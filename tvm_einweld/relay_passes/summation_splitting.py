"""Summation splitting (EinNet §4.1): Σ_{s1,s2} f  ↦  Σ_{s1} {L_{x,s1} Σ_{s2} f}[x, s1].

The inner sum is materialised as a scope whose traversal iterators are the outer traversal
iterators followed by the kept summation iterators s1, with the same ranges, so the outer
expression reads it with the identity index. Splitting a finite sum in two nested sums is an
identity of arithmetic, so the rule has no side condition.
"""
from __future__ import annotations

import itertools
from typing import FrozenSet, Iterable, Optional

from ..expr.expression import Access, Expr, Scope
from .derivation import LevelRewrite, Rule


def split_summation(expr: Expr, inner: FrozenSet[str]) -> LevelRewrite:
    """Sum over the iterators named in `inner` inside a new scope."""
    names = {it.name for it in expr.sums}
    if not inner or not set(inner) < names:
        raise ValueError(f"inner sum {sorted(inner)} must be a non-empty proper subset of "
                         f"{sorted(names)}")
    kept = tuple(it for it in expr.sums if it.name not in inner)
    moved = tuple(it for it in expr.sums if it.name in inner)
    scope = Scope(Expr(expr.traversals + kept, moved, expr.body, expr.dtype))
    read = Access(scope, tuple(it.var for it in expr.traversals + kept))
    result = Expr(expr.traversals, kept, read, expr.dtype)
    return LevelRewrite(result, (), f"Σ{{{', '.join(sorted(inner))}}} materialised as a scope")


class SummationSplitting(Rule):
    """Every split of the summation iterators into an outer and an inner group.

    `inner` restricts the rule to one split (for hand-sequenced derivations).
    """

    name = "summation_splitting"

    def __init__(self, inner: Optional[Iterable[str]] = None) -> None:
        self.inner = frozenset(inner) if inner is not None else None

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        names = [it.name for it in expr.sums]
        for k in range(1, len(names)):
            for group in itertools.combinations(names, k):
                if self.inner is None or frozenset(group) == self.inner:
                    yield split_summation(expr, frozenset(group))
