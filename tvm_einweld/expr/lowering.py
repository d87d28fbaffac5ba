"""Lowering of expressions to TVM TE computes (and through `te.create_prim_func` to TIR).

Each scope becomes its own `te.compute` stage (it is materialised, as §3 defines), the top
expression the final stage. A traversal iterator with range [lo, hi) is the compute axis
shifted by lo; a summation iterator is a `te.reduce_axis` over [lo, hi). Reads that can fall
into zero padding are guarded by `if_then_else`, which TIR evaluates lazily, so the guarded
load never executes out of bounds. `//` and `%` lower to floordiv/floormod, the semantics the
interpreter and z3 use as well.

Shapes, axes and index arithmetic are int64, as in the PrimFuncs `LegalizeOps` produces: FuseTIR
refuses to fuse kernels whose buffers disagree on the index type.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import tvm
from tvm import te, tirx

from . import index as ix
from .expression import Access, BinaryOp, Constant, Expr, Scalar, Scope, UnaryOp, input_tensors
from .index import IndexExpr


INDEX_DTYPE = "int64"


def _i64(value: int) -> tirx.PrimExpr:
    return tirx.const(int(value), INDEX_DTYPE)


def lower_index(e: IndexExpr, env: Mapping[str, tirx.PrimExpr], dtype: str = "int32") -> tirx.PrimExpr:
    """The TIR form of an index function, iterators taken from `env`."""
    return ix.interpret(e, env, lambda v: tirx.const(v, dtype), tirx.floordiv, tirx.floormod)


_UNARY_TE = {  # (value, dtype) -> value
    "relu": lambda x, dt: te.max(x, tirx.const(0, dt)),
    "tanh": lambda x, dt: te.tanh(x),
    "sigmoid": lambda x, dt: te.sigmoid(x),
    "exp": lambda x, dt: te.exp(x),
    "neg": lambda x, dt: tirx.const(0, dt) - x,
    "sqrt": lambda x, dt: te.sqrt(x),
    "abs": lambda x, dt: te.abs(x),
}


class _Lowerer:
    def __init__(self, placeholders: Mapping[str, te.Tensor], name: str) -> None:
        self.placeholders = placeholders
        self.stages: Dict[Scope, te.Tensor] = {}
        self.name = name

    def expr(self, e: Expr, name: str) -> te.Tensor:
        ranges = e.ranges

        def compute(*axes):
            env = {it.name: ax + _i64(it.lo) for it, ax in zip(e.traversals, axes)}
            raxes = [te.reduce_axis(tvm.ir.Range(_i64(it.lo), _i64(it.hi)), name=it.name)
                     for it in e.sums]
            env.update({it.name: rax for it, rax in zip(e.sums, raxes)})
            value = self.scalar(e.body, env, ranges, e.dtype)
            return te.sum(value, axis=raxes) if raxes else value

        return te.compute([_i64(n) for n in e.shape], compute, name=name)

    def scalar(self, s: Scalar, env, ranges, dtype) -> tirx.PrimExpr:
        if isinstance(s, Access):
            return self.access(s, env, ranges, dtype)
        if isinstance(s, Constant):
            return tirx.const(s.value, dtype)
        if isinstance(s, BinaryOp):
            lhs = self.scalar(s.lhs, env, ranges, dtype)
            rhs = self.scalar(s.rhs, env, ranges, dtype)
            return lhs + rhs if s.op == "+" else lhs - rhs if s.op == "-" else lhs * rhs
        if isinstance(s, UnaryOp):
            return _UNARY_TE[s.fn](self.scalar(s.arg, env, ranges, dtype), dtype)
        raise TypeError(f"unknown scalar node {type(s).__name__}")

    def source(self, src) -> te.Tensor:
        if isinstance(src, Scope):
            if src not in self.stages:
                self.stages[src] = self.expr(src.expr, f"{self.name}_scope{len(self.stages)}")
            return self.stages[src]
        return self.placeholders[src.name]

    def access(self, a: Access, env, ranges, dtype) -> tirx.PrimExpr:
        tensor = self.source(a.source)
        positions, conditions = [], []
        for d, idx in enumerate(a.indices):
            origin, extent = a.source.origin[d], a.source.shape[d]
            pos = lower_index(ix.sub(idx, origin), env, INDEX_DTYPE)
            lo, hi = ix.bounds(ix.sub(idx, origin), ranges)
            if lo < 0:
                conditions.append(pos >= 0)
            if hi >= extent:
                conditions.append(pos < extent)
            positions.append(pos)
        load = tensor(*positions)
        if not conditions:
            return load
        cond = conditions[0]
        for c in conditions[1:]:
            cond = tirx.all(cond, c)
        return tirx.if_then_else(cond, load, tirx.const(0, dtype))


def to_te(expr: Expr, placeholders: Mapping[str, te.Tensor], name: str = "expr") -> te.Tensor:
    """The TE tensor computing `expr` from placeholders named like the expression's inputs."""
    return _Lowerer(placeholders, name).expr(expr, name)


def make_placeholders(expr: Expr) -> Dict[str, te.Tensor]:
    """One placeholder per input tensor, in sorted name order."""
    return {
        name: te.placeholder([_i64(n) for n in t.shape], t.dtype, name=name)
        for name, t in sorted(input_tensors(expr).items())
    }


def to_prim_func(expr: Expr, name: str = "expr") -> Tuple[tirx.PrimFunc, List[str]]:
    """A PrimFunc computing `expr`; its parameters are the inputs (sorted by name) then the output.

    Returns the function and the input names in parameter order.
    """
    placeholders = make_placeholders(expr)
    out = to_te(expr, placeholders, name)
    func = te.create_prim_func(list(placeholders.values()) + [out])
    return func.with_attr("global_symbol", name), list(placeholders)


def build(expr: Expr, target: str = "llvm", name: str = "expr"):
    """Compile `expr` for `target`; returns (callable(*arrays) -> numpy array, input names)."""
    import numpy as np

    func, names = to_prim_func(expr, name)
    lib = tvm.compile(tvm.IRModule({name: func}), target=target)
    dev = tvm.device(tvm.target.Target(target).get_target_device_type(), 0)

    def run(*arrays: "np.ndarray") -> "np.ndarray":
        args = [tvm.runtime.tensor(np.require(a, expr.dtype, "C"), dev) for a in arrays]
        out = tvm.runtime.tensor(np.zeros(expr.shape, dtype=expr.dtype), dev)
        lib[name](*args, out)
        return out.numpy()

    return run, names


__all__ = ["to_te", "to_prim_func", "make_placeholders", "build", "lower_index"]

