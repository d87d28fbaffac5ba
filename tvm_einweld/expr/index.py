"""Index functions: integer expressions over iterators built with + - * // %.

They subscript tensors (EinNet §3, "tensor indexing"). `//` and `%` are floor division and
floor modulo with a positive constant divisor, as in Python, numpy, TIR's floordiv/floormod
and z3's integer div/mod, so every consumer of an index function agrees on its value.

The smart constructors fold constants and drop neutral elements, so derivation rules can build
index functions without leaving `x * 1 + 0` behind.
"""
from __future__ import annotations

from dataclasses import dataclass
import operator
from typing import Callable, Dict, Mapping, Optional, Tuple, Union

IndexLike = Union["IndexExpr", int]

_OPS = ("+", "-", "*", "//", "%")


class IndexExpr:
    """Base class of index expressions. Instances are immutable and hashable."""

    __slots__ = ()

    # Operators build expressions through the folding constructors below.
    def __add__(self, other: IndexLike) -> "IndexExpr":
        return add(self, other)

    def __radd__(self, other: IndexLike) -> "IndexExpr":
        return add(other, self)

    def __sub__(self, other: IndexLike) -> "IndexExpr":
        return sub(self, other)

    def __rsub__(self, other: IndexLike) -> "IndexExpr":
        return sub(other, self)

    def __mul__(self, other: IndexLike) -> "IndexExpr":
        return mul(self, other)

    def __rmul__(self, other: IndexLike) -> "IndexExpr":
        return mul(other, self)

    def __floordiv__(self, other: IndexLike) -> "IndexExpr":
        return floordiv(self, other)

    def __mod__(self, other: IndexLike) -> "IndexExpr":
        return floormod(self, other)

    def __neg__(self) -> "IndexExpr":
        return mul(self, -1)


@dataclass(frozen=True)
class IVar(IndexExpr):
    """A reference to an iterator by name."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class IConst(IndexExpr):
    value: int

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class IBin(IndexExpr):
    """`lhs op rhs` with op one of + - * // %."""

    op: str
    lhs: IndexExpr
    rhs: IndexExpr

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"unknown index operator {self.op!r}")
        if self.op in ("//", "%"):
            _check_divisor(self.rhs)

    def __str__(self) -> str:
        return f"{_paren(self.lhs, self.op, False)} {self.op} {_paren(self.rhs, self.op, True)}"


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "//": 2, "%": 2}


def _paren(e: IndexExpr, parent_op: str, right: bool) -> str:
    if isinstance(e, IBin):
        p, q = _PRECEDENCE[e.op], _PRECEDENCE[parent_op]
        # Operators associate to the left, so a right operand of equal precedence keeps its
        # parentheses unless dropping them cannot change the value: a + (b ± c), a * (b * c).
        associative = (parent_op == "+" and e.op in ("+", "-")) or (parent_op == e.op == "*")
        if p < q or (right and p == q and not associative):
            return f"({e})"
    if isinstance(e, IConst) and e.value < 0:
        return f"({e.value})"
    return str(e)


def as_index(x: IndexLike) -> IndexExpr:
    if isinstance(x, IndexExpr):
        return x
    if isinstance(x, (int,)) and not isinstance(x, bool):
        return IConst(int(x))
    try:  # numpy integers
        import numpy as np

        if isinstance(x, np.integer):
            return IConst(int(x))
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"cannot use {x!r} as an index expression")


def add(a: IndexLike, b: IndexLike) -> IndexExpr:
    a, b = as_index(a), as_index(b)
    if isinstance(a, IConst) and isinstance(b, IConst):
        return IConst(a.value + b.value)
    if isinstance(a, IConst) and a.value == 0:
        return b
    if isinstance(b, IConst):
        if b.value == 0:
            return a
        if b.value < 0:
            return IBin("-", a, IConst(-b.value))
    return IBin("+", a, b)


def sub(a: IndexLike, b: IndexLike) -> IndexExpr:
    a, b = as_index(a), as_index(b)
    if isinstance(a, IConst) and isinstance(b, IConst):
        return IConst(a.value - b.value)
    if isinstance(b, IConst):
        if b.value == 0:
            return a
        if b.value < 0:
            return IBin("+", a, IConst(-b.value))
    if a == b:
        return IConst(0)
    return IBin("-", a, b)


def mul(a: IndexLike, b: IndexLike) -> IndexExpr:
    a, b = as_index(a), as_index(b)
    if isinstance(a, IConst) and isinstance(b, IConst):
        return IConst(a.value * b.value)
    if isinstance(a, IConst):  # keep constants on the right: r * 3, not 3 * r
        a, b = b, a
    if isinstance(b, IConst):
        if b.value == 0:
            return IConst(0)
        if b.value == 1:
            return a
    return IBin("*", a, b)


def _check_divisor(b: IndexExpr) -> int:
    if not isinstance(b, IConst) or b.value <= 0:
        raise ValueError(f"index division needs a positive constant divisor, got {b}")
    return b.value


def floordiv(a: IndexLike, b: IndexLike) -> IndexExpr:
    a, b = as_index(a), as_index(b)
    d = _check_divisor(b)
    if isinstance(a, IConst):
        return IConst(a.value // d)
    if d == 1:
        return a
    return IBin("//", a, b)


def floormod(a: IndexLike, b: IndexLike) -> IndexExpr:
    a, b = as_index(a), as_index(b)
    d = _check_divisor(b)
    if isinstance(a, IConst):
        return IConst(a.value % d)
    if d == 1:
        return IConst(0)
    return IBin("%", a, b)


def free_vars(e: IndexExpr) -> frozenset:
    """Names of the iterators an index expression reads."""
    if isinstance(e, IVar):
        return frozenset((e.name,))
    if isinstance(e, IBin):
        return free_vars(e.lhs) | free_vars(e.rhs)
    return frozenset()


def substitute(e: IndexExpr, mapping: Mapping[str, IndexLike]) -> IndexExpr:
    """Replace iterators by index expressions (simultaneously), refolding constants."""
    if isinstance(e, IVar):
        return as_index(mapping[e.name]) if e.name in mapping else e
    if isinstance(e, IBin):
        lhs, rhs = substitute(e.lhs, mapping), substitute(e.rhs, mapping)
        return _BUILDERS[e.op](lhs, rhs)
    return e


_BUILDERS = {"+": add, "-": sub, "*": mul, "//": floordiv, "%": floormod}


def build(op: str, lhs: IndexLike, rhs: IndexLike) -> IndexExpr:
    """`lhs op rhs` through the folding constructor of `op`."""
    return _BUILDERS[op](lhs, rhs)


def interpret(e: IndexExpr, env: Mapping[str, object], const: Callable[[int], object] = int,
              floordiv: Callable = operator.floordiv, floormod: Callable = operator.mod):
    """Evaluate `e` in any arithmetic: iterators from `env`, constants through `const`, + - *
    as Python operators, and floor division/modulo through the given functions.

    One walk serves numpy evaluation, TIR lowering and z3 translation, so they cannot disagree
    on the structure of an index function.
    """
    if isinstance(e, IVar):
        if e.name not in env:
            raise KeyError(f"index function reads iterator {e.name!r}, which has no value")
        return env[e.name]
    if isinstance(e, IConst):
        return const(e.value)
    lhs = interpret(e.lhs, env, const, floordiv, floormod)
    rhs = interpret(e.rhs, env, const, floordiv, floormod)
    if e.op == "+":
        return lhs + rhs
    if e.op == "-":
        return lhs - rhs
    if e.op == "*":
        return lhs * rhs
    return floordiv(lhs, rhs) if e.op == "//" else floormod(lhs, rhs)


def evaluate(e: IndexExpr, env: Mapping[str, object]):
    """Evaluate with iterator values from `env` (ints or numpy integer arrays, broadcasting)."""
    return interpret(e, env)


def linear_form(e: IndexExpr) -> Optional[Tuple[Dict[str, int], int]]:
    """({iterator: coefficient}, constant) when `e` is affine in its iterators, else None.

    Operator matching compares these coefficients (EinNet §5.1, "match operator attributes").
    """
    if isinstance(e, IVar):
        return {e.name: 1}, 0
    if isinstance(e, IConst):
        return {}, e.value
    if e.op in ("//", "%"):
        return None
    left, right = linear_form(e.lhs), linear_form(e.rhs)
    if left is None or right is None:
        return None
    (lc, lk), (rc, rk) = left, right
    if e.op in ("+", "-"):
        sign = 1 if e.op == "+" else -1
        coeffs = dict(lc)
        for name, c in rc.items():
            coeffs[name] = coeffs.get(name, 0) + sign * c
        return {n: c for n, c in coeffs.items() if c != 0}, lk + sign * rk
    # Multiplication is affine only when one side is constant.
    if not lc:
        return {n: lk * c for n, c in rc.items() if lk * c != 0}, lk * rk
    if not rc:
        return {n: rk * c for n, c in lc.items() if rk * c != 0}, lk * rk
    return None


def from_linear(coeffs: Mapping[str, int], const: int = 0) -> IndexExpr:
    """Build `sum(c * name) + const` in a stable order (the inverse of linear_form)."""
    out: IndexExpr = IConst(0)
    for name in sorted(coeffs):
        c = coeffs[name]
        if c == 0:
            continue
        term = mul(IVar(name), c) if c > 0 else mul(IVar(name), -c)
        out = add(out, term) if c > 0 else sub(out, term)
    return add(out, const)


def bounds(e: IndexExpr, ranges: Mapping[str, Tuple[int, int]]) -> Tuple[int, int]:
    """Interval [lo, hi] (inclusive) that `e` can take when each iterator x is in [lo_x, hi_x).

    Interval arithmetic: exact for affine expressions with distinct iterators, an
    over-approximation otherwise. Used for padding sizes and quick range checks; exact
    questions go to the z3 checks in `tvm_einweld.verify`.
    """
    if isinstance(e, IVar):
        lo, hi = ranges[e.name]
        return lo, hi - 1
    if isinstance(e, IConst):
        return e.value, e.value
    (a, b), (c, d) = bounds(e.lhs, ranges), bounds(e.rhs, ranges)
    if e.op == "+":
        return a + c, b + d
    if e.op == "-":
        return a - d, b - c
    if e.op == "*":
        products = (a * c, a * d, b * c, b * d)
        return min(products), max(products)
    k = c  # constant divisor
    if e.op == "//":
        return a // k, b // k
    if b - a + 1 >= k or a // k != b // k:
        return 0, k - 1
    return a % k, b % k
