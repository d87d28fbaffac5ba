"""ConvTransposePhases: a strided transposed convolution as stride^2 stride-1 convolutions,
a transposed convolution of a point input as a matmul.

What it rewrites
----------------
`relax.op.nn.conv2d_transpose(x, w)` with a stride s > 1 (in either dimension), NCHW data,
IOHW weights, no dilation, static shapes. Lowered as TVM (and our direct conv rule) lowers it,
such a call is a stride-1 convolution over x dilated by s: s^2 - 1 of every s^2 input
positions are zeros, so s^2 times the useful multiply-adds run (4x at stride 2, 16x at 4).
The rewrite computes each output phase separately instead:

    out[s*q + r] = P_r[q],   P_r = conv2d(x', w_r), stride 1, for every residue r in [0, s)

(per spatial dimension; the 2-D phases are the products (ry, rx)). The phases are then
interleaved (stack + reshape: out[n, f, s*q + ry, s*p + rx] = P[ry][rx][n, f, q, p]) and the
surplus rows and columns cropped. Every multiply-add of the result reads a real input value.

Why it is correct (one dimension; the 2-D sum separates because its index conditions do):
the transposed convolution is out[Y] = sum over (i, k) with Y = s*i + k - pad_lo of
x[i] * w[k]. Write Y = s*q + r. Then k = Y + pad_lo - s*i = s*(q - i) + r + pad_lo, so
k = rho (mod s) with rho = (r + pad_lo) mod s: only the taps k = s*t + rho (t = 0 .. T-1,
T = |{rho, rho + s, ...} below the kernel size|) contribute, and for tap t the input index is
i = q + delta - t with delta = (r + pad_lo) // s. Hence

    P_r[q] = sum_t x[q + delta - t] * w[s*t + rho]
           = sum_j x[q + j - (T - 1 - delta)] * w[s*(T - 1 - j) + rho]     (j = T - 1 - t)

a cross-correlation (conv2d) with the flipped taps w_r[j] = w[s*(T-1-j) + rho] over x padded
by lo = T - 1 - delta in front; the back padding hi = Q - len(x) + delta gives exactly
Q = ceil(out_len / s) outputs. Out-of-range x[i] are the zeros the padding supplies; a
negative lo / hi crops x instead (those x[i] would only meet outputs that do not exist).
A phase with T = 0 (s larger than the kernel) receives no tap: it is zeros. Output padding
only lengthens out_len (its extra positions are computed like any other, as TVM does).
Channels and groups: the IOHW weights [C, F/g, kh, kw] of group g become OIHW
[F, C/g, T_h, T_w] by regrouping, so conv2d with the same `groups` computes the same sums.

The numbers are summed in a different order only across taps of the same phase (a float
rounding difference); tests compare with TVM's own conv2d_transpose and numpy on random
inputs, and the einweld pipeline checks the whole module it returns.

A point input (1 x 1 spatial, any stride: a GAN generator's first layer, 100 -> 512 x 4 x 4)
is a matrix product instead. Lowered as a stride-1 convolution over the input padded by
k - 1 - pad, all but one of every kh * kw taps meet padding (16x the useful multiply-adds for
a 4 x 4 kernel). With one input position, out[Y] = sum over k with Y = k - pad_lo of x * w[k],
i.e. out[n, f, y, x] = sum_c x[n, c, 0, 0] * w[c, f, y + top, x + left]: a matmul of the
input [N, C] with the weight cropped to the output window and reshaped to [C, F * oh * ow]
(folded at compile time for a constant weight), reshaped back to [N, F, oh, ow]. Only
groups = 1 and no output padding (an output row past the kernel would receive no tap).

Not rewritten (left as it is, still correct): dilation, other layouts, symbolic shapes,
stride 1 with more than one input position (no zeros to skip).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ..expr.from_relax import UnsupportedOperator, static_shape


@dataclass(frozen=True)
class Phase:
    """One output residue r of one spatial dimension: its taps (kernel indices in
    cross-correlation order) and how the input is cropped, then zero-padded, at (start, end).
    No taps: the phase is zeros."""

    residue: int
    taps: tuple
    crop: tuple
    pad: tuple


@dataclass(frozen=True)
class PhasePlan:
    """A dimension of a transposed convolution as `stride` phases of `length` outputs each;
    the interleaved `stride * length` outputs are cropped to `out_len`."""

    stride: int
    out_len: int
    length: int
    phases: tuple


def plan_dimension(in_len: int, kernel: int, stride: int, pad_lo: int, pad_hi: int,
                   out_pad: int = 0) -> PhasePlan | None:
    """The phases of one dimension (see the module docstring); None if the output is empty."""
    out_len = (in_len - 1) * stride - pad_lo - pad_hi + kernel + out_pad
    if out_len <= 0:
        return None
    length = math.ceil(out_len / stride)
    phases = []
    for r in range(stride):
        rho, delta = (r + pad_lo) % stride, (r + pad_lo) // stride
        count = len(range(rho, kernel, stride))
        lo, hi = count - 1 - delta, length - in_len + delta
        crop, pad = (max(-lo, 0), max(-hi, 0)), (max(lo, 0), max(hi, 0))
        taps = tuple(stride * (count - 1 - j) + rho for j in range(count))
        if crop[0] + crop[1] >= in_len:
            taps = ()  # every tap meets padding: nothing of x reaches this phase
        phases.append(Phase(r, taps, crop, pad))
    return PhasePlan(stride, out_len, length, tuple(phases))


def _static_shape(expr: relax.Expr) -> tuple | None:
    try:
        return static_shape(expr)
    except UnsupportedOperator:
        return None


@dataclass(frozen=True)
class _Conv:
    """The attributes of a rewritable conv2d_transpose call."""

    data: tuple
    weight: tuple
    groups: int
    out_dtype: str
    rows: PhasePlan
    cols: PhasePlan


def _static_conv_transpose(call: relax.Call) -> tuple | None:
    """(attrs, data shape, weight shape) when `call` is an NCHW / IOHW conv2d_transpose without
    dilation on static 4-D shapes (what both rewrites need), else None."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.nn.conv2d_transpose":
        return None
    a = call.attrs
    layouts = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout))
    if layouts != ("NCHW", "IOHW", "NCHW"):
        return None
    if any(int(d) != 1 for d in a.dilation):
        return None
    data, weight = _static_shape(call.args[0]), _static_shape(call.args[1])
    if data is None or weight is None or len(data) != 4 or len(weight) != 4:
        return None
    return a, data, weight


def _match(call: relax.Call) -> _Conv | None:
    found = _static_conv_transpose(call)
    if found is None:
        return None
    a, data, weight = found
    strides = [int(s) for s in a.strides]
    if strides[0] * strides[1] == 1:
        return None
    top, left, bottom, right = (int(p) for p in a.padding)
    out_pad = [int(p) for p in a.output_padding]
    rows = plan_dimension(data[2], weight[2], strides[0], top, bottom, out_pad[0])
    cols = plan_dimension(data[3], weight[3], strides[1], left, right, out_pad[1])
    if rows is None or cols is None:
        return None
    out_dtype = str(call.ty.dtype)  # the result dtype: out_dtype when given, else the input
    return _Conv(data, weight, int(a.groups), out_dtype, rows, cols)


def _phase_weight(bb: relax.BlockBuilder, weight: relax.Expr, conv: _Conv, row: Phase,
                  col: Phase) -> relax.Expr:
    """IOHW [C, F/g, kh, kw] -> the phase's OIHW [F, C/g, T_h, T_w] (taps taken in
    correlation order; FoldConstant evaluates it at compile time for constant weights)."""
    w = bb.emit(relax.op.take(weight, relax.const(np.array(row.taps, "int64")), axis=2))
    w = bb.emit(relax.op.take(w, relax.const(np.array(col.taps, "int64")), axis=3))
    c, f_per_group = conv.weight[0], conv.weight[1]
    g, th, tw = conv.groups, len(row.taps), len(col.taps)
    w = bb.emit(relax.op.reshape(w, (g, c // g, f_per_group, th, tw)))
    w = bb.emit(relax.op.permute_dims(w, [0, 2, 1, 3, 4]))
    return bb.emit(relax.op.reshape(w, (g * f_per_group, c // g, th, tw)))


def _phase(bb: relax.BlockBuilder, data: relax.Expr, weight: relax.Expr, conv: _Conv,
           row: Phase, col: Phase) -> relax.Expr:
    """One (row residue, column residue) phase: [N, F, rows.length, cols.length]."""
    n, f = conv.data[0], conv.weight[1] * conv.groups
    out_shape = (n, f, conv.rows.length, conv.cols.length)
    if not row.taps or not col.taps:
        return bb.emit(relax.op.zeros(out_shape, conv.out_dtype))
    x = data
    if any(row.crop) or any(col.crop):
        h, w = conv.data[2], conv.data[3]
        x = bb.emit(relax.op.strided_slice(x, axes=[2, 3], begin=[row.crop[0], col.crop[0]],
                                           end=[h - row.crop[1], w - col.crop[1]]))
    return bb.emit(relax.op.nn.conv2d(
        x, _phase_weight(bb, weight, conv, row, col), strides=1,
        padding=(row.pad[0], col.pad[0], row.pad[1], col.pad[1]), groups=conv.groups,
        out_dtype=conv.out_dtype))


def _point_window(call: relax.Call) -> tuple | None:
    """(N, C, F, top, left, oh, ow) when `call` is a conv2d_transpose of a point input that
    the matmul form computes (see the module docstring), else None."""
    found = _static_conv_transpose(call)
    if found is None:
        return None
    a, data, weight = found
    if int(a.groups) != 1 or any(int(p) != 0 for p in a.output_padding) or \
            tuple(data[2:]) != (1, 1):
        return None
    top, left, bottom, right = (int(p) for p in a.padding)
    oh, ow = weight[2] - top - bottom, weight[3] - left - right
    if oh <= 0 or ow <= 0:
        return None
    return data[0], data[1], weight[1], top, left, oh, ow


def _rewrite_point(bb: relax.BlockBuilder, call: relax.Call, window: tuple) -> relax.Expr:
    """out = reshape(x[N, C] @ w[:, :, top:top+oh, left:left+ow] as [C, F*oh*ow])."""
    n, c, f, top, left, oh, ow = window
    data, weight = call.args
    x = bb.emit(relax.op.reshape(data, (n, c)))
    w = weight
    if (top, left, oh, ow) != (0, 0) + tuple(_static_shape(weight)[2:]):
        w = bb.emit(relax.op.strided_slice(w, axes=[2, 3], begin=[top, left],
                                           end=[top + oh, left + ow]))
    w = bb.emit(relax.op.reshape(w, (c, f * oh * ow)))
    y = bb.emit(relax.op.matmul(x, w, out_dtype=str(call.ty.dtype)))
    return bb.emit(relax.op.reshape(y, (n, f, oh, ow)))


def rewrite_call(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """The phase form of `call` (or for a point input its matmul form) emitted into `bb`
    (its value), or None if `call` is not a rewritable conv2d_transpose."""
    window = _point_window(call)
    if window is not None:
        return _rewrite_point(bb, call, window)
    conv = _match(call)
    if conv is None:
        return None
    data, weight = call.args
    n, f = conv.data[0], conv.weight[1] * conv.groups
    q_h, q_w = conv.rows.length, conv.cols.length
    s_h, s_w = conv.rows.stride, conv.cols.stride
    rows = []
    for row in conv.rows.phases:
        parts = [_phase(bb, data, weight, conv, row, col) for col in conv.cols.phases]
        # out[.., q, s_w * p + rx] = parts[rx][.., q, p]
        stacked = bb.emit(relax.op.stack(parts, axis=4)) if s_w > 1 else parts[0]
        rows.append(bb.emit(relax.op.reshape(stacked, (n, f, q_h, q_w * s_w))))
    # out[.., s_h * q + ry, :] = rows[ry][.., q, :]
    stacked = bb.emit(relax.op.stack(rows, axis=3)) if s_h > 1 else rows[0]
    out = bb.emit(relax.op.reshape(stacked, (n, f, q_h * s_h, q_w * s_w)))
    if (q_h * s_h, q_w * s_w) != (conv.rows.out_len, conv.cols.out_len):
        out = bb.emit(relax.op.strided_slice(out, axes=[2, 3], begin=[0, 0],
                                             end=[conv.rows.out_len, conv.cols.out_len]))
    return out


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        out = rewrite_call(self.builder_, call)
        if out is None:
            return call
        self.rewritten += 1
        return out


@tvm.transform.module_pass(opt_level=0, name="ConvTransposePhases")
def ConvTransposePhases(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # pylint: disable=invalid-name
    """Relax module pass: every strided NCHW conv2d_transpose becomes stride^2 stride-1
    conv2d phases interleaved, one of a point input a matmul (see the module docstring);
    other calls are left unchanged."""
    rewriter = _Rewriter(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    if not rewriter.rewritten:
        return mod
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
