"""Exact screening of rewrites: evaluate both sides over the integers modulo a prime.

Random float testing compares with a tolerance, so it can neither tell a tiny real difference
from rounding noise nor guarantee anything about near-cancelling sums. Modulo a prime p every
operation is exact: two polynomials in the inputs that differ agree on a random input with
probability at most deg/p (Schwartz–Zippel), about 1e-8 per draw for p ≈ 2^31 and small
degree, and several independent draws push that further down. Multilinear rewrites (all of
tensor algebra without non-linear functions) are therefore decided exactly, up to that
probability. Non-linear functions are replaced by polynomials with random coefficients,
drawn afresh in every draw, and rational constants by their residues (`stand_ins.py`),
identically on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..expr.expression import Expr
from ..expr.interpreter import EvaluationError, evaluate
from .inputs import draw, shape_mismatch, shared_tensors
from .stand_ins import Arithmetizer

DEFAULT_MODULUS = 2147483629  # a prime below 2**31, so products of residues fit in int64


@dataclass(frozen=True)
class ScreeningResult:
    """Outcome of exact screening: `mismatches` draws (of `draws`) where the outputs differ."""

    equal: bool
    what: str
    draws: int
    modulus: int
    mismatches: int

    def __str__(self) -> str:
        verdict = "equal" if self.equal else "NOT equal"
        return (f"{verdict} mod {self.modulus}: {self.what} "
                f"({self.mismatches}/{self.draws} draws differ)")


def screen_modular(
    a: Expr, b: Expr, draws: int = 3, modulus: int = DEFAULT_MODULUS, seed: int = 0
) -> ScreeningResult:
    """Compare `a` and `b` exactly modulo `modulus` on `draws` random integer inputs."""
    what = f"{a}  vs  {b}"
    why = shape_mismatch(a, b)
    tensors, why_inputs = shared_tensors(a, b)
    if why or tensors is None:
        return ScreeningResult(False, f"{why or why_inputs} ({what})", 0, modulus, 0)
    constants = Arithmetizer(modulus)
    a_int, b_int = constants.expr(a), constants.expr(b)
    mismatches, first = 0, ""
    for k in range(draws):
        try:
            inputs = {**draw(tensors, seed + k, modulus), **constants.arrays(seed + k)}
            va = evaluate(a_int, inputs, modulus=modulus)
            vb = evaluate(b_int, inputs, modulus=modulus)
        except EvaluationError as err:
            return ScreeningResult(False, f"evaluation failed: {err} ({what})", k, modulus,
                                   mismatches)
        differ = va != vb
        if differ.any():
            mismatches += 1
            if not first:
                at = tuple(int(i) for i in np.argwhere(differ)[0])
                first = (f"draw {k}: {int(differ.sum())} of {differ.size} elements differ, "
                         f"first at output position {at}; ")
    return ScreeningResult(mismatches == 0, first + what, draws, modulus, mismatches)


__all__ = ["ScreeningResult", "screen_modular", "DEFAULT_MODULUS"]
