"""A GEMM provider backed by numpy's BLAS, callable from Relax (EinNet §5: vendor kernels).

On CPU the vendor library of a matched matrix product is numpy's BLAS (OpenBLAS here). It is
registered as the packed function `tvm_einweld.numpy_gemm(a, b, out)`, which Relax calls in
destination-passing style with `R.call_dps_packed`; the three arrays cross as DLPack views, so
no data is copied. Semantics are `numpy.matmul` (batched, broadcasting batch dimensions), the
same as `relax.op.matmul`, so the provider can replace any float matmul call one for one.

`choose_matmul_provider` picks between this provider and TVM's own matmul kernel by measured
time on the target (`op_cost.time_call`), which is what the derivation pass uses.

The packed function lives in this Python process: a module using it runs only where this
module has been imported (a compiled library exported to another process would not find it).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import tvm
from tvm import relax

GLOBAL_NAME = "tvm_einweld.numpy_gemm"
SUPPORTED_DTYPES = ("float32", "float64")


@tvm.register_global_func(GLOBAL_NAME, override=True)
def _numpy_gemm(a, b, out) -> None:
    # np.from_dlpack gives writable zero-copy views of TVM tensors on the CPU.
    np.matmul(np.from_dlpack(a), np.from_dlpack(b), out=np.from_dlpack(out))


def output_shape(a_shape: Tuple[int, ...], b_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """numpy.matmul's result shape for operands of rank >= 2."""
    if len(a_shape) < 2 or len(b_shape) < 2 or a_shape[-1] != b_shape[-2]:
        raise ValueError(f"numpy_gemm: operands {a_shape} and {b_shape} do not multiply")
    batch = np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    return tuple(int(d) for d in batch) + (int(a_shape[-2]), int(b_shape[-1]))


def supports(a: relax.Expr, b: relax.Expr) -> bool:
    """True when the provider can compute `matmul(a, b)` (static shapes, same float dtype)."""
    try:
        ta, tb = a.ty, b.ty
        shapes = [tuple(int(v) for v in t.shape.values) for t in (ta, tb)]
    except (AttributeError, TypeError, ValueError):
        return False
    if str(ta.dtype) != str(tb.dtype) or str(ta.dtype) not in SUPPORTED_DTYPES:
        return False
    try:
        output_shape(*shapes)
    except ValueError:
        return False
    return True


def matmul_call(a: relax.Expr, b: relax.Expr) -> relax.Call:
    """`R.call_dps_packed("tvm_einweld.numpy_gemm", (a, b), out_ty=...)`."""
    if not supports(a, b):
        raise ValueError(f"numpy_gemm cannot compute matmul of {a.ty} and {b.ty}")
    shape = output_shape(tuple(int(v) for v in a.ty.shape.values),
                         tuple(int(v) for v in b.ty.shape.values))
    return relax.call_dps_packed(GLOBAL_NAME, [a, b],
                                 out_ty=relax.TensorType(shape, str(a.ty.dtype)))


def choose_matmul_provider(a: relax.Expr, b: relax.Expr, target: str = "llvm") -> Tuple[str, float]:
    """("numpy_gemm" or "tvm", measured seconds) for `matmul(a, b)`, whichever is faster.

    Only the CPU can run the numpy provider; other targets always get TVM's kernel.
    """
    from .op_cost import time_call

    tvm_time = time_call(relax.op.matmul(a, b), target)
    if not supports(a, b) or tvm.target.Target(target).kind.name != "llvm":
        return "tvm", tvm_time
    gemm_time = time_call(matmul_call(a, b), target)
    return ("numpy_gemm", gemm_time) if gemm_time < tvm_time else ("tvm", tvm_time)


def faster_matmul(call: relax.Expr, target: str = "llvm") -> relax.Expr:
    """`call` itself, or the numpy provider's call when `call` is a plain float matmul that
    the provider computes faster on `target` (measured)."""
    if not isinstance(call, relax.Call) or getattr(call.op, "name", None) != "relax.matmul":
        return call
    a, b = call.args
    out_dtype = getattr(call.attrs, "out_dtype", None)
    if out_dtype not in (None, "") and str(out_dtype) != str(getattr(a.ty, "dtype", "")):
        return call
    if not supports(a, b) or tvm.target.Target(target).kind.name != "llvm":
        return call
    provider, _ = choose_matmul_provider(a, b, target)
    return matmul_call(a, b) if provider == "numpy_gemm" else call


class ProviderBuilder:
    """A BlockBuilder stand-in that emits every matmul with its faster provider, so programs
    built by instantiation use numpy's BLAS where it measures faster (EinNet §5: vendor
    kernels for matched operators). Everything else is the wrapped builder's."""

    def __init__(self, bb: relax.BlockBuilder, target: str = "llvm") -> None:
        self._bb = bb
        self._target = target

    def emit(self, expr: relax.Expr, name_hint: str = "") -> relax.Var:
        return self._bb.emit(faster_matmul(expr, self._target), name_hint)

    def __getattr__(self, name: str):
        return getattr(self._bb, name)


__all__ = ["GLOBAL_NAME", "matmul_call", "supports", "output_shape", "choose_matmul_provider",
           "faster_matmul", "ProviderBuilder"]
