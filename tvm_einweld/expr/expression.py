"""Tensor-algebra expressions (EinNet §3).

An expression  L_{x⃗} Σ_{y⃗} f(T[τ(x⃗, y⃗)])  has
  * traversal iterators x⃗ (L): one per output dimension, in layout order;
  * summation iterators y⃗ (Σ): reduced over, order irrelevant;
  * a scalar body f over tensor accesses T[τ] with index functions τ.

Iterator ranges are half-open [lo, hi) and may start below zero. The output of an expression
is addressed by iterator *values*: element (v0, v1, ...) of an expression whose traversal
iterators range over [lo_i, hi_i) is stored at position (v_i - lo_i). A `Scope` is an expression
whose output is materialised as a tensor and subscripted by an outer expression with those
values, exactly as in the paper's Fig. 5, where t1 ranges over [-1, H+1).

Tensors and scopes carry per-dimension zero padding: reading index v of a dimension with
origin o, extent n and padding (pl, ph) gives 0 for v in [o-pl, o) ∪ [o+n, o+n+ph) and is an
error outside [o-pl, o+n+ph). Input tensors have origin 0.

All classes are frozen dataclasses: hashable, comparable, safe to share between derivations.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Iterator as PyIterator, Sequence, Tuple, Union

from . import index as ix
from .index import IndexExpr, IndexLike, IVar, as_index

Pad = Tuple[Tuple[int, int], ...]

UNARY_FUNCTIONS = ("relu", "tanh", "sigmoid", "exp", "neg", "sqrt", "abs")
BINARY_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class Iterator:
    """An iterator with the integer range [lo, hi)."""

    name: str
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.hi <= self.lo:
            raise ValueError(f"iterator {self.name} has an empty range [{self.lo}, {self.hi})")

    @property
    def extent(self) -> int:
        return self.hi - self.lo

    @property
    def var(self) -> IVar:
        return IVar(self.name)

    def __str__(self) -> str:
        return f"{self.name}:{self.lo}..{self.hi}"


def _zero_pad(ndim: int) -> Pad:
    return tuple((0, 0) for _ in range(ndim))


@dataclass(frozen=True)
class Tensor:
    """An input tensor with a shape and per-dimension zero padding (lo, hi)."""

    name: str
    shape: Tuple[int, ...]
    pad: Pad = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.pad:
            object.__setattr__(self, "pad", _zero_pad(len(self.shape)))
        object.__setattr__(self, "pad", tuple((int(a), int(b)) for a, b in self.pad))
        if len(self.pad) != len(self.shape):
            raise ValueError(f"tensor {self.name}: padding rank differs from shape rank")
        if any(a < 0 or b < 0 for a, b in self.pad):
            raise ValueError(f"tensor {self.name}: negative padding {self.pad}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def origin(self) -> Tuple[int, ...]:
        return tuple(0 for _ in self.shape)

    def with_pad(self, pad: Sequence[Tuple[int, int]]) -> "Tensor":
        return replace(self, pad=tuple(pad))

    def __getitem__(self, indices) -> "Access":
        return Access(self, _as_indices(indices))

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Scope:
    """A nested expression whose output is materialised as a tensor (the paper's `{...}`)."""

    expr: "Expr"
    pad: Pad = ()

    def __post_init__(self) -> None:
        if not self.pad:
            object.__setattr__(self, "pad", _zero_pad(len(self.expr.traversals)))
        object.__setattr__(self, "pad", tuple((int(a), int(b)) for a, b in self.pad))
        if len(self.pad) != len(self.expr.traversals):
            raise ValueError("scope padding rank differs from its traversal rank")

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.expr.shape

    @property
    def ndim(self) -> int:
        return len(self.expr.traversals)

    @property
    def origin(self) -> Tuple[int, ...]:
        return tuple(it.lo for it in self.expr.traversals)

    @property
    def dtype(self) -> str:
        return self.expr.dtype

    def with_pad(self, pad: Sequence[Tuple[int, int]]) -> "Scope":
        return replace(self, pad=tuple(pad))

    def __getitem__(self, indices) -> "Access":
        return Access(self, _as_indices(indices))

    def __str__(self) -> str:
        return "{ " + str(self.expr) + " }"


Source = Union[Tensor, Scope]


def _as_indices(indices) -> Tuple[IndexExpr, ...]:
    if not isinstance(indices, tuple):
        indices = (indices,)
    return tuple(as_index(i) for i in indices)


class Scalar:
    """Base class of scalar bodies. Operators build the tree."""

    __slots__ = ()

    def __add__(self, other) -> "Scalar":
        return BinaryOp("+", self, as_scalar(other))

    def __radd__(self, other) -> "Scalar":
        return BinaryOp("+", as_scalar(other), self)

    def __sub__(self, other) -> "Scalar":
        return BinaryOp("-", self, as_scalar(other))

    def __rsub__(self, other) -> "Scalar":
        return BinaryOp("-", as_scalar(other), self)

    def __mul__(self, other) -> "Scalar":
        return BinaryOp("*", self, as_scalar(other))

    def __rmul__(self, other) -> "Scalar":
        return BinaryOp("*", as_scalar(other), self)


@dataclass(frozen=True)
class Access(Scalar):
    """`source[indices]`: read one element of a tensor or a scope."""

    source: Source
    indices: Tuple[IndexExpr, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(as_index(i) for i in self.indices))
        if len(self.indices) != self.source.ndim:
            raise ValueError(
                f"access to {_source_name(self.source)} with {len(self.indices)} indices, "
                f"expected {self.source.ndim}"
            )

    def __str__(self) -> str:
        inner = ", ".join(str(i) for i in self.indices)
        return f"{self.source}[{inner}]"


@dataclass(frozen=True)
class Constant(Scalar):
    value: float

    def __str__(self) -> str:
        v = self.value
        return str(int(v)) if float(v).is_integer() else repr(v)


@dataclass(frozen=True)
class BinaryOp(Scalar):
    op: str
    lhs: Scalar
    rhs: Scalar

    def __post_init__(self) -> None:
        if self.op not in BINARY_OPS:
            raise ValueError(f"unknown scalar operator {self.op!r}")

    def __str__(self) -> str:
        def wrap(s: Scalar, right: bool) -> str:
            if isinstance(s, BinaryOp) and (
                (self.op == "*" and s.op != "*") or (right and self.op == "-")
            ):
                return f"({s})"
            return str(s)

        return f"{wrap(self.lhs, False)} {self.op} {wrap(self.rhs, True)}"


@dataclass(frozen=True)
class UnaryOp(Scalar):
    fn: str
    arg: Scalar

    def __post_init__(self) -> None:
        if self.fn not in UNARY_FUNCTIONS:
            raise ValueError(f"unknown unary function {self.fn!r}; known: {UNARY_FUNCTIONS}")

    def __str__(self) -> str:
        return f"{self.fn}({self.arg})"


def as_scalar(x) -> Scalar:
    if isinstance(x, Scalar):
        return x
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Constant(float(x))
    raise TypeError(f"cannot use {x!r} as a scalar expression")


def unary(fn: str, arg) -> Scalar:
    return UnaryOp(fn, as_scalar(arg))


@dataclass(frozen=True)
class Expr:
    """L_{traversals} Σ_{sums} body."""

    traversals: Tuple[Iterator, ...]
    sums: Tuple[Iterator, ...]
    body: Scalar
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "traversals", tuple(self.traversals))
        object.__setattr__(self, "sums", tuple(self.sums))
        names = [it.name for it in self.traversals + self.sums]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate iterator names in {names}")
        unbound = body_free_vars(self.body) - set(names)
        if unbound:
            raise ValueError(f"body reads unbound iterators {sorted(unbound)}")

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(it.extent for it in self.traversals)

    @property
    def iterators(self) -> Tuple[Iterator, ...]:
        return self.traversals + self.sums

    def iterator(self, name: str) -> Iterator:
        for it in self.iterators:
            if it.name == name:
                return it
        raise KeyError(name)

    @property
    def ranges(self) -> Dict[str, Tuple[int, int]]:
        return {it.name: (it.lo, it.hi) for it in self.iterators}

    def as_scope(self, pad: Sequence[Tuple[int, int]] = ()) -> Scope:
        return Scope(self, tuple(pad))

    def __str__(self) -> str:
        parts = []
        if self.traversals:
            parts.append("L{" + ", ".join(str(i) for i in self.traversals) + "}")
        if self.sums:
            parts.append("Σ{" + ", ".join(str(i) for i in self.sums) + "}")
        parts.append(str(self.body))
        return " ".join(parts)


def body_free_vars(s: Scalar) -> frozenset:
    """Iterators read by the index functions of a body (not inside nested scopes)."""
    out: frozenset = frozenset()
    for acc in accesses(s):
        for i in acc.indices:
            out |= ix.free_vars(i)
    return out


def accesses(s: Scalar) -> PyIterator[Access]:
    """All accesses of a body, left to right (not descending into scopes)."""
    if isinstance(s, Access):
        yield s
    elif isinstance(s, BinaryOp):
        yield from accesses(s.lhs)
        yield from accesses(s.rhs)
    elif isinstance(s, UnaryOp):
        yield from accesses(s.arg)


def map_accesses(s: Scalar, fn) -> Scalar:
    """Rebuild a body with every access replaced by fn(access)."""
    if isinstance(s, Access):
        return fn(s)
    if isinstance(s, BinaryOp):
        return BinaryOp(s.op, map_accesses(s.lhs, fn), map_accesses(s.rhs, fn))
    if isinstance(s, UnaryOp):
        return UnaryOp(s.fn, map_accesses(s.arg, fn))
    return s


def substitute_body(s: Scalar, mapping: Dict[str, IndexLike]) -> Scalar:
    """Substitute iterators in every index function of a body."""
    return map_accesses(
        s, lambda a: Access(a.source, tuple(ix.substitute(i, mapping) for i in a.indices))
    )


def input_tensors(e: Expr) -> Dict[str, Tensor]:
    """Input tensors read anywhere in `e`, including nested scopes, by name.

    Two different tensors with the same name are an error: names identify inputs.
    """
    found: Dict[str, Tensor] = {}

    def visit(expr: Expr) -> None:
        for acc in accesses(expr.body):
            src = acc.source
            if isinstance(src, Scope):
                visit(src.expr)
            else:
                known = found.get(src.name)
                base = replace(src, pad=_zero_pad(src.ndim))
                if known is not None and replace(known, pad=_zero_pad(known.ndim)) != base:
                    raise ValueError(f"two different tensors named {src.name}")
                found.setdefault(src.name, src)

    visit(e)
    return found


def scopes(e: Expr) -> PyIterator[Scope]:
    """Every scope nested in `e`, innermost first."""
    for acc in accesses(e.body):
        if isinstance(acc.source, Scope):
            yield from scopes(acc.source.expr)
            yield acc.source


def source_name(src: Source) -> str:
    return _source_name(src)


def _source_name(src) -> str:
    return src.name if isinstance(src, Tensor) else "scope"


def describe(e: Expr) -> str:
    """Multi-line description: the expression plus its tensors with shapes and padding."""
    lines = [str(e)]
    for name, t in sorted(input_tensors(e).items()):
        pad = "" if not any(a or b for a, b in t.pad) else f" pad={list(t.pad)}"
        lines.append(f"  {name}: {t.dtype}{list(t.shape)}{pad}")
    return "\n".join(lines)
