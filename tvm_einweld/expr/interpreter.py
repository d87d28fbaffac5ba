"""Exact numpy interpreter for tensor-algebra expressions.

`evaluate(expr, inputs)` computes every output element of `expr` from input arrays, honouring
padding and iterator ranges that start below zero (see `expression.py` for the semantics).
It is the reference every derivation and every lowering is checked against, so it favours
being obviously right; it is vectorised over the whole iteration space, cut into chunks of at
most `CHUNK_ELEMENTS` points, so a 1×64×56×56 3×3 convolution takes seconds.

Two arithmetic modes:
  * real: float64 arithmetic, unary functions as numpy functions;
  * modular (`modulus=p`): int64 arithmetic modulo a prime, for exact screening of multilinear
    rewrites (no rounding noise). Unary functions must be replaced by a polynomial then
    (`polynomial_nonlinear=True`, TASO's x·(x+1)+1), since relu has no meaning modulo p.
"""
from __future__ import annotations

import itertools
import math
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from . import index as ix
from .expression import Access, BinaryOp, Constant, Expr, Scalar, Scope, Tensor, UnaryOp

CHUNK_ELEMENTS = 1 << 22

_UNARY_NUMPY = {
    "relu": lambda x: np.maximum(x, 0.0),
    "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "exp": np.exp,
    "neg": np.negative,
    "sqrt": np.sqrt,
    "abs": np.abs,
}


class EvaluationError(ValueError):
    """The expression cannot be evaluated: an access outside a tensor's padded bounds, a
    missing or mis-shaped input, or an operation with no meaning in the chosen arithmetic."""


def polynomial_stand_in(x):
    """TASO's replacement for non-linear functions when checking rewrites: x·(x+1)+1.

    It is not linear, so a rewrite that wrongly moves a relu across an add still shows up,
    and it is a polynomial, so it is exact modulo a prime.
    """
    return x * (x + 1) + 1


def evaluate(
    expr: Expr,
    inputs: Mapping[str, np.ndarray],
    *,
    modulus: Optional[int] = None,
    polynomial_nonlinear: bool = False,
) -> np.ndarray:
    """Evaluate `expr` on named input arrays; returns an array of shape `expr.shape`.

    Real mode returns float64; modular mode returns int64 values in [0, modulus).
    """
    return _Evaluator(inputs, modulus, polynomial_nonlinear).expr(expr)


class _Evaluator:
    def __init__(self, inputs, modulus, polynomial_nonlinear) -> None:
        if modulus is not None and not (1 < modulus < 2**31):
            raise ValueError("modulus must be in (1, 2**31) so products fit in int64")
        self.modulus = modulus
        self.polynomial = polynomial_nonlinear
        self.dtype = np.int64 if modulus is not None else np.float64
        self.inputs = {k: self._convert(k, v) for k, v in inputs.items()}
        self.scope_values: Dict[Scope, np.ndarray] = {}
        self.padded: Dict[Tuple[int, tuple], np.ndarray] = {}

    def _convert(self, name: str, value) -> np.ndarray:
        arr = np.asarray(value)
        if self.modulus is not None:
            if not np.issubdtype(arr.dtype, np.integer):
                raise EvaluationError(f"modular evaluation needs integer input {name}")
            return np.mod(arr.astype(np.int64), self.modulus)
        return arr.astype(np.float64)

    def _reduce(self, x):
        return np.mod(x, self.modulus) if self.modulus is not None else x

    # -- sources -------------------------------------------------------------------------
    def source(self, src) -> np.ndarray:
        if isinstance(src, Scope):
            if src not in self.scope_values:
                self.scope_values[src] = self.expr(src.expr)
            return self.scope_values[src]
        if src.name not in self.inputs:
            raise EvaluationError(f"no input array given for tensor {src.name}")
        arr = self.inputs[src.name]
        if tuple(arr.shape) != src.shape:
            raise EvaluationError(
                f"input {src.name} has shape {tuple(arr.shape)}, expression expects {src.shape}"
            )
        return arr

    def padded_source(self, src) -> np.ndarray:
        arr = self.source(src)
        if not any(a or b for a, b in src.pad):
            return arr
        key = (id(arr), src.pad)
        if key not in self.padded:
            self.padded[key] = np.pad(arr, src.pad)
        return self.padded[key]

    # -- expressions ---------------------------------------------------------------------
    def expr(self, e: Expr) -> np.ndarray:
        out = np.zeros(e.shape, dtype=self.dtype)
        its = e.iterators
        n_trav = len(e.traversals)
        for chunk in _chunks(its, e.sums):
            env = {}
            for axis, (it, (start, stop)) in enumerate(zip(its, chunk)):
                shape = [1] * len(its)
                shape[axis] = stop - start
                env[it.name] = np.arange(start, stop, dtype=np.int64).reshape(shape)
            grid = tuple(stop - start for start, stop in chunk)
            value = np.broadcast_to(np.asarray(self.scalar(e.body, env), self.dtype), grid)
            if len(its) > n_trav:
                value = self._reduce(value.sum(axis=tuple(range(n_trav, len(its)))))
            where = tuple(
                slice(start - it.lo, stop - it.lo)
                for it, (start, stop) in zip(e.traversals, chunk[:n_trav])
            )
            out[where] = self._reduce(out[where] + value)
        return out

    def scalar(self, s: Scalar, env):
        if isinstance(s, Access):
            return self.access(s, env)
        if isinstance(s, Constant):
            if self.modulus is None:
                return s.value
            if not float(s.value).is_integer():
                raise EvaluationError(f"constant {s.value} has no value modulo a prime")
            return int(s.value) % self.modulus
        if isinstance(s, BinaryOp):
            lhs, rhs = self.scalar(s.lhs, env), self.scalar(s.rhs, env)
            if s.op == "+":
                return self._reduce(lhs + rhs)
            if s.op == "-":
                return self._reduce(lhs - rhs)
            return self._reduce(lhs * rhs)
        if isinstance(s, UnaryOp):
            arg = self.scalar(s.arg, env)
            if s.fn == "neg":  # linear: exact in both arithmetics, nothing to stand in for
                return self._reduce(-arg)
            if self.polynomial:
                return self._reduce(polynomial_stand_in(np.asarray(arg, self.dtype)))
            if self.modulus is not None:
                raise EvaluationError(
                    f"{s.fn} has no value modulo a prime; use polynomial_nonlinear=True"
                )
            return _UNARY_NUMPY[s.fn](arg)
        raise TypeError(f"unknown scalar node {type(s).__name__}")

    def access(self, a: Access, env):
        src = a.source
        arr = self.padded_source(src)
        positions = []
        for d, idx in enumerate(a.indices):
            value = np.asarray(ix.evaluate(idx, env), dtype=np.int64)
            lo = src.origin[d] - src.pad[d][0]
            hi = src.origin[d] + src.shape[d] + src.pad[d][1]
            vmin, vmax = int(value.min()), int(value.max())
            if vmin < lo or vmax >= hi:
                raise EvaluationError(
                    f"access {a} reads index {vmin if vmin < lo else vmax} of dimension {d}, "
                    f"outside its padded bounds [{lo}, {hi})"
                )
            positions.append(value - lo)
        return arr[tuple(positions)]


def _chunks(its, sums):
    """Split the iteration space into boxes of at most CHUNK_ELEMENTS points.

    Summation iterators are split first (the partial sums accumulate into the output), then
    traversal iterators.
    """
    sizes = {it.name: it.extent for it in its}
    sum_names = {it.name for it in sums}
    while math.prod(sizes.values()) > CHUNK_ELEMENTS:
        candidates = [n for n in sizes if sizes[n] > 1]
        preferred = [n for n in candidates if n in sum_names] or candidates
        name = max(preferred, key=lambda n: sizes[n])
        sizes[name] = (sizes[name] + 1) // 2
    per_iterator = [
        [(s, min(s + sizes[it.name], it.hi)) for s in range(it.lo, it.hi, sizes[it.name])]
        for it in its
    ]
    return itertools.product(*per_iterator)


def random_inputs(expr: Expr, seed: int = 0, *, low: float = -1.0, high: float = 1.0,
                  modulus: Optional[int] = None) -> Dict[str, np.ndarray]:
    """Random arrays for every input tensor of `expr` (uniform reals, or residues mod p)."""
    from .expression import input_tensors

    rng = np.random.default_rng(seed)
    out = {}
    for name, t in sorted(input_tensors(expr).items()):
        if modulus is not None:
            out[name] = rng.integers(0, modulus, size=t.shape, dtype=np.int64)
        else:
            out[name] = rng.uniform(low, high, size=t.shape).astype(np.float32)
    return out


__all__ = ["evaluate", "random_inputs", "EvaluationError", "polynomial_stand_in", "Tensor"]
