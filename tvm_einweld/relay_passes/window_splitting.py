"""Window splitting: a sliding-window sum as a sum over offsets of a smaller window (EinNet
Fig. 6: conv 5×5 → conv 3×3 with 4× the output channels + an OffsetReduce eOperator).

For a factor k, every *window iterator* r ∈ [lo, lo + e) longer than k is rewritten by

    Σ_r f(r)  =  Σ_{r ∈ [lo, lo + k·⌈e/k⌉)} f(r)                 boundary relaxing: f = 0 on the
                                                                  new slab (it reads the zero
                                                                  padding relaxing adds)
              =  Σ_{a ∈ [0, ⌈e/k⌉)} Σ_{b ∈ [0, k)} f(lo + k·a + b)   summation-iterator splitting
                                                                  ((a, b) ↦ lo + k·a + b is a
                                                                  bijection onto the range)

and then the sums over everything but the offsets a (the windows b and the other summation
iterators, such as the channel) are materialised as one scope (summation splitting):

    L_x Σ_{a, b, c} f  =  L_x Σ_a { L_{x, a} Σ_{b, c} f }[x, a]

The scope is a k-window operator evaluated at every offset a (a k×k conv whose output channels
are multiplied by the offsets), the outer sum an eOperator adding the shifted results; variable
substitution (y + k·a − lo ↦ t) and traversal merging then bring the scope to the operator's
canonical form, which the converging derivation does on its own (each of those steps lowers
the expression distance or the cost).

A window iterator is a summation iterator that one access reads as a plain index (the kernel's
dimension, K[.., r, ..]) and another adds to a traversal iterator in a linear index function
(the window, A[.., y + r − 2, ..]): the iterators that make an operator a sliding-window one,
the `rs` group of conv2d in the iterator-mapping table.

Correctness: every step is one of the existing rules' rewrites with its side conditions (the
relaxed slabs provably zero, `boundary.relax`; the splits bijections, `variable_substitution.
split_sum_iterator`; summation splitting is an identity of finite sums), and all are proven by
z3 before the rule instance is used, so the rule is exactly as sound as the rules it combines.
It is one rule so that the search reaches a smaller window in one explorative step per factor:
the separate rules need a relax and a split per window iterator and then the summation split
(5 steps for a 2-D window), none of which lowers the expression distance, so converging
derivation cannot follow them and breadth-first exploration does not get that deep within its
budget. It is proposed only where it shortens a window: one instance per 2 ≤ k < the longest
window extent. It is used in explorative derivation only (`explorative_only`, see
`search.distance_guided_search`).
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

from ..expr import index as ix
from ..expr.expression import Expr, accesses
from ..expr.index import IVar
from .boundary import relax
from .derivation import LevelRewrite, Rule
from .summation_splitting import split_summation
from .variable_substitution import split_sum_iterator


def window_iterators(expr: Expr) -> List[str]:
    """Summation iterators read plainly by one access and, in a linear index function together
    with a traversal iterator, by another (in summation order)."""
    trav = {it.name for it in expr.traversals}
    plain, windowed = set(), set()
    for acc in accesses(expr.body):
        for idx in acc.indices:
            if isinstance(idx, IVar):
                plain.add(idx.name)
                continue
            form = ix.linear_form(idx)
            if form is not None and set(form[0]) & trav:
                windowed |= set(form[0]) - trav
    return [it.name for it in expr.sums if it.name in plain and it.name in windowed]


def split_window(expr: Expr, names: Sequence[str], factor: int) -> LevelRewrite:
    """Relax each named summation iterator to a multiple of `factor` where needed, split it as
    lo + factor·offset + window, and sum everything but the offsets in a scope. Side
    conditions: every relaxed slab is zero, every split is a bijection."""
    current, conditions, notes, offsets = expr, [], [], set()

    def then(cand: LevelRewrite) -> Expr:
        conditions.extend(cand.side_conditions)
        notes.append(cand.description)
        return cand.result

    for name in names:
        it = current.iterator(name)
        whole = -(-it.extent // factor) * factor
        if whole != it.extent:
            current = then(relax(current, name, (it.lo, it.lo + whole)))
        at = [s.name for s in current.sums].index(name)
        current = then(split_sum_iterator(current, name, factor))
        offsets.add(current.sums[at].name)  # the split puts (offset, window) where r was
    inner = frozenset(s.name for s in current.sums if s.name not in offsets)
    current = then(split_summation(current, inner))
    return LevelRewrite(current, tuple(conditions), "; ".join(notes))


class WindowSplitting(Rule):
    """Rewrite the window iterators of a level as offsets of a k-wide window (relaxing them to
    a multiple of k first, 5 → 6 for k = 3) and sum the k-window operator in a scope: one
    instance per 2 ≤ k < the longest window extent, each splitting every window iterator
    longer than k. `factors` restricts k (hand-sequenced derivations)."""

    name = "window_splitting"
    # Explorative derivation only: the rule makes a level larger (relaxing adds terms) to
    # reach another operator instance; in converging derivation it would only lower the
    # distance by accident (its offsets look like a transposed conv's output iterators) and
    # lead nowhere, at the cost of many states.
    explorative_only = True

    def __init__(self, factors: Optional[Iterable[int]] = None) -> None:
        self.factors = set(factors) if factors is not None else None

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        window = window_iterators(expr)
        if not window:
            return
        longest = max(expr.iterator(n).extent for n in window)
        for k in range(2, longest):
            if self.factors is None or k in self.factors:
                yield split_window(expr, [n for n in window if expr.iterator(n).extent > k], k)


__all__ = ["WindowSplitting", "split_window", "window_iterators"]
