"""Polynomial stand-ins for non-linear functions, and residues for rational constants.

TASO checks rewrites with relu replaced by x·(x+1)+1: a rewrite that is correct for every
function is correct for that polynomial, and a polynomial shows every difference (relu hides
differences on negative inputs). Using the *same* polynomial for every function would let a
rewrite that turns relu into tanh pass, so each function gets its own: f_k(x) = x·(x+k)+1,
with k = 1 for relu (TASO's choice) and distinct k for the others. `neg` is linear and is kept
exactly as 0 - x.

For evaluation modulo a prime, constants that are not integers (a scale of 0.5) are dyadic
rationals; q = num/den maps to num·den⁻¹ mod p, a ring homomorphism, so identities between
rationals survive. The interpreter accepts integer constants only, so such constants become
reads of one-element tensors that hold their residue, named identically on both sides.
"""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Dict, Optional

import numpy as np

from ..expr.expression import (
    Access, BinaryOp, Constant, Expr, Scalar, Scope, Tensor, UnaryOp, UNARY_FUNCTIONS,
)

# The k of x·(x+k)+1 per function; relu keeps TASO's x·(x+1)+1.
STAND_IN_OFFSETS: Dict[str, int] = {
    fn: k for k, fn in enumerate(("relu",) + tuple(f for f in UNARY_FUNCTIONS if f != "relu"),
                                 start=1)
}

CONSTANT_PREFIX = "__const"


def stand_in(fn: str, x: Scalar) -> Scalar:
    """The polynomial that replaces `fn(x)` in checks."""
    if fn == "neg":
        return BinaryOp("-", Constant(0.0), x)
    return BinaryOp("+", BinaryOp("*", x, BinaryOp("+", x, Constant(float(STAND_IN_OFFSETS[fn])))),
                    Constant(1.0))


class Arithmetizer:
    """Rewrites expressions into +, -, * only, for exact or polynomial evaluation.

    `modulus` set: non-integer constants become one-element tensors (see `arrays`).
    """

    def __init__(self, modulus: Optional[int] = None) -> None:
        self.modulus = modulus
        self.tensors: Dict[float, Tensor] = {}

    def expr(self, e: Expr) -> Expr:
        return replace(e, body=self.scalar(e.body))

    def scalar(self, s: Scalar) -> Scalar:
        if isinstance(s, Constant):
            if self.modulus is None or float(s.value).is_integer():
                return s
            if s.value not in self.tensors:
                self.tensors[s.value] = Tensor(f"{CONSTANT_PREFIX}{len(self.tensors)}", (1,))
            return Access(self.tensors[s.value], (0,))
        if isinstance(s, Access):
            if isinstance(s.source, Scope):
                return Access(replace(s.source, expr=self.expr(s.source.expr)), s.indices)
            return s
        if isinstance(s, BinaryOp):
            return BinaryOp(s.op, self.scalar(s.lhs), self.scalar(s.rhs))
        if isinstance(s, UnaryOp):
            return stand_in(s.fn, self.scalar(s.arg))
        raise TypeError(f"unknown scalar node {type(s).__name__}")

    def arrays(self) -> Dict[str, np.ndarray]:
        """Inputs holding the residues of the constants met so far."""
        return {t.name: np.array([self.residue(value)], dtype=np.int64)
                for value, t in self.tensors.items()}

    def residue(self, value: float) -> int:
        if self.modulus is None:
            raise ValueError("residues need a modulus")
        q = Fraction(value)  # exact: a float is a dyadic rational
        p = self.modulus
        return q.numerator % p * pow(q.denominator, -1, p) % p


__all__ = ["Arithmetizer", "stand_in", "STAND_IN_OFFSETS", "CONSTANT_PREFIX"]
