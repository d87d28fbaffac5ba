"""Translation of Relax operator calls to canonical expressions.

`expr_of_call(call, names)` reads the operator, its static argument shapes and attributes,
and returns the canonical expression (see `canonical.py`) whose inputs are named `names`.
Anything it cannot express exactly (dynamic shapes, an unsupported dtype, an operator or an
attribute combination without a canonical form) raises `UnsupportedOperator` with the reason,
so callers leave that operator to stock TVM.
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

from tvm import relax

from . import canonical as C
from .canonical import UnsupportedOperator
from .expression import Expr, Tensor

SUPPORTED_DTYPES = ("float32", "float64", "float16")


def static_shape(expr: relax.Expr) -> Tuple[int, ...]:
    """The static shape of a tensor-typed Relax expression."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise UnsupportedOperator(f"argument {expr} is not a tensor with a known shape")
    try:
        return tuple(int(v) for v in ty.shape.values)
    except (TypeError, ValueError, AttributeError) as err:
        raise UnsupportedOperator(f"argument {expr} has a dynamic shape {ty.shape}") from err


def tensor_of(expr: relax.Expr, name: str) -> Tensor:
    dtype = str(expr.ty.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedOperator(f"dtype {dtype} is not supported (supported: {SUPPORTED_DTYPES})")
    return Tensor(name, static_shape(expr), dtype=dtype)


def _ints(values) -> Tuple[int, ...]:
    return tuple(int(v) for v in values)


def _conv2d(call: relax.Call, t: Sequence[Tensor]) -> Expr:
    a = call.attrs
    if a.out_layout != a.data_layout:
        raise UnsupportedOperator(f"conv2d with out_layout {a.out_layout} != {a.data_layout}")
    return C.conv2d(t[0], t[1], _ints(a.strides), _ints(a.padding), _ints(a.dilation),
                    int(a.groups), str(a.data_layout), str(a.kernel_layout))


def _conv2d_transpose(call: relax.Call, t: Sequence[Tensor]) -> Expr:
    a = call.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "IOHW", "NCHW"):
        raise UnsupportedOperator("conv2d_transpose is supported in NCHW/IOHW layout only")
    return C.conv2d_transpose(t[0], t[1], _ints(a.strides), _ints(a.padding),
                              _ints(a.output_padding), _ints(a.dilation), int(a.groups))


def _permute_dims(call: relax.Call, t: Sequence[Tensor]) -> Expr:
    axes = call.attrs.axes
    return C.permute_dims(t[0], () if axes is None else _ints(axes))


def _reshape(call: relax.Call, t: Sequence[Tensor]) -> Expr:
    return C.reshape(t[0], static_shape(call))


_TRANSLATORS: Dict[str, Tuple[int, Callable[[relax.Call, Sequence[Tensor]], Expr]]] = {
    # op name -> (number of tensor arguments, translator)
    "relax.nn.conv2d": (2, _conv2d),
    "relax.nn.conv2d_transpose": (2, _conv2d_transpose),
    "relax.matmul": (2, lambda call, t: C.matmul(t[0], t[1])),
    "relax.permute_dims": (1, _permute_dims),
    "relax.reshape": (1, _reshape),
    "relax.add": (2, lambda call, t: C.add(t[0], t[1])),
    "relax.subtract": (2, lambda call, t: C.subtract(t[0], t[1])),
    "relax.multiply": (2, lambda call, t: C.multiply(t[0], t[1])),
    "relax.nn.relu": (1, lambda call, t: C.unary_op("relu", t[0])),
    "relax.tanh": (1, lambda call, t: C.unary_op("tanh", t[0])),
    "relax.sigmoid": (1, lambda call, t: C.unary_op("sigmoid", t[0])),
    "relax.exp": (1, lambda call, t: C.unary_op("exp", t[0])),
}

SUPPORTED_OPS = tuple(_TRANSLATORS)


def op_name(call: relax.Call) -> str:
    op = call.op
    return str(op.name) if hasattr(op, "name") else str(op)


def expr_of_call(call: relax.Call, names: Sequence[str]) -> Expr:
    """The canonical expression of a Relax call; its tensor arguments are named `names`."""
    name = op_name(call)
    if name not in _TRANSLATORS:
        raise UnsupportedOperator(f"operator {name} has no canonical expression")
    arity, translate = _TRANSLATORS[name]
    args = list(call.args)[:arity]
    if len(names) != arity:
        raise ValueError(f"{name} takes {arity} tensor arguments, got names {list(names)}")
    tensors = [tensor_of(arg, n) for arg, n in zip(args, names)]
    expr = translate(call, tensors)
    out_dtype = str(call.ty.dtype) if isinstance(call.ty, relax.TensorType) else expr.dtype
    if out_dtype != expr.dtype:
        raise UnsupportedOperator(f"{name} with out_dtype {out_dtype} != input dtype {expr.dtype}")
    return expr


def single_op_module(make_call, shapes, dtype: str = "float32"):
    """A Relax module whose `main(x0, x1, ...)` is the one call `make_call(x0, x1, ...)`, and
    that call: how an operator is built alone with TVM to check its expression."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{k}", relax.TensorType(tuple(s), dtype)) for k, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make_call(*params))
        bb.emit_func_output(out)
    mod = bb.get()
    return mod, mod["main"].body.blocks[0].bindings[0].value


__all__ = ["expr_of_call", "single_op_module", "static_shape", "tensor_of", "op_name", "SUPPORTED_OPS",
           "UnsupportedOperator"]
