"""Canonical expressions of operators (EinNet §3, Table 2's operators).

Each builder takes input tensors (name + shape) and the operator's attributes, and returns the
expression whose value is the operator's output. Padding sizes are derived from the index
functions' bounds, so no builder assumes a particular shape.

G2BMM and GBMM (Longformer's band products) are not Relax ops; they are provided here as
expressions and, independently, as plain numpy reference functions.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np

from . import index as ix
from .expression import Access, BinaryOp, Expr, Iterator, Tensor, unary
from .index import IndexExpr
from .index_simplify import simplify_expr


class UnsupportedOperator(NotImplementedError):
    """The operator (or this attribute combination) has no canonical expression yet."""


def needed_padding(
    indices: Sequence[IndexExpr], shape: Sequence[int], ranges: Dict[str, Tuple[int, int]]
) -> Tuple[Tuple[int, int], ...]:
    """Smallest zero padding that keeps every index of an access inside the padded tensor."""
    pad = []
    for idx, n in zip(indices, shape):
        lo, hi = ix.bounds(idx, ranges)
        pad.append((max(0, -lo), max(0, hi - (n - 1))))
    return tuple(pad)


def padded_access(tensor: Tensor, indices: Sequence[IndexExpr], its: Sequence[Iterator]) -> Access:
    ranges = {it.name: (it.lo, it.hi) for it in its}
    return Access(tensor.with_pad(needed_padding(indices, tensor.shape, ranges)), tuple(indices))


def _iters(prefix: str, shape: Sequence[int]) -> Tuple[Iterator, ...]:
    return tuple(Iterator(f"{prefix}{k}", 0, n) for k, n in enumerate(shape))


# --- convolution -------------------------------------------------------------------------

def _layout_positions(layout: str, letters: str) -> Tuple[int, ...]:
    if sorted(layout) != sorted(letters):
        raise UnsupportedOperator(f"layout {layout!r} is not a permutation of {letters!r}")
    return tuple(layout.index(c) for c in letters)


def conv2d(
    data: Tensor,
    weight: Tensor,
    strides: Sequence[int] = (1, 1),
    padding: Sequence[int] = (0, 0, 0, 0),
    dilation: Sequence[int] = (1, 1),
    groups: int = 1,
    data_layout: str = "NCHW",
    kernel_layout: str = "OIHW",
) -> Expr:
    """out[n,f,y,x] = Σ_{c,r,s} A[n, g·Cg+c, y·sh + r·dh - pt, x·sw + s·dw - pl] · K[f,c,r,s]

    with g = f // Fg for grouped convolution; output in `data_layout`. `padding` is
    (top, left, bottom, right) as in Relax (2 values mean symmetric).
    """
    pt, pl, pb, pr = _four(padding)
    dn, dc, dh, dw = _layout_positions(data_layout, "NCHW")
    ko, ki, kh, kw = _layout_positions(kernel_layout, "OIHW")
    N, C, H, W = (data.shape[p] for p in (dn, dc, dh, dw))
    F, Cg, R, S = (weight.shape[p] for p in (ko, ki, kh, kw))
    if C != Cg * groups or F % groups:
        raise ValueError(f"conv2d: channels {C} / weight {weight.shape} / groups {groups} mismatch")
    (sh, sw), (dlh, dlw) = _pair(strides), _pair(dilation)
    OH = (H + pt + pb - dlh * (R - 1) - 1) // sh + 1
    OW = (W + pl + pr - dlw * (S - 1) - 1) // sw + 1
    n, f, y, x = (Iterator(nm, 0, ext) for nm, ext in zip("nfyx", (N, F, OH, OW)))
    c, r, s = Iterator("c", 0, Cg), Iterator("r", 0, R), Iterator("s", 0, S)
    chan: IndexExpr = c.var if groups == 1 else (f.var // (F // groups)) * Cg + c.var
    a_idx = _place(data_layout, "NCHW",
                   (n.var, chan, y.var * sh + r.var * dlh - pt, x.var * sw + s.var * dlw - pl))
    k_idx = _place(kernel_layout, "OIHW", (f.var, c.var, r.var, s.var))
    its = (n, f, y, x, c, r, s)
    body = padded_access(data, a_idx, its) * Access(weight, k_idx)
    out_its = tuple(_place(data_layout, "NCHW", (n, f, y, x)))
    return Expr(out_its, (c, r, s), body, data.dtype)


def conv2d_transpose(
    data: Tensor,
    weight: Tensor,
    strides: Sequence[int] = (1, 1),
    padding: Sequence[int] = (0, 0, 0, 0),
    output_padding: Sequence[int] = (0, 0),
    dilation: Sequence[int] = (1, 1),
    groups: int = 1,
) -> Expr:
    """Transposed convolution, NCHW data and IOHW weight (Relax's defaults).

    out[y] = Σ_{i,r : i·s + r - p = y} A[i]·W[r]. Writing r = (y+p) % s + s·k and
    i = (y+p) // s - k enumerates exactly those pairs with one summation iterator k per
    spatial dimension, so the expression needs no divisibility condition.
    """
    if _pair(dilation) != (1, 1) or groups != 1:
        raise UnsupportedOperator("conv2d_transpose with dilation or groups is not supported")
    pt, pl, pb, pr = _four(padding)
    N, C, H, W = data.shape
    Cw, F, R, S = weight.shape
    if Cw != C:
        raise ValueError(f"conv2d_transpose: weight {weight.shape} does not match data {data.shape}")
    (sh, sw), (oph, opw) = _pair(strides), _pair(output_padding)
    OH = (H - 1) * sh - pt - pb + R + oph
    OW = (W - 1) * sw - pl - pr + S + opw
    n, f, y, x = (Iterator(nm, 0, ext) for nm, ext in zip("nfyx", (N, F, OH, OW)))
    c = Iterator("c", 0, C)
    k1, k2 = Iterator("k1", 0, -(-R // sh)), Iterator("k2", 0, -(-S // sw))
    its = (n, f, y, x, c, k1, k2)
    yy, xx = y.var + pt, x.var + pl
    a_idx = (n.var, c.var, yy // sh - k1.var, xx // sw - k2.var)
    w_idx = (c.var, f.var, yy % sh + k1.var * sh, xx % sw + k2.var * sw)
    body = padded_access(data, a_idx, its) * padded_access(weight, w_idx, its)
    return Expr((n, f, y, x), (c, k1, k2), body, data.dtype)


def _pair(value) -> Tuple[int, int]:
    """An int or a 1/2-sequence as (height, width)."""
    v = (int(value),) if isinstance(value, int) else tuple(int(x) for x in value)
    if len(v) not in (1, 2):
        raise ValueError(f"expected one or two values, got {value}")
    return (v[0], v[-1])


def _four(padding) -> Tuple[int, int, int, int]:
    p = (int(padding),) if isinstance(padding, int) else tuple(int(v) for v in padding)
    if len(p) == 1:
        return p * 4
    if len(p) == 2:
        return (p[0], p[1], p[0], p[1])
    if len(p) == 4:
        return p
    raise ValueError(f"padding must have 1, 2 or 4 values, got {padding}")


def _place(layout: str, canonical: str, values):
    """Reorder values given in `canonical` dimension order into `layout` order."""
    return tuple(values[canonical.index(ch)] for ch in layout)


# --- matrix products ---------------------------------------------------------------------

def matmul(a: Tensor, b: Tensor, transpose_b: bool = False) -> Expr:
    """numpy.matmul semantics for inputs of rank >= 2, with batch broadcasting.

    `transpose_b` gives the dense form out[..., m, n] = Σ_k A[..., m, k] · B[..., n, k].
    """
    if a.ndim < 2 or b.ndim < 2:
        raise UnsupportedOperator("matmul of rank-1 tensors is not supported")
    M, K = a.shape[-2:]
    N, Kb = (b.shape[-2], b.shape[-1]) if transpose_b else (b.shape[-1], b.shape[-2])
    if K != Kb:
        raise ValueError(f"matmul: inner dimensions differ, {a.shape} x {b.shape}")
    batch = _broadcast_shape(a.shape[:-2], b.shape[:-2])
    bits = _iters("b", batch)
    m, n, k = Iterator("m", 0, M), Iterator("n", 0, N), Iterator("k", 0, K)
    a_idx = _broadcast_indices(bits, a.shape[:-2]) + (m.var, k.var)
    b_tail = (n.var, k.var) if transpose_b else (k.var, n.var)
    b_idx = _broadcast_indices(bits, b.shape[:-2]) + b_tail
    return Expr(bits + (m, n), (k,), Access(a, a_idx) * Access(b, b_idx), a.dtype)


def _broadcast_shape(*shapes: Sequence[int]) -> Tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError as err:
        raise ValueError(f"shapes {shapes} do not broadcast") from err


def _broadcast_indices(out_its: Sequence[Iterator], shape: Sequence[int]) -> Tuple[IndexExpr, ...]:
    """Indices of an operand of `shape` broadcast (numpy rules) to the output iterators."""
    tail = out_its[len(out_its) - len(shape):] if shape else ()
    return tuple(ix.IConst(0) if dim == 1 and it.extent != 1 else it.var
                 for it, dim in zip(tail, shape))


# --- layout ops ----------------------------------------------------------------------------

def permute_dims(a: Tensor, axes: Sequence[int] = ()) -> Expr:
    """out[i_0, ..., i_{n-1}] with out dim j = input dim axes[j] (reverse when axes is empty)."""
    axes = tuple(axes) if axes else tuple(reversed(range(a.ndim)))
    if sorted(axes) != list(range(a.ndim)):
        raise ValueError(f"permute_dims: {axes} is not a permutation of {a.ndim} axes")
    its = tuple(Iterator(f"i{j}", 0, a.shape[axis]) for j, axis in enumerate(axes))
    idx = [None] * a.ndim
    for j, axis in enumerate(axes):
        idx[axis] = its[j].var
    return Expr(its, (), Access(a, tuple(idx)), a.dtype)


def reshape(a: Tensor, shape: Sequence[int]) -> Expr:
    """Row-major reshape: flatten the output index, unflatten it in the input's shape."""
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape)) != int(np.prod(a.shape)):
        raise ValueError(f"reshape {a.shape} -> {shape} changes the number of elements")
    its = _iters("i", shape)
    flat: IndexExpr = ix.IConst(0)
    for it, n in zip(its, shape):
        flat = flat * n + it.var
    idx = []
    stride = int(np.prod(a.shape))
    for d, n in enumerate(a.shape):
        stride //= n
        e = flat // stride
        idx.append(e if d == 0 else e % n)
    return simplify_expr(Expr(its, (), Access(a, tuple(idx)), a.dtype))


# --- element-wise ------------------------------------------------------------------------

def elementwise(op: str, a: Tensor, b: Tensor) -> Expr:
    """out = A op B with numpy broadcasting; op is one of + - *."""
    shape = _broadcast_shape(a.shape, b.shape)
    its = _iters("i", shape)
    body = BinaryOp(op, Access(a, _broadcast_indices(its, a.shape)),
                    Access(b, _broadcast_indices(its, b.shape)))
    return Expr(its, (), body, a.dtype)


def add(a: Tensor, b: Tensor) -> Expr:
    return elementwise("+", a, b)


def subtract(a: Tensor, b: Tensor) -> Expr:
    return elementwise("-", a, b)


def multiply(a: Tensor, b: Tensor) -> Expr:
    return elementwise("*", a, b)


def unary_op(fn: str, a: Tensor) -> Expr:
    its = _iters("i", a.shape)
    return Expr(its, (), unary(fn, Access(a, tuple(it.var for it in its))), a.dtype)


def relu(a: Tensor) -> Expr:
    return unary_op("relu", a)


def bias_add(data: Tensor, bias: Tensor, axis: int = 1) -> Expr:
    """out[..., c, ...] = data[..., c, ...] + bias[c] along `axis`."""
    its = _iters("i", data.shape)
    body = Access(data, tuple(it.var for it in its)) + Access(bias, (its[axis].var,))
    return Expr(its, (), body, data.dtype)


# --- Longformer band products --------------------------------------------------------------

def g2bmm(a: Tensor, b: Tensor, width: int, dilation: int = 1) -> Expr:
    """General-to-band matmul: C[b, i, j] = Σ_k A[b, i, k] · B[b, i + d·j, k], j ∈ [-w, w].

    Rows of B outside [0, N) read zero padding. The output's last dimension has extent 2w+1
    and is addressed by j (stored at j + w).
    """
    Bt, N, K = a.shape
    if tuple(b.shape) != (Bt, N, K):
        raise ValueError(f"g2bmm: operands {a.shape} and {b.shape} differ")
    bb, i, j = Iterator("b", 0, Bt), Iterator("i", 0, N), Iterator("j", -width, width + 1)
    k = Iterator("k", 0, K)
    its = (bb, i, j, k)
    body = Access(a, (bb.var, i.var, k.var)) * padded_access(
        b, (bb.var, i.var + j.var * dilation, k.var), its)
    return Expr((bb, i, j), (k,), body, a.dtype)


def gbmm(a: Tensor, b: Tensor, width: int, dilation: int = 1) -> Expr:
    """General band matmul: C[b, i, k] = Σ_{j∈[-w,w]} A[b, i, j + w] · B[b, i + d·j, k]."""
    Bt, N, W2 = a.shape
    if W2 != 2 * width + 1 or b.shape[:2] != (Bt, N):
        raise ValueError(f"gbmm: band {a.shape} and matrix {b.shape} do not match width {width}")
    K = b.shape[2]
    bb, i, k = Iterator("b", 0, Bt), Iterator("i", 0, N), Iterator("k", 0, K)
    j = Iterator("j", -width, width + 1)
    its = (bb, i, k, j)
    body = Access(a, (bb.var, i.var, j.var + width)) * padded_access(
        b, (bb.var, i.var + j.var * dilation, k.var), its)
    return Expr((bb, i, k), (j,), body, a.dtype)


def g2bmm_reference(a: np.ndarray, b: np.ndarray, width: int, dilation: int = 1) -> np.ndarray:
    """Plain numpy G2BMM, written independently of the expression IR."""
    Bt, N, _ = a.shape
    out = np.zeros((Bt, N, 2 * width + 1), dtype=np.float64)
    for jj, j in enumerate(range(-width, width + 1)):
        rows = np.arange(N) + dilation * j
        valid = (rows >= 0) & (rows < N)
        prod = np.einsum("bik,bik->bi", a[:, valid, :].astype(np.float64),
                         b[:, rows[valid], :].astype(np.float64))
        out[:, valid, jj] = prod
    return out


def gbmm_reference(a: np.ndarray, b: np.ndarray, width: int, dilation: int = 1) -> np.ndarray:
    """Plain numpy GBMM, written independently of the expression IR."""
    Bt, N, _ = a.shape
    out = np.zeros((Bt, N, b.shape[2]), dtype=np.float64)
    for jj, j in enumerate(range(-width, width + 1)):
        rows = np.arange(N) + dilation * j
        valid = (rows >= 0) & (rows < N)
        out[:, valid, :] += a[:, valid, jj, None].astype(np.float64) * b[:, rows[valid], :]
    return out


__all__ = [
    "UnsupportedOperator", "conv2d", "conv2d_transpose", "matmul", "permute_dims", "reshape",
    "elementwise", "add", "subtract", "multiply", "unary_op", "relu", "bias_add", "g2bmm",
    "gbmm", "g2bmm_reference", "gbmm_reference", "needed_padding", "padded_access",
]
