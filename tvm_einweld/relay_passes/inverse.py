"""Inverse maps ψ of iterator substitutions Φ, inferred from sample points and then proven.

Variable substitution needs ψ with ψ(Φ(x)) = x. For the Φ that occur in practice (offsets
h + r, pairs (y//s − k, y%s + s·k) of a strided transposed convolution, merges a·B + b) each
component of ψ is either affine in the new iterators or one new iterator shifted and then
divided or reduced by a constant that appears in Φ. `infer_inverse` fits those templates on
points of the domain; the fit is only a proposal: the rule's side condition proves
ψ∘Φ = id with z3 before anything uses it.
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..expr import index as ix
from ..expr.expression import Iterator
from ..expr.index import IndexExpr
from .deadline import check_deadline

MAX_POINTS = 4096


def _points(domain: Sequence[Iterator], rng: np.random.Generator) -> Dict[str, np.ndarray]:
    total = math.prod(it.extent for it in domain)
    if total <= MAX_POINTS:
        grids = np.meshgrid(*[np.arange(it.lo, it.hi) for it in domain], indexing="ij")
        return {it.name: g.reshape(-1) for it, g in zip(domain, grids)}
    return {it.name: rng.integers(it.lo, it.hi, MAX_POINTS) for it in domain}


def divisors_in(exprs: Sequence[IndexExpr]) -> List[int]:
    """Constants that divide or multiply in the given index functions (candidate moduli)."""
    found = set()

    def visit(e: IndexExpr) -> None:
        if isinstance(e, ix.IBin):
            if e.op in ("//", "%", "*") and isinstance(e.rhs, ix.IConst) and abs(e.rhs.value) > 1:
                found.add(abs(e.rhs.value))
            visit(e.lhs)
            visit(e.rhs)

    for e in exprs:
        visit(e)
    return sorted(found)


def _fit_affine(features: Dict[str, np.ndarray], target: np.ndarray) -> Optional[IndexExpr]:
    names = sorted(features)
    x = np.stack([features[n].astype(np.float64) for n in names] + [np.ones_like(target, float)], 1)
    w, *_ = np.linalg.lstsq(x, target.astype(np.float64), rcond=None)
    w = np.rint(w).astype(np.int64)
    if not np.array_equal(x.astype(np.int64) @ w, target):
        return None
    return ix.from_linear({n: int(c) for n, c in zip(names, w[:-1]) if c}, int(w[-1]))


def _fit_floor(features: Dict[str, np.ndarray], target: np.ndarray,
               moduli: Sequence[int]) -> Optional[IndexExpr]:
    """target = (u + c) // d + shift or (u + c) % d + shift, for a feature u, a modulus d, the
    smallest offset c in [0, d) (// before % at the same c) and a constant shift."""
    for name, d in itertools.product(sorted(features), moduli):
        u = features[name]
        fits = [(c, k, op) for k, op in enumerate(_FLOOR_FNS)
                if (c := _first_offset(u, target, d, op)) is not None]
        if fits:
            c, _, op = min(fits)
            shift = int(target[0] - _FLOOR_FNS[op](u[:1] + c, d)[0])
            return ix.add(ix.build(op, ix.add(ix.IVar(name), c), d), shift)
    return None


_FLOOR_FNS = {"//": np.floor_divide, "%": np.mod}  # in preference order at equal offsets


def _first_offset(u: np.ndarray, target: np.ndarray, d: int, op: str,
                  sample: int = 64, chunk: int = 4096) -> Optional[int]:
    """The smallest c in [0, d) for which (u + c) op d − target is constant over all points.
    All offsets are screened at once on a few points (a large d made a loop over c slow),
    and the survivors are checked on every point."""
    fn = _FLOOR_FNS[op]
    us, ts = u[:sample], target[:sample]
    for start in range(0, d, chunk):
        check_deadline()  # a modulus of 10^5..10^6 makes this loop the search's longest step
        cs = np.arange(start, min(d, start + chunk), dtype=np.int64)
        diff = fn(us[None, :] + cs[:, None], d) - ts[None, :]
        for c in cs[np.all(diff == diff[:, :1], axis=1)]:
            full = fn(u + c, d) - target
            if np.all(full == full[0]):
                return int(c)
    return None


def infer_inverse(phi: Mapping[str, IndexExpr], domain: Sequence[Iterator],
                  seed: int = 0) -> Optional[Dict[str, IndexExpr]]:
    """ψ: {domain iterator: expression over Φ's new iterators} fitted on domain points, or
    None when some component fits no template. Unproven: callers must prove ψ∘Φ = id."""
    points = _points(domain, np.random.default_rng(seed))
    features = {name: np.asarray(ix.evaluate(e, points), dtype=np.int64) * np.ones_like(
        next(iter(points.values()))) for name, e in phi.items()}
    moduli = sorted(set(divisors_in(list(phi.values()))) | {it.extent for it in domain
                                                             if it.extent > 1})
    psi: Dict[str, IndexExpr] = {}
    for it in domain:
        target = points[it.name]
        fitted = _fit_affine(features, target)
        if fitted is None:
            fitted = _fit_floor(features, target, moduli)
        if fitted is None:
            return None
        psi[it.name] = fitted
    return psi
