"""FoldDataMovement: computations that only move a constant's elements, evaluated with numpy.

What it rewrites
----------------
1. A call of `reshape`, `expand_dims`, `squeeze`, `flatten`, `permute_dims`, `take`
   (constant, in-range indices), `concat`, `stack` or `broadcast_to` whose tensor arguments
   are all constants (or variables bound to constants earlier in the function) becomes the
   constant it evaluates to; arguments bound to constants are replaced by the constants
   themselves. Such calls come from ONNX importers (a bias reshaped for broadcasting) and from
   our own rewrites (`ConvTransposePhases` slices and regroups constant weights per phase).
2. A `call_tir` of a *copy kernel* on constants becomes its result: a PrimFunc whose one
   block, under a nest of loops, stores into its output either an element loaded from an
   input or a constant, chosen by integer index arithmetic (`if_then_else` for padding) —
   the `*_weight_prepack` kernels with which compile-time weight packing
   (`rules.cpu.apply.prepack_weights`) puts constant weights into a GEMM's panel layout.
`tir_passes.prepare` runs it before legalisation, `prepack_weights` before its FoldConstant.

Why: Relax's FoldConstant evaluates a constant call by compiling its PrimFunc with LLVM and
running it — 0.04-0.25 s per call. GCN's 43 bias reshapes cost 11 s of every compile, and
every candidate module the derivation and fusion passes time packs its weights again.

Why it is correct
-----------------
These computations compute no value: every output element is a copy of one input element
(or a constant of the kernel), so the result is bit for bit what FoldConstant would compute,
in every dtype. (1) The index map is fixed by the operator's definition, which numpy's
functions share: row-major reshape (`reshape`, `expand_dims`, `squeeze`, `flatten` are
reshapes to the result's static shape), axis permutation, gather along one axis,
concatenation and stacking along one axis, broadcasting. (2) The kernel's own index
expressions are evaluated exactly, in int64 numpy arithmetic with TIR's floor division and
modulo, over every point of its loop nest (the block's predicate masks the points a split
loop adds); the result is used only when the stores write every output element exactly once
(else an element would be left to whatever the buffer held). A fold is used only when its
shape and dtype are the call's static result type; anything else (symbolic shapes, an
out-of-range index, an arithmetic kernel, an operator not in the table) is left to
FoldConstant as before.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
import tvm
from tvm import relax, s_tir, tirx
from tvm.ir.expr import Constant

from ..expr.from_relax import UnsupportedOperator, static_shape

Fold = Callable[[relax.Call, List[np.ndarray], tuple], np.ndarray]


def _reshape(_call, args, shape):
    return np.reshape(args[0], shape)


def _permute(call, args, _shape):
    axes = call.attrs.axes
    return np.transpose(args[0], None if axes is None else [int(a) for a in axes])


def _take(call, args, _shape):
    if call.attrs.axis is None:
        raise ValueError("take without an axis")
    return np.take(args[0], args[1], axis=int(call.attrs.axis), mode="raise")


def _concat(call, args, _shape):
    return np.concatenate(args, axis=int(call.attrs.axis))


def _stack(call, args, _shape):
    return np.stack(args, axis=int(call.attrs.axis))


def _broadcast(_call, args, shape):
    return np.array(np.broadcast_to(args[0], shape))


# Operator -> its numpy evaluation (call, constant arguments, static result shape).
FOLDS: Dict[str, Fold] = {
    "relax.reshape": _reshape,
    "relax.expand_dims": _reshape,
    "relax.squeeze": _reshape,
    "relax.flatten": _reshape,
    "relax.permute_dims": _permute,
    "relax.take": _take,
    "relax.concat": _concat,
    "relax.stack": _stack,
    "relax.broadcast_to": _broadcast,
}
# Operators whose tensors arrive as one Tuple argument.
_TUPLE_ARGS = frozenset({"relax.concat", "relax.stack"})


class _NotACopy(ValueError):
    """The kernel computes values (or uses a construct the evaluator does not model)."""


_INT_OPS = {
    tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply,
    tirx.FloorDiv: np.floor_divide, tirx.FloorMod: np.mod,  # numpy floors, as TIR's do
    tirx.Min: np.minimum, tirx.Max: np.maximum,
    tirx.LT: np.less, tirx.LE: np.less_equal, tirx.GT: np.greater, tirx.GE: np.greater_equal,
    tirx.EQ: np.equal, tirx.NE: np.not_equal, tirx.And: np.logical_and, tirx.Or: np.logical_or,
}


class _CopyEvaluator:
    """Evaluates a copy kernel's expressions over all points of its loop nest at once: index
    arithmetic on int64 arrays (one entry per point), the stored value as loaded elements or
    constants, nothing else."""

    def __init__(self, env: Dict[tirx.Var, np.ndarray], buffers: Dict[object, np.ndarray],
                 dtype: str):
        self.env, self.buffers, self.dtype = env, buffers, dtype

    def index(self, expr) -> np.ndarray:
        if isinstance(expr, tirx.IntImm):
            return np.int64(expr.value)
        if isinstance(expr, tirx.Var):
            return self.env[expr]
        if type(expr) in _INT_OPS and not str(expr.a.ty).startswith("float"):
            a, b = self.index(expr.a), self.index(expr.b)
            if isinstance(expr, (tirx.FloorDiv, tirx.FloorMod)) and np.any(np.asarray(b) == 0):
                raise _NotACopy("division by zero")
            return _INT_OPS[type(expr)](a, b)
        if isinstance(expr, tirx.Not):
            return np.logical_not(self.index(expr.a))
        if isinstance(expr, tirx.Cast) and not str(expr.ty).startswith("float") and \
                not str(expr.value.ty).startswith("float"):
            return self.index(expr.value)
        choice = _choice(expr)
        if choice is not None:
            return np.where(*(self.index(part) for part in choice))
        raise _NotACopy(f"index expression {type(expr).__name__}")

    def value(self, expr, points: int) -> np.ndarray:
        """The stored value per point: loaded elements, constants, or a choice between them."""
        if isinstance(expr, tvm.ir.TensorLoad):  # TVM 0.27's BufferLoad
            data = self.buffers.get(expr.source)
            if data is None or len(expr.indices) != data.ndim:
                raise _NotACopy("load from a buffer that is not an input")
            if str(data.dtype) != self.dtype:
                raise _NotACopy("a load of another dtype than the output's (a cast)")
            idx = [np.broadcast_to(self.index(i), (points,)) for i in expr.indices]
            # Out-of-range points are clipped here and must be masked by an enclosing choice:
            # `store` rejects the kernel if any of them reaches the output.
            bad = np.zeros(points, bool)
            for axis, i in enumerate(idx):
                bad |= (i < 0) | (i >= data.shape[axis])
            clipped = tuple(np.clip(i, 0, n - 1) for i, n in zip(idx, data.shape))
            return data[clipped], bad
        if isinstance(expr, (tirx.FloatImm, tirx.IntImm)) and str(expr.ty) == self.dtype:
            return np.full(points, expr.value, dtype=self.dtype), np.zeros(points, bool)
        choice = _choice(expr)
        if choice is not None:
            cond, yes, no = choice
            c = np.broadcast_to(self.index(cond), (points,)).astype(bool)
            (a, bad_a), (b, bad_b) = self.value(yes, points), self.value(no, points)
            return np.where(c, a, b), np.where(c, bad_a, bad_b)
        raise _NotACopy(f"value expression {type(expr).__name__}")


def _choice(expr):
    """(condition, then, else) of a `Select` or `if_then_else` call, else None."""
    if isinstance(expr, tirx.Select):
        return expr.condition, expr.true_value, expr.false_value
    if isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op) and \
            expr.op.name in ("prim.if_then_else", "tirx.if_then_else"):
        return tuple(expr.args)
    return None


def _loop_nest(stmt) -> tuple:
    """(loops, the block realize) of a perfect loop nest around one block, else raise."""
    loops = []
    while True:
        if isinstance(stmt, tirx.For):
            loops.append(stmt)
            stmt = stmt.body
        elif isinstance(stmt, s_tir.SBlockRealize) and not stmt.block.iter_vars and \
                not loops and isinstance(stmt.block.body, (tirx.For, s_tir.SBlockRealize)):
            stmt = stmt.block.body  # the root block
        elif isinstance(stmt, s_tir.SBlockRealize):
            return loops, stmt
        else:
            raise _NotACopy(f"statement {type(stmt).__name__}")


def evaluate_copy_kernel(func: tirx.PrimFunc, inputs: List[np.ndarray]) -> np.ndarray:
    """The output of a copy kernel (see the module docstring, 2) on `inputs`; raises
    `_NotACopy` (a ValueError) when `func` is not one."""
    params = list(func.params)
    if len(params) != len(inputs) + 1:
        raise _NotACopy("one output expected")
    bufs = params  # TVM 0.27: a PrimFunc's params are its buffers
    out_buf = bufs[-1]
    buffers = dict(zip(bufs[:-1], inputs))
    loops, realize = _loop_nest(func.body)
    block = realize.block
    store = block.body
    if block.init is not None or block.alloc_buffers or block.match_buffers or \
            not isinstance(store, tirx.BufferStore) or not store.buffer.same_as(out_buf):
        raise _NotACopy("the block is not one store into the output")
    extents = []
    for loop in loops:
        if not isinstance(loop.min, tirx.IntImm) or not isinstance(loop.extent, tirx.IntImm):
            raise _NotACopy("symbolic loop bounds")
        extents.append((int(loop.min.value), int(loop.extent.value)))
    points = int(np.prod([e for _, e in extents])) if extents else 1
    if points > 1 << 26:
        raise _NotACopy("too large to evaluate at once")
    grids = np.indices([e for _, e in extents], dtype=np.int64).reshape(len(extents), -1) \
        if extents else np.zeros((0, 1), np.int64)
    env = {loop.loop_var: grids[k] + lo for k, (loop, (lo, _)) in enumerate(zip(loops,
                                                                                 extents))}
    ev = _CopyEvaluator(env, buffers, str(out_buf.dtype))
    for iv, value in zip(block.iter_vars, realize.iter_values):
        ev.env[iv.var] = np.broadcast_to(ev.index(value), (points,))
    mask = np.broadcast_to(ev.index(realize.predicate), (points,)).astype(bool)
    values, bad = ev.value(store.value, points)
    idx = [np.broadcast_to(ev.index(i), (points,))[mask] for i in store.indices]
    shape = tuple(int(d) for d in out_buf.shape)
    if np.any(bad[mask]) or len(idx) != len(shape) or \
            any(np.any((i < 0) | (i >= n)) for i, n in zip(idx, shape)):
        raise _NotACopy("an index out of range")
    flat = np.ravel_multi_index(tuple(idx), shape) if idx else np.zeros(int(mask.sum()), int)
    size = int(np.prod(shape))
    written = np.zeros(size, bool)
    written[flat] = True
    if flat.size != size or not written.all():  # size stores covering size elements: each once
        raise _NotACopy("the stores do not write every output element once")
    out = np.empty(size, dtype=str(out_buf.dtype))
    out[flat] = np.broadcast_to(values, (points,))[mask]
    return out.reshape(shape)


def fold_copy_kernel(call: relax.Call, mod: tvm.IRModule,
                     constant_of: Callable[[relax.Expr], Optional[Constant]]
                     ) -> Optional[Constant]:
    """The constant a `call_tir` of a copy kernel on constants evaluates to, or None."""
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir") or \
            len(call.args) != 2 or not isinstance(call.args[1], relax.Tuple):
        return None
    func = mod[call.args[0]] if call.args[0] in mod.get_global_vars() else None
    constants = [constant_of(a) for a in call.args[1].fields]
    if not isinstance(func, tirx.PrimFunc) or any(c is None for c in constants):
        return None
    return _result(call, lambda shape: evaluate_copy_kernel(
        func, [c.value.numpy() for c in constants]))


def fold_call(call: relax.Call, constant_of: Callable[[relax.Expr], Optional[Constant]]
              ) -> Optional[Constant]:
    """The constant `call` evaluates to, or None when it is not a foldable data movement
    (`constant_of` maps an argument to its constant, or None)."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name not in FOLDS:
        return None
    name = call.op.name
    tensors = list(call.args[0].fields) if name in _TUPLE_ARGS else \
        [a for a in call.args if not isinstance(a, (relax.ShapeExpr,))]
    if name in _TUPLE_ARGS and not isinstance(call.args[0], relax.Tuple):
        return None
    constants = [constant_of(t) for t in tensors]
    if not constants or any(c is None for c in constants):
        return None
    return _result(call, lambda shape: FOLDS[name](call, [c.value.numpy() for c in constants],
                                                  shape))


def _result(call: relax.Call, evaluate: Callable[[tuple], np.ndarray]) -> Optional[Constant]:
    """`evaluate(static result shape)` as the constant `call` becomes, or None when it cannot
    be evaluated (a `_NotACopy` is a ValueError) or its shape or dtype is not the call's static
    result type."""
    try:
        shape, dtype = tuple(static_shape(call)), str(call.ty.dtype)
        value = evaluate(shape)
    except (UnsupportedOperator, ValueError, IndexError, TypeError, KeyError, AttributeError):
        return None
    if tuple(value.shape) != shape or str(value.dtype) != dtype:
        return None
    return relax.const(np.require(value, requirements="C"), dtype)


@relax.expr_functor.mutator
class _Folder(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod
        self.folded = 0

    def _constant_of(self, expr: relax.Expr) -> Optional[Constant]:
        if isinstance(expr, Constant):
            return expr
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            return bound if isinstance(bound, Constant) else None
        return None

    def visit_var_(self, var: relax.Var) -> relax.Expr:  # pylint: disable=arguments-renamed
        # A use of a variable bound to a constant reads the constant (as FoldConstant does),
        # so later folds, and the passes after legalisation, see it as one.
        var = super().visit_var_(var)
        return self._constant_of(var) or var

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:  # pylint: disable=arguments-renamed
        var = super().visit_dataflow_var_(var)
        return self._constant_of(var) or var

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        folded = fold_call(call, self._constant_of)
        if folded is None:
            folded = fold_copy_kernel(call, self.mod, self._constant_of)
        if folded is not None:
            self.folded += 1
            return folded
        return call


@tvm.transform.module_pass(opt_level=0, name="FoldDataMovement")
def FoldDataMovement(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # pylint: disable=invalid-name
    """Relax module pass: data-movement calls on constants become constants (see the module
    docstring); every other call is left unchanged."""
    folder = _Folder(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            folder.builder_.update_func(gvar, folder.visit_expr(func))
    if not folder.folded:
        return mod
    return relax.transform.DeadCodeElimination()(folder.builder_.get())
