"""CPU rule for 2-D max pooling: the window's maximum taken down the columns, then along the row.

TVM legalises `relax.nn.max_pool2d` (`topi.nn.pool2d`, NCHW) into one window reduction: output
(y, x) is the maximum of the kh x kw taps (sy*y + dy*i - pt, sx*x + dx*j - pl), padding taps
reading the dtype's lowest value. Scheduled as it stands (`injective.schedule_spatial_block`),
every output vector gathers kh * kw strided rows: on a Zen 5 core ResNet-18's 3x3/s2 pool over
64x112x112 took 57 us, 24 % of the copy bandwidth of its bytes. This rule computes the same
maximum in two passes, per output row:

    rows[px]   = max over i of   x[sy*y + dy*i - pt, px - pl]    (lowest value out of bounds)
    out[y, x]  = max over j of   rows[sx*x + dx*j]

`rows` covers the columns the row's windows read (0 .. sx*(OW-1) + dx*(kw-1)); the first pass
reads kh input rows with contiguous vectors, the second reads `rows` (a few hundred bytes on the
stack, in L1) every sx-th element, which `deinterleave` turns into vector loads and shuffles.
The work per output row falls from kh*kw strided taps per output to kh contiguous taps per
column plus kw per output (56.5 -> 31.3 us on the same pool, the same machine).

Why it is correct
-----------------
- The function is claimed only when it *is* TVM's legalised max_pool2d: the window (kernel,
  strides, dilation, leading padding, ceil mode) is read off the function and the stock
  function for that window is made again (`relax.nn.max_pool2d` through LegalizeOps) and must
  be structurally equal to it, attributes aside. Anything else (another layout, a pool fused
  with its neighbours, an average) is left to the other rules.
- max over a rectangle of taps is max over its rows of max over each row's taps: max is
  associative and commutative and exact (it returns one of its operands), so no rounding
  changes. A tap outside the input contributes the lowest value in both forms, and the result
  starts from that value as the stock reduction's init does (a window of -inf inputs gives the
  lowest finite value in both). For inputs without NaN the outputs are bit-identical; which
  NaN operand wins a comparison is the hardware's choice in either form.
- The output shape is the function's own (ceil mode's extra row or column included), and the
  bounds test is on the input's extent, so a window hanging over any edge reads only the input.
- What schedules the two passes are TensorIR primitives (split, fuse, compute_at, parallel and
  the vectorisation of `injective.vectorize_segments`); each checks its own preconditions.
And, as for every rule, the pipeline checks the whole module against stock TVM on random inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import tvm
from tvm import relax, s_tir, te, tirx
from tvm.sym import detect_linear_equation
from tvm.target import Target

from .. import same_code
from .gemm import MAX_STACK_BYTES
from .injective import COMM_REDUCE, block_bytes, cpu_params, loads, vectorize_segments


@dataclass(frozen=True)
class PoolWindow:
    """A 2-D pooling window over the last two axes: (rows, columns) pairs."""

    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]  # top, left, bottom, right, as relax.nn.max_pool2d
    ceil_mode: bool


# ---------------------------------------------------------------------------------- matching
def stock_max_pool2d(shape, dtype: str, window: PoolWindow) -> tirx.PrimFunc:
    """TVM's own legalisation of relax.nn.max_pool2d (NCHW) for `window`."""
    bb = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [data]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.max_pool2d(
                data, pool_size=window.kernel, strides=window.strides, padding=window.padding,
                dilation=window.dilation, ceil_mode=window.ceil_mode))
        bb.emit_func_output(out)
    legalised = relax.transform.LegalizeOps()(bb.get())
    return next(f for f in legalised.functions.values() if isinstance(f, tirx.PrimFunc))


def _coefficients(index: tirx.Expr, outer: tirx.Var, tap: tirx.Var) -> Optional[tuple[int, int, int]]:
    """(stride, dilation, offset) when `index` is stride*outer + dilation*tap + offset."""
    linear = detect_linear_equation(index, [outer, tap])
    if len(linear) != 3 or not all(isinstance(c, tirx.IntImm) for c in linear):
        return None
    return int(linear[0]), int(linear[1]), int(linear[2])


def match_max_pool2d(func: tirx.PrimFunc) -> Optional[PoolWindow]:
    """The window of `func` when it is TVM's legalised max_pool2d over NCHW-like 4-D data with
    a window of at least 2 x 2 (see the module docstring), else None."""
    if len(func.params) != 2:
        return None
    data, out = func.params
    if len(data.shape) != 4 or len(out.shape) != 4 or \
            not all(isinstance(d, tirx.IntImm) for d in list(data.shape) + list(out.shape)):
        return None
    sch = s_tir.Schedule(func)
    blocks = [sch.get(rv) for rv in sch.get_child_blocks(sch.get_sblock("root"))]
    if not 1 <= len(blocks) <= 2:
        return None
    pool, pad = blocks[-1], (blocks[0] if len(blocks) == 2 else None)
    iters = list(pool.iter_vars)
    if len(iters) != 6 or [int(iv.iter_type) == COMM_REDUCE for iv in iters] != [False] * 4 + [True] * 2:
        return None
    source = [ld for ld in loads(pool) if not ld.source.same_as(out)]
    if len(source) != 1 or len(source[0].indices) != 4:
        return None
    rows = _coefficients(source[0].indices[2], iters[2].var, iters[4].var)
    cols = _coefficients(source[0].indices[3], iters[3].var, iters[5].var)
    if rows is None or cols is None:
        return None
    kernel = (int(iters[4].dom.extent), int(iters[5].dom.extent))
    if min(kernel) < 2:
        return None  # a 1-wide window has nothing to share between outputs
    before = [0, 0]
    after = [0, 0]
    if pad is not None:
        pad_reads = [ld for ld in loads(pad) if ld.source.same_as(data)]
        if len(pad_reads) != 1 or len(pad_reads[0].indices) != 4:
            return None
        padded = [int(d) for d in pad.writes[0].source.shape]
        for axis in (0, 1):
            linear = detect_linear_equation(pad_reads[0].indices[2 + axis],
                                            [pad.iter_vars[2 + axis].var])
            if len(linear) != 2 or not isinstance(linear[1], tirx.IntImm):
                return None
            before[axis] = -int(linear[1])
            after[axis] = padded[2 + axis] - int(data.shape[2 + axis]) - before[axis]
    shape = [int(d) for d in data.shape]
    for ceil_mode in (False, True):
        # In ceil mode TOPI pads the end by stride - 1 more than the attribute says.
        extra = (rows[0] - 1, cols[0] - 1) if ceil_mode else (0, 0)
        padding = (before[0], before[1], after[0] - extra[0], after[1] - extra[1])
        if min(padding) < 0:
            continue
        window = PoolWindow(kernel, (rows[0], cols[0]), (rows[1], cols[1]), padding, ceil_mode)
        try:
            stock = stock_max_pool2d(shape, str(data.dtype), window)
        except (tvm.error.TVMError, ValueError):
            continue
        if same_code(stock, func):
            return window
    return None


# ---------------------------------------------------------------------------------- building
def separable_max_pool2d(func: tirx.PrimFunc, window: PoolWindow) -> tirx.PrimFunc:
    """The two-pass form of `func` (its parameters' shapes, dtype and names): blocks
    "pool_rows" (the maximum down each column, per output row) and "pool_max"."""
    data_param, out_param = func.params
    shape = [int(d) for d in data_param.shape]
    out_shape = [int(d) for d in out_param.shape]
    dtype = str(data_param.dtype)
    height, width = shape[2:]
    (kh, kw), (sy, sx), (dy, dx) = window.kernel, window.strides, window.dilation
    top, left = window.padding[:2]
    used = sx * (out_shape[3] - 1) + dx * (kw - 1) + 1
    data = te.placeholder(shape, dtype, name=data_param.name)
    lowest = tvm.te.min_value(dtype)

    def column_max(n, c, y, px):
        ix = px - left
        value = lowest  # the stock reduction's init
        for i in range(kh):
            iy = sy * y + dy * i - top
            inside = tirx.all(iy >= 0, iy < height, ix >= 0, ix < width)
            value = tirx.max(value, tirx.if_then_else(inside, data[n, c, iy, ix], lowest))
        return value

    rows = te.compute(out_shape[:3] + [used], column_max, name="pool_rows")

    def row_max(n, c, y, x):
        value = rows[n, c, y, sx * x]
        for j in range(1, kw):
            value = tirx.max(value, rows[n, c, y, sx * x + dx * j])
        return value

    out = te.compute(out_shape, row_max, name=out_param.name)
    made = te.create_prim_func([data, out])
    return tirx.PrimFunc(made.params, made.body, made.ret_type, attrs=func.attrs)


# ------------------------------------------------------------------------------------- rule
def schedule_max_pool(func: tirx.PrimFunc, target: Target) -> Optional[s_tir.Schedule]:
    """The rule: a Schedule of the two-pass form of `func` when it is a max_pool2d this rule
    claims (`match_max_pool2d`), else None.

    Loop nest: the output's leading axes and blocks of output rows fused into one parallel
    loop; under it, the block's `pool_rows` (as many rows as keep it within TVM's stack
    allocation, so no workspace call per task), then its outputs; both vectorised along the
    row at element granularity (`vectorize_segments`: only a padded edge column runs scalar),
    one register a vector."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None
    window = match_max_pool2d(func)
    if window is None:
        return None
    sch = s_tir.Schedule(separable_max_pool2d(func, window))
    params = cpu_params(target)
    out, rows = sch.get_sblock(str(func.params[1].name)), sch.get_sblock("pool_rows")
    lanes = params.lanes(str(func.params[0].dtype))
    n, c, y, x = sch.get_loops(out)
    rows_shape = sch.get(rows).writes[0].source.shape
    row_bytes = int(rows_shape[3]) * tvm.runtime.DataType(str(func.params[0].dtype)).bits // 8
    per_block = max(1, min(int(rows_shape[2]), MAX_STACK_BYTES // row_bytes))
    y_outer, _ = sch.split(y, [None, per_block])
    outer = sch.fuse(n, c, y_outer)
    sch.compute_at(rows, outer)
    if params.tasks(block_bytes(sch.get(out)) + block_bytes(sch.get(rows))) > 1:
        sch.parallel(outer)
    # One register a vector in both blocks: the outputs read `pool_rows` every sx-th element
    # right after it is written, and `deinterleave`'s shuffle of a two-register strided load
    # was lowered lane by lane; with one-register reads of two-register stores, the loads
    # straddle stores still in flight. Max-pool 3x3/s2 64x112x112 on the Intel Xeon of
    # session 35: 78 us two registers a vector in both, 146 us one in the outputs only,
    # 46 us one in both.
    vectorize_segments(sch, out, x, lanes, params, wide=1)
    vectorize_segments(sch, rows, sch.get_loops(rows)[-1], lanes, params, wide=1)
    return sch
