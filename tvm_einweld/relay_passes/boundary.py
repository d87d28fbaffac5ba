"""Boundary relaxing and tightening (EinNet §4.1).

    L_x^X f  ⇔  L_x^{X'} f      with X ⊂ X' and f = 0 on X' \\ X.

Tightening shrinks the range of an iterator where the removed slabs are provably zero
(`prove_constant_region`): for a summation iterator the removed terms add nothing, for the
traversal iterator of a scope the removed outputs were zeros and become zero padding of the
scope (`derivation.rescope`), so readers see the same values. LevelRewrite ranges are inferred
from the index functions: the iterator values at which some access can still reach data rather
than padding.

Relaxing widens a range to a rounder extent (5 → 6, so a 5×5 kernel can be split by 2 or 3),
padding the tensors that the new points read. The new slab must again be provably zero. The top
level's traversal ranges are the output shape and are never changed.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Tuple

from ..expr import index as ix
from ..expr.expression import Expr, accesses
from ..verify.smt import prove_constant_region
from .derivation import LevelRewrite, Rule, trim_padding, widen_padding, with_ranges

Range = Tuple[int, int]


def _changeable(expr: Expr, is_top: bool) -> List[str]:
    names = [it.name for it in expr.sums]
    if not is_top:
        names = [it.name for it in expr.traversals] + names
    return names


def _zero_slabs(expr: Expr, name: str, new: Range):
    """Side conditions: the body is zero on the part of `name`'s range outside `new`."""
    it = expr.iterator(name)
    lo, hi = min(it.lo, new[0]), max(it.hi, new[1])
    inner_lo, inner_hi = max(it.lo, new[0]), min(it.hi, new[1])
    slabs = [(lo, inner_lo)] if lo < inner_lo else []
    if inner_hi < hi:
        slabs.append((inner_hi, hi))
    return tuple((lambda s=s: prove_constant_region(expr, {name: s})) for s in slabs)


def tighten(expr: Expr, name: str, new: Range) -> LevelRewrite:
    """Shrink `name` to `new`; the removed slabs must be zero."""
    it = expr.iterator(name)
    if not (it.lo <= new[0] < new[1] <= it.hi) or (new[0], new[1]) == (it.lo, it.hi):
        raise ValueError(f"[{new[0]}, {new[1]}) does not tighten {it}")
    result = trim_padding(with_ranges(expr, {name: new}))
    return LevelRewrite(result, _zero_slabs(expr, name, new),
                     f"tighten {name} from [{it.lo}, {it.hi}) to [{new[0]}, {new[1]})")


def relax(expr: Expr, name: str, new: Range) -> LevelRewrite:
    """Widen `name` to `new`, padding what the new points read; the new slabs must be zero."""
    it = expr.iterator(name)
    if not (new[0] <= it.lo and it.hi <= new[1]) or (new[0], new[1]) == (it.lo, it.hi):
        raise ValueError(f"[{new[0]}, {new[1]}) does not relax {it}")
    result = widen_padding(with_ranges(expr, {name: new}))
    return LevelRewrite(result, _zero_slabs(result, name, (it.lo, it.hi)),
                     f"relax {name} from [{it.lo}, {it.hi}) to [{new[0]}, {new[1]})")


def support(expr: Expr, name: str) -> List[Range]:
    """For each access, the range of `name` outside which that access reads only padding.

    Interval reasoning over the linear index functions; an over-approximation of the true
    support, so the result is a candidate that the z3 check then confirms or refutes.
    """
    it = expr.iterator(name)
    others = {k: v for k, v in expr.ranges.items() if k != name}
    found: List[Range] = []
    for acc in accesses(expr.body):
        lo, hi = it.lo, it.hi
        for idx, o, n in zip(acc.indices, acc.source.origin, acc.source.shape):
            form = ix.linear_form(idx)
            if form is None or name not in form[0]:
                continue
            coeffs, const = form
            c = coeffs[name]
            rest = ix.from_linear({k: v for k, v in coeffs.items() if k != name}, const)
            rmin, rmax = ix.bounds(rest, others)
            # c·t + rest must be able to reach [o, o + n - 1].
            if c > 0:
                t_lo, t_hi = math.ceil((o - rmax) / c), math.floor((o + n - 1 - rmin) / c)
            else:
                t_lo, t_hi = math.ceil((o + n - 1 - rmin) / c), math.floor((o - rmax) / c)
            lo, hi = max(lo, t_lo), min(hi, t_hi + 1)
        if lo < hi and (lo, hi) != (it.lo, it.hi) and (lo, hi) not in found:
            found.append((lo, hi))
    return found


class BoundaryTightening(Rule):
    """Shrink one iterator to the support of one access (inferred, then proven)."""

    name = "boundary_tightening"

    def __init__(self, names: Optional[Iterable[str]] = None) -> None:
        self.names = set(names) if names is not None else None

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        for name in _changeable(expr, is_top):
            if self.names is not None and name not in self.names:
                continue
            for new in support(expr, name):
                yield tighten(expr, name, new)


def rounder_extents(extent: int, factors: Iterable[int] = (2, 3)) -> List[int]:
    """Extents just above `extent` that are multiples of the given small factors."""
    out = sorted({-(-extent // f) * f for f in factors} - {extent})
    return [e for e in out if e > extent]


class BoundaryRelaxing(Rule):
    """Widen one iterator's range at its upper end to a multiple of 2 or 3 (5 → 6).

    `to` gives explicit new ranges {name: (lo, hi)} for hand-sequenced derivations.
    """

    name = "boundary_relaxing"
    # Not searched: it applies to almost every state (one instance per iterator); its one
    # combination that matters for operators is `WindowSplitting`.
    searched = False

    def __init__(self, to: Optional[Dict[str, Range]] = None) -> None:
        self.to = dict(to) if to is not None else None

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        for name in _changeable(expr, is_top):
            it = expr.iterator(name)
            if self.to is not None:
                targets = [self.to[name]] if name in self.to else []
            else:
                targets = [(it.lo, it.lo + e) for e in rounder_extents(it.extent)]
            for new in targets:
                yield relax(expr, name, new)
