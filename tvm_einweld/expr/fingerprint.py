"""Fingerprints and structural equality of expressions (EinNet §6.2).

The derivation search reaches the same expression along many rule sequences; a fingerprint
lets it drop repeats cheaply. The fingerprint is invariant under
  * summation reordering (Σ_x Σ_y = Σ_y Σ_x),
  * operand reordering of commutative operations (+ and *, in bodies and index functions),
  * iterator renaming (iterators are identified by their role, not their names),
  * renaming of equal tensors (a scope is identified by its own expression, not a name),
and sensitive to traversal order (a transposed output is a different tensor).

EinNet identifies a summation iterator by its range alone, so Σ_{r,s} K[r,s]·A[r,s] and
Σ_{r,s} K[s,r]·A[r,s] collide when r and s have equal ranges. Here summation iterators are
coloured by their range and then refined by where they occur (which tensor, which dimension,
in which index function), as in Weisfeiler–Lehman graph hashing, so such pairs differ.

A fingerprint hit is only a hint: `structurally_equal` confirms it on a canonical form
(iterators renamed by role, sums and commutative operands sorted) before a state is dropped.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from functools import lru_cache
from typing import Dict, Mapping

from . import index as ix
from .expression import Access, BinaryOp, Constant, Expr, Scalar, Tensor, UnaryOp, accesses

_MAX_TIE_PERMUTATIONS = 720


def _digest(obj) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=12).hexdigest()


# --- index functions ----------------------------------------------------------------------

def _index_key(e: ix.IndexExpr, names: Mapping[str, object]):
    """A rename- and commutation-invariant key of an index function.

    Affine functions become their sorted linear form, so h+r-1, r+h-1 and (h-1)+r agree.
    """
    lin = ix.linear_form(e)
    if lin is not None:
        coeffs, const = lin
        return ("lin", tuple(sorted((repr(names[n]), c) for n, c in coeffs.items())), const)
    if isinstance(e, ix.IBin):
        return ("op", e.op, _index_key(e.lhs, names), _index_key(e.rhs, names))
    raise TypeError(f"unexpected index node {e!r}")


# --- bodies --------------------------------------------------------------------------------

def _flatten(s: Scalar, op: str):
    if isinstance(s, BinaryOp) and s.op == op:
        return _flatten(s.lhs, op) + _flatten(s.rhs, op)
    return [s]


def _body_key(s: Scalar, names: Mapping[str, object]):
    if isinstance(s, Access):
        return ("acc", _source_key(s.source), tuple(_index_key(i, names) for i in s.indices))
    if isinstance(s, Constant):
        return ("const", float(s.value))
    if isinstance(s, UnaryOp):
        return ("fn", s.fn, _body_key(s.arg, names))
    if s.op in ("+", "*"):
        children = sorted((_body_key(c, names) for c in _flatten(s, s.op)), key=repr)
        return (s.op, tuple(children))
    return ("-", _body_key(s.lhs, names), _body_key(s.rhs, names))


@lru_cache(maxsize=65536)
def _source_key(src) -> tuple:
    if isinstance(src, Tensor):
        return ("tensor", src.name, src.shape, src.pad, src.dtype)
    return ("scope", canonical_form(src.expr), src.pad)


# --- summation iterator colours -------------------------------------------------------------

def _sum_colours(e: Expr) -> Dict[str, str]:
    """Colour each summation iterator by its range, refined by the places it is used."""
    trav = {it.name: ("T", k, it.lo, it.hi) for k, it in enumerate(e.traversals)}
    colours = {it.name: _digest(("S", it.lo, it.hi)) for it in e.sums}
    accs = list(accesses(e.body))
    for _ in range(len(e.sums)):
        refined = {}
        for it in e.sums:
            contexts = []
            for acc in accs:
                for d, idx in enumerate(acc.indices):
                    if it.name in ix.free_vars(idx):
                        names = {**trav, **colours, it.name: "SELF"}
                        contexts.append((_source_key(acc.source), d, _index_key(idx, names)))
            refined[it.name] = _digest((colours[it.name], sorted(map(repr, contexts))))
        stable = len(set(refined.values())) == len(set(colours.values()))
        colours = refined
        if stable:
            break
    return colours


# --- public API ------------------------------------------------------------------------------

def fingerprint(e: Expr) -> str:
    """A hash of `e` that is invariant under the redundancies listed in the module docstring."""
    return _digest(_fingerprint_key(e))


@lru_cache(maxsize=65536)
def _fingerprint_key(e: Expr):
    names: Dict[str, object] = {it.name: ("T", k, it.lo, it.hi) for k, it in enumerate(e.traversals)}
    colours = _sum_colours(e)
    names.update({n: ("S", c) for n, c in colours.items()})
    sums = tuple(sorted(colours.values()))
    return (e.dtype, tuple(names[it.name] for it in e.traversals), sums, _body_key(e.body, names))


@lru_cache(maxsize=65536)
def canonical_form(e: Expr) -> tuple:
    """A form of `e` in which iterators are renamed by role and commutative operands sorted.

    Two expressions with equal canonical forms compute the same function of their inputs.
    Summation iterators with equal colours are tried in every order (up to a bound) and the
    smallest form is kept, so the form does not depend on how sums were written.
    """
    trav = {it.name: f"t{k}:{it.lo}:{it.hi}" for k, it in enumerate(e.traversals)}
    colours = _sum_colours(e)
    groups: Dict[str, list] = {}
    for it in e.sums:
        groups.setdefault(colours[it.name], []).append(it)
    ordered = [groups[c] for c in sorted(groups)]
    choices = [list(itertools.permutations(g)) for g in ordered]
    if math.prod(len(c) for c in choices) > _MAX_TIE_PERMUTATIONS:
        choices = [[tuple(sorted(g, key=lambda it: it.name))] for g in ordered]
    best = None
    for combo in itertools.product(*choices):
        names = dict(trav)
        sums = []
        for k, it in enumerate(itertools.chain.from_iterable(combo)):
            names[it.name] = f"s{k}:{it.lo}:{it.hi}"
            sums.append(names[it.name])
        form = (e.dtype, tuple(trav[it.name] for it in e.traversals), tuple(sums),
                _body_key(e.body, names))
        if best is None or repr(form) < repr(best):
            best = form
    return best


def structurally_equal(a: Expr, b: Expr) -> bool:
    """True when `a` and `b` are the same expression up to renaming and reordering."""
    return a == b or canonical_form(a) == canonical_form(b)


__all__ = ["fingerprint", "canonical_form", "structurally_equal"]

