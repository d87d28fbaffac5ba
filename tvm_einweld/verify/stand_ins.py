"""Polynomial stand-ins for non-linear functions, and residues for rational constants.

TASO checks rewrites with relu replaced by x·(x+1)+1: a rewrite that is correct for every
function is correct for that polynomial, and a polynomial shows every difference (relu hides
differences on negative inputs). Two refinements keep the check honest:

  * each function gets its own stand-in, c2·x² + c1·x + c0 with coefficients per function,
    so a rewrite that turns relu into tanh cannot pass;
  * the coefficients are inputs of the check, not constants of the expression: float testing
    uses TASO's fixed x·(x+k)+1 (k = 1 for relu, distinct k for the others), exact screening
    draws them at random modulo p in every draw. A rewrite is then accepted only if it holds
    for the function as an unknown (a random polynomial), so even a rewrite tailored to the
    fixed stand-in, such as x·(x+1)+1 → relu(x), is rejected.

`neg` is linear and is kept exactly, as 0 - x.

For evaluation modulo a prime, constants that are not integers (a scale of 0.5) are dyadic
rationals; q = num/den maps to num·den⁻¹ mod p, a ring homomorphism, so identities between
rationals survive. The interpreter accepts integer constants only, so such constants become
reads of one-element tensors that hold their residue, named identically on both sides.
"""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Dict, Optional, Tuple

import numpy as np

from ..expr.expression import (
    Access, BinaryOp, Constant, Expr, Scalar, Scope, Tensor, UnaryOp, UNARY_FUNCTIONS,
)
from ..expr.index import IConst
from ..expr.interpreter import EvaluationError

# The k of the float stand-in x·(x+k)+1 per function; relu keeps TASO's x·(x+1)+1.
STAND_IN_OFFSETS: Dict[str, int] = {
    fn: k for k, fn in enumerate(("relu",) + tuple(f for f in UNARY_FUNCTIONS if f != "relu"),
                                 start=1)
}

PREFIX = "__verify_"  # names of the one-element tensors this module adds


class Arithmetizer:
    """Rewrites expressions into +, -, * only; the added inputs come from `arrays(seed)`.

    One instance must serve both sides of a comparison, so equal functions and constants on
    the two sides read the same added tensors.
    """

    def __init__(self, modulus: Optional[int] = None) -> None:
        self.modulus = modulus
        self.constants: Dict[float, Tensor] = {}
        self.coefficients: Dict[Tuple[str, int], Tensor] = {}

    def expr(self, e: Expr) -> Expr:
        return replace(e, body=self.scalar(e.body))

    def scalar(self, s: Scalar) -> Scalar:
        if isinstance(s, Constant):
            if self.modulus is None or float(s.value).is_integer():
                return s
            if s.value not in self.constants:
                self.constants[s.value] = Tensor(f"{PREFIX}const{len(self.constants)}", (1,))
            return _read(self.constants[s.value])
        if isinstance(s, Access):
            if isinstance(s.source, Scope):
                return Access(replace(s.source, expr=self.expr(s.source.expr)), s.indices)
            return s
        if isinstance(s, BinaryOp):
            return BinaryOp(s.op, self.scalar(s.lhs), self.scalar(s.rhs))
        if isinstance(s, UnaryOp):
            return self.stand_in(s.fn, self.scalar(s.arg))
        raise TypeError(f"unknown scalar node {type(s).__name__}")

    def stand_in(self, fn: str, x: Scalar) -> Scalar:
        """c2·x·x + c1·x + c0 with this function's coefficient tensors (neg stays 0 - x)."""
        if fn == "neg":
            return BinaryOp("-", Constant(0.0), x)
        c2, c1, c0 = (_read(self._coefficient(fn, j)) for j in (2, 1, 0))
        return c2 * x * x + c1 * x + c0

    def _coefficient(self, fn: str, power: int) -> Tensor:
        key = (fn, power)
        if key not in self.coefficients:
            self.coefficients[key] = Tensor(f"{PREFIX}{fn}_c{power}", (1,))
        return self.coefficients[key]

    def arrays(self, seed: int) -> Dict[str, np.ndarray]:
        """Values of the added tensors: constants' residues and the stand-ins' coefficients
        (TASO's fixed ones for floats, random residues drawn from `seed` modulo p)."""
        out: Dict[str, np.ndarray] = {}
        rng = np.random.default_rng([seed, 0x5EED])
        for (fn, power), t in sorted(self.coefficients.items()):
            if self.modulus is None:
                value = STAND_IN_OFFSETS[fn] if power == 1 else 1
                out[t.name] = np.array([value], dtype=np.float32)
            else:
                out[t.name] = rng.integers(0, self.modulus, size=1, dtype=np.int64)
        for value, t in self.constants.items():
            out[t.name] = np.array([self.residue(value)], dtype=np.int64)
        return out

    def residue(self, value: float) -> int:
        if self.modulus is None:
            raise ValueError("residues need a modulus")
        if not np.isfinite(value):
            raise EvaluationError(f"constant {value} has no residue modulo a prime")
        q = Fraction(value)  # exact: a finite float is a dyadic rational
        p = self.modulus
        return q.numerator % p * pow(q.denominator, -1, p) % p


def _read(t: Tensor) -> Access:
    return Access(t, (IConst(0),))


__all__ = ["Arithmetizer", "STAND_IN_OFFSETS", "PREFIX"]
