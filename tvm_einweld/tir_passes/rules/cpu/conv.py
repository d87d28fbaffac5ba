"""Analytic CPU schedule for NCHW convolutions as a direct GEMM-class kernel.

What it matches
---------------
The functions LegalizeOps (+ FuseOps/FuseTIR) makes of `relax.op.nn.conv2d` (any stride,
dilation, padding, groups, depthwise) and `conv2d_transpose` (a dilated, padded input and a
flipped kernel feeding a stride-1 convolution), with spatial epilogues (bias, relu, clip,
residual add). Precisely: one reduction block `out[n, f, y, x] += D[...] * W[...]` whose four
spatial iterators index the output in that order and whose reduced iterators (channel and
kernel window) are read by both operands; W is the operand indexed by `f` but not by `x`
(the weights) and D the one indexed by `x` (the data). Everything else must be spatial.

The schedule
------------
Output channels x output positions form the register block, the reduction (c, kh, kw) runs
inside it, the same structure as the GEMM micro-kernel (A = weights, broadcast; B = data,
vectors along the contiguous output row):

1. Weight-side producers (the transposed convolution's flip) are inlined; `reindex` gives the
   weights in the block's own order [f, c, kh, kw], and `transform_layout` packs them as
   [F/mr, c, kh, kw, mr] (OIHWo), so the mr broadcasts of one reduction step are contiguous.
   If the weights are compile-time constants (PrimFunc attr `layout_free_buffers`), the pack
   block is annotated `meta_schedule.layout_rewrite_preproc` and `apply.prepack_weights`
   moves it out of inference, as for GEMM.
2. The data padding (and the transposed convolution's dilation) stay one materialised copy
   (parallel over channels), so the micro-kernel reads plain memory without conditionals.
   With weights that fit in L2, the copy is made band by band inside the parallel loop
   instead (`copy_band`): each core copies the padded rows its band of output rows reads
   into a buffer that stays in its L2, then runs the band's tiles (GCN 11.0 -> 10.1 ms,
   DCGAN 1.11 -> 0.93 ms, FSRCNN 228 -> 201 us; strided, in the column phases below:
   ResNet-18's 7x7/s2 3 -> 64 at 224x224 808-816 -> 700-739 us, 3x3/s2 64 -> 128 at 56x56
   424-431 -> 388-403 us). Where the output rows run as one axis of positions (step 3) the
   copy is made per core instead, when it fits half of L2 with the weights (`core_copy`):
   each core copies the rows its share of the positions reads, or the whole input where
   the positions do not split into whole vectors per core. One copy shared by the cores
   moved its lines between them at every call.
   With a column stride s, that copy is stored in s column phases ([.., W] -> [.., s, W/s],
   zero-padded): output column x, kernel column kx reads phase kx % s at x + kx // s, so a
   row of outputs is a contiguous vector again (a stride-2 3x3 conv went 3x faster). The
   copy itself is vectorised along its rows, only the vectors at a row's edges (where the
   padding condition changes inside a vector) left scalar (`injective.vectorize_chunks`):
   the scalar copy had cost a stride-2 depthwise conv half its time, and MobileNetV2's
   stride-2 3 -> 32 conv at 224x224 60 %.
3. Loops: (n, row band) parallel with (y/yb, x/xb, f/mr) inside where the copy is banded;
   else (n, f/mr, y/yb, x/xb) fused and parallel, or (n, y/yb, x/xb, f/mr) where the
   channel tiles would each read an input beyond L2 again (`positions_outer`, the GEMM
   rule's traffic test); the reduction (c, kh, kw); then the
   register block mr x yb x xb, unrolled except the vector lanes, which hold either the xb
   output columns (xb divides the output width and is at most one vector or whole vectors)
   or, on small feature maps whose rows would leave the lanes more than half empty, mr
   output channels (the accumulator is then stored channels-innermost). A `local`
   cache-write is the accumulator; the write-back carries the epilogue.
   With kernel width 1 and stride 1 (GCN's 15x1 convolutions) whose rows leave lanes empty
   (14 of 16), the block iterates positions p = y * W + x instead of rows and columns
   (`_flat_positions`): position p reads the data at p + ky * dilation * W, contiguous
   across row ends. Its tiles are written back into a copy of the output indexed by
   position, then copied out with the epilogue in one pass (a (row, column) write-back of a
   tile that crosses a row end covers whole rows: TVM copied positions the tile never
   computed).
4. Where the channel tiles run outer and the weights do not stay in L2 from call to call,
   every tile prefetches its share of the next channel tile's weight panel, a few lines per
   input channel (`prefetch`, where the measurements are): the first position tile of a
   panel no longer waits for the whole panel from DRAM.

Block sizes come from the GEMM model (`gemm.micro_cycles`, `gemm.fits_registers`): one code
path sizes both kernel classes. mr divides F and yb, xb divide the output height / width, so
every split is exact, except along a row of positions, where a block of whole vectors may end
past the last position (`position_blocks`: split's predicate keeps that tail from computing,
reading or writing). For a depthwise (or any channel-per-group) convolution the data vector
differs per output channel, so mr is 1 and the block grows along y and x instead.

Correctness rests, as in gemm.py, on the schedule primitives (each checks its preconditions
and preserves semantics; step 4's prefetch hints change no value); when one refuses the rule
returns None. Not handled (None): NHWC
and other layouts, non-static shapes, more or fewer than 4 output axes, and pointwise (1x1)
convolutions, which have the einsum form and go to the GEMM rule.
A strided transposed convolution reaching this rule would multiply the zeros of its dilated
input (stride^2 more FMAs than needed); the pipeline splits it into stride-1 phases first
(`relay_passes.conv_transpose_phases`, run by `tir_passes.prepare`), so it arrives here only
when that pass left it alone (dilation, dynamic shapes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import tvm
from tvm import ir, s_tir, tirx
from tvm.sym import Analyzer
from tvm.target import Target

from ...localize import buffer_bytes
from . import gemm, injective
from .isa import CACHE_LINE, vector_isa
from .prefetch import (hinted_schedule, next_panel_of_tile, prefetch_fits,
                       prefetch_next_panel)

# Register-block rows along the output height are unrolled code; beyond this the unrolled
# body gets long without adding accumulators the register file could hold anyway.
MAX_Y_BLOCK = 8

# Sustained bytes per cycle one core reads from L2 into L1 while it also computes. Zen 2-4
# and Intel cores since Haswell fill at most 32-64 B/cycle from L2; about half of that is
# sustained: a copy of L2-resident data on this project's Zen 3 moved 96 GB/s per core (read
# plus write) at about 3.2 GHz, 15 B/cycle read. The lower figure keeps the model honest on
# every core of the class.
L2_BYTES_PER_CYCLE = 16


@dataclass(frozen=True)
class ConvBlock:
    """The register block: `mr` output channels x `yb` output rows x `xb` output columns.

    Two orientations: output columns in the vector lanes (`channels_in_lanes` False: mr
    broadcast weights, yb * ceil(xb / lanes) data vectors), or output channels in the lanes
    (True: mr = a multiple of the lanes, yb * xb broadcast inputs, mr / lanes weight vectors),
    which keeps the lanes full when the output rows are short (7x7, 14x14 feature maps)."""

    mr: int
    yb: int
    xb: int
    lanes: int
    channels_in_lanes: bool = False

    @property
    def vectors(self) -> int:
        """Vector loads per reduction step (the B side of the GEMM micro-kernel)."""
        if self.channels_in_lanes:
            return self.mr // self.lanes
        return self.yb * math.ceil(self.xb / self.lanes)

    @property
    def broadcasts(self) -> int:
        """Broadcast values per reduction step (the A side, `mr` of the GEMM model)."""
        return self.yb * self.xb if self.channels_in_lanes else self.mr


@dataclass(frozen=True)
class ConvWindow:
    """What one output reads: `channels` input channels (per group) x a `kernel` window of
    input rows / columns, `stride` and `dilation` apart (the coefficients of the output and
    kernel positions in the data's row and column index)."""

    channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]


@dataclass(frozen=True)
class ConvShape:
    batch: int
    channels: int      # F, output channels
    height: int        # output height
    width: int         # output width
    dtype: str
    rows_share_data: tuple[int, ...]  # the mr (divisors of F) whose rows read the same data
    window: ConvWindow | None = None  # None: no cache-traffic term in the block choice
    # The output rows run as one axis of positions (`_flat_positions`: height 1, width H x W),
    # where a block of whole vectors need not divide the width (see `position_blocks`).
    positions: bool = False

    @property
    def itemsize(self) -> int:
        """Bytes of one element."""
        return tvm.runtime.DataType(self.dtype).bits // 8

    @property
    def depthwise(self) -> bool:
        """Every output channel reads its own input channels (depthwise, or one output
        channel per group): no register block shares data across channels."""
        return self.rows_share_data == (1,) and self.channels > 1


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def position_blocks(shape: ConvShape, lanes: int, registers: int) -> list[int]:
    """The xb a block may take along the output width: its divisors, and where the rows run as
    one axis of positions (`shape.positions`) any whole number of vectors too. The last tile
    of positions then ends past the last one: `split` gives the block the predicate
    `p < H x W`, which keeps the tail's lanes from computing, reading or writing (whole
    vectors wherever it holds on every lane, `lane_predicates`). The exact blocks of
    784 = 49 x 16 positions (GCN's 15x1 128 -> 21 at 28x28) are 1 or 7 vectors: 3 channels
    x 7 vectors, or 21 x 1; with 3 vectors allowed, 7 channels x 3 vectors (17 tiles, the
    last of 16 positions) read the input window a third as often: 283 -> 258 us, at 56x56
    64 -> 21 493 -> 443 us (Emerald Rapids, 2 cores, one process, alternating)."""
    blocks = _divisors(shape.width)
    if shape.positions:
        blocks += [v * lanes for v in range(1, registers)
                   if v * lanes < shape.width and shape.width % (v * lanes)]
    return sorted(blocks)


def choose_conv_block(isa, shape: ConvShape, caches: gemm.CacheSizes | None = None
                      ) -> ConvBlock:
    """Minimise blocks x cycles per reduction step over exact (mr | F, yb | H, xb | W) blocks
    that fit the register file, in each orientation; a block that wastes lanes (xb < lanes)
    pays for a whole vector. Ties go to more accumulators. xb is at most one vector or a whole
    number of vectors, each its own unrolled vector (`schedule_conv`): LLVM turned a row
    vectorised whole as one odd-width vector (<56 x float>) into scalar code (measured 10-20x
    slower). The orientation is then chosen by lane fill, or by the
    model where it ranks the channel orientation ahead (see below).
    Cycles per step are `gemm.micro_cycles`, or, where the block's reduction does not fit L1
    (`caches`, with `shape.window` known), the time its weight and input lines take to come
    from L2 if that is longer (`streamed_cycles`)."""
    lanes = isa.lanes(shape.dtype)
    candidates = []
    mrs = [d for d in shape.rows_share_data if d <= isa.registers]
    for xb in position_blocks(shape, lanes, isa.registers):
        if xb > lanes and xb % lanes:
            continue  # several vectors: whole ones
        xv = math.ceil(xb / lanes)
        if xv >= isa.registers:
            continue
        for yb in [d for d in _divisors(shape.height) if d <= MAX_Y_BLOCK]:
            # Without channel sharing (depthwise) extra rows add no weight reuse, only
            # independent accumulators: enough to hide the FMA latency and no more (14 live
            # row vectors measured 5x slower than 8 on an AVX-512 core, 7-8 the fastest).
            if shape.depthwise and yb * xv > isa.fma_units * isa.fma_latency:
                continue
            for mr in mrs:
                candidates.append(ConvBlock(mr, yb, xb, lanes))
    if shape.depthwise and not isa.masked and not any(b.xb % lanes == 0 for b in candidates):
        candidates += _narrow_row_blocks(isa, shape)
    # Channels in the lanes: any exact row / column block, mr a multiple of the lanes whose
    # channels all read the same input (not depthwise); two weight vectors at least where
    # such a block fits (one vector per step measured 2x slower in the GEMM kernel), below.
    # With 32 registers, at most half of them accumulators: with 28 (2 weight vectors x 14
    # positions) a 3x3/s2 conv, 128 ch at 28x28, ran at 339 GFLOP/s on an AVX-512 core pair,
    # with 14 (2 x 7) at 453, though the register model ranks the first 9 % faster. (Not
    # measured on 16-register files, where the fit test alone decides, as before.)
    cap = isa.registers // 2 if isa.registers >= 32 else isa.registers
    for mr in [d for d in shape.rows_share_data if d % lanes == 0]:
        for yb in [d for d in _divisors(shape.height) if d <= MAX_Y_BLOCK]:
            for xb in _divisors(shape.width):
                block = ConvBlock(mr, yb, xb, lanes, channels_in_lanes=True)
                if block.broadcasts * block.vectors <= cap:
                    candidates.append(block)
    def best_of(blocks):
        best = None
        for blk in blocks:
            unit = _unit(isa, blk, shape.dtype)
            if not gemm.fits_registers(unit, blk.broadcasts, blk.vectors):
                continue
            if blk.vectors == 1 and blk.broadcasts + 1 + gemm.LOAD_PORTS > unit.registers:
                # One weight vector: every FMA takes its own broadcast, and with fewer free
                # registers than loads per cycle the broadcasts cannot run ahead of the FMAs
                # (8 ch x 14 positions, 16 of 16 registers: 55 GFLOP/s; 8 x 7: 93).
                continue
            count = (shape.channels // blk.mr) * (shape.height // blk.yb) * \
                math.ceil(shape.width / blk.xb)
            # Ties: fewer positions past the end (a position block's tail), then more
            # accumulators.
            key = (count * max(_step_cycles(isa, blk, shape, caches)),
                   -shape.width % blk.xb, -blk.broadcasts * blk.vectors)
            if best is None or key < best[0]:
                best = (key, blk)
        return best

    # Rows in the lanes unless they would leave more than half of each vector empty: with the
    # lanes full either way, the row orientation measured faster (64 ch at 56x56: 120 vs
    # 80 GFLOP/s; 256 ch at 14x14: 140 vs 90), the channel one wins on 7x7 maps (160 vs 57).
    # Without masked vectors (`isa.masked`: AVX2, SSE, NEON) a row block of a partial vector
    # is built lane by lane, so such blocks are used only when no other block exists
    # (depthwise): 512 ch at 14x14 on a Zen core, 7-column rows 21 GFLOP/s, channels 32.
    # One weight vector per step only when no block of two or more fits (88 = 8 x 11
    # channels) or the best of them has too few accumulators to cover the FMA latency: on a
    # 7x7 map with 16 registers two weight vectors allow one position (512 ch on Zen 1: 32 ch
    # x 1 position 46 GFLOP/s, 8 ch x 7 positions 72-78); where they allow enough (256 ch at
    # 14x14: 16 ch x 2 x 2), they measured faster than one vector (78 vs 66).
    # Likewise where the best of them waits on L2 (`streamed_cycles` above its register
    # time): a block of one weight vector and more positions reads fewer lines per FMA
    # (512 ch at 14x14, dilation 2: 8 ch x 1 x 7 positions 132 GFLOP/s, 16 ch x 2 x 2 113).
    min_mr = 2 * lanes if shape.channels >= 2 * lanes else lanes
    channels = best_of([b for b in candidates if b.channels_in_lanes and b.mr >= min_mr])
    if channels is None or \
            channels[1].broadcasts * channels[1].vectors < isa.fma_units * isa.fma_latency or \
            _waits_on_l2(*_step_cycles(isa, channels[1], shape, caches)):
        channels = best_of([b for b in candidates if b.channels_in_lanes])
    row_blocks = [b for b in candidates if not b.channels_in_lanes]
    whole = [b for b in row_blocks if isa.masked or b.xb % b.lanes == 0]
    if whole or channels is not None:  # partial-vector rows only when nothing else fits
        row_blocks = whole
    # One data vector per step makes every FMA wait on its own broadcast weight, as in the
    # GEMM rule (`gemm.register_blocks`): two rows of one vector each where they fit
    # (64 ch at 56x56 on a Zen core: 4 ch x 2 rows 35.5 GFLOP/s, 8 ch x 1 row 30.1).
    row_blocks = [b for b in row_blocks if b.vectors >= 2] or row_blocks
    rows = best_of(row_blocks)
    row_fill = rows[1].xb / (math.ceil(rows[1].xb / rows[1].lanes) * rows[1].lanes) \
        if rows else 0.0
    # Otherwise the model decides: on an AVX-512 core 16-lane rows of 14 (7/8 full) lost to
    # 32 ch x 7 positions by 12-20 % (3x3 convs at 28x28 stride 2, 14x14 dilation 2, 56x56),
    # as the model predicts; on AVX2 the blocks of the measurements above tie in the model.
    better = channels is not None and rows is not None and channels[0][0] < rows[0][0]
    best = channels if channels is not None and (row_fill < 0.5 or better) else rows
    assert best is not None  # mr = yb = xb = 1 always fits
    return best[1]


def streamed_cycles(block: ConvBlock, shape: ConvShape, caches: gemm.CacheSizes | None
                    ) -> Fraction:
    """Cycles per reduction step to bring the block's operands from L2, 0 where they stay in
    L1. Per input channel the block reads kh * kw * mr packed weights and the input lines of
    its window (`_input_lines`). When the whole
    reduction (every channel) needs more than L1, the share that does not fit
    (1 - L1 / working set) streams from L2 at `L2_BYTES_PER_CYCLE`.
    A 2x2-position block of a 3x3 conv with dilation 2 reads 6 rows where a 1x7 block reads
    3: at 512 channels on 14x14 that block measured 113 vs 132 GFLOP/s (Zen 3), which the
    register model alone ranks the other way."""
    window = shape.window
    if window is None or caches is None:
        return Fraction(0)
    kh, kw = window.kernel
    per_channel = kh * kw * block.mr * shape.itemsize + _input_lines(block, shape) * CACHE_LINE
    total = window.channels * per_channel
    if total <= caches.l1:
        return Fraction(0)
    missed = 1 - Fraction(caches.l1) / total
    return missed * per_channel / (kh * kw * L2_BYTES_PER_CYCLE)


def _input_lines(block: ConvBlock, shape: ConvShape) -> Fraction:
    """Cache lines of one input channel that the block's window reads (`shape.window` known):
    the distinct rows y * sy + kh * dy times the lines of each row's span of columns (per
    column phase when strided, as the copy stores them)."""
    window = shape.window
    size = shape.itemsize
    (kh, kw), (sy, sx), (dy, dx) = window.kernel, window.stride, window.dilation
    rows = len({y * sy + r * dy for y in range(block.yb) for r in range(kh)})
    phases: dict[int, list[int]] = {}
    for x in range(block.xb):
        for c in range(kw):
            column = x * sx + c * dx
            phases.setdefault(column % sx, []).append(column // sx)
    # A run of n elements at an element-aligned start covers (n - 1) * size / line + 1 lines
    # on average.
    return rows * sum(Fraction((max(cols) - min(cols)) * size, CACHE_LINE) + 1
                      for cols in phases.values())


def positions_outer(block: ConvBlock, shape: ConvShape, caches: gemm.CacheSizes | None,
                    data_bytes: int, weight_bytes: int) -> bool:
    """Order of the parallel tiles: output positions outer and the channel tiles (F / mr)
    inner, rather than channel tiles outer. Channel tiles outer read each tile's weights once
    and the whole input once per channel tile; positions outer read the input once and all
    weights once per position tile. Positions go outer where that moves fewer bytes from
    beyond L2 (`gemm.beyond_l2`, the GEMM rule's tile order) and one position tile's input
    window, every channel of it, fits L1, so that the channel tiles after the first read it
    from L1. ResNet-18's 64 -> 64 channels at 56x56 (input 841 KiB, 16 channel tiles of 4):
    125-153 -> 167-173 GFLOP/s on a Zen 3 (several runs, old and new alternating in one
    process); GCN's 15x1 128 -> 21 at 28x28, whose tall window (16 rows
    x 128 channels, 144 KiB) does not fit L1, measured 5-20 % slower so and keeps its order."""
    if caches is None or shape.window is None:
        return False
    channel_tiles = shape.channels // block.mr
    position_tiles = shape.batch * (shape.height // block.yb) * math.ceil(shape.width / block.xb)
    window = shape.window.channels * _input_lines(block, shape) * CACHE_LINE
    return window <= caches.l1 and \
        gemm.beyond_l2(caches, data_bytes, weight_bytes, position_tiles) < \
        gemm.beyond_l2(caches, weight_bytes, data_bytes, channel_tiles)


def copy_band(shape: ConvShape, block: ConvBlock, caches: gemm.CacheSizes, cores: int,
              weight_bytes: int, copy_row_bytes: int) -> int | None:
    """Row tiles per band when the padded input copy is made band by band, or None.

    The copy of the whole input (step 2), made in one pass before the kernel, goes through
    memory: beyond L2 it is written out and read back, and read by another core than the one
    that copied it. Made per band of output rows inside the parallel loop, each core copies
    the rows its band reads (the band plus the window's halo, every input channel) into a
    buffer that stays in its L2, and its position tiles, every channel tile of them, read it
    there. Measured on GCN's 21-channel convolutions (Emerald Rapids, 2 cores, one process,
    alternating): 3x3 at 224x224 1398-1440 -> 1276-1314 us, at 112x112 363 -> 326 us, 1x15
    64 -> 21 at 56x56 531 -> 492 us, 1x15 128 -> 21 at 28x28 301 -> 249 us.
    The bands run every channel tile, so the weights must fit in L2 (each band reads them
    all again: those that the band's copy pushed out come from L3; with weights of 1.2 MiB
    beside copies of up to 1 MiB in a 2 MiB L2, ResNet-18's 3x3/s2 128 -> 256 at 28x28 still
    went 438 -> 396 us banded, CSRNet's 3x3 256 -> 128 at 14x14, dilation 2, 388 -> 381 us;
    one process, alternating. The limit had been half of L2.); a band's
    copy (its output rows' input rows, `window.stride` apart, plus the window's halo) takes
    at most half of L2; the bands divide among the cores evenly, TILES_PER_CORE or
    more each (7 bands on 2 cores measured 14 % slower than 14). The largest such band
    copies the fewest halo rows twice."""
    window = shape.window
    if window is None or weight_bytes > caches.l2:
        return None
    halo = (window.kernel[0] - 1) * window.dilation[0]
    tiles = shape.height // block.yb
    fits = [t for t in range(1, tiles + 1) if tiles % t == 0
            and (shape.batch * tiles // t) % cores == 0
            and shape.batch * tiles // t >= gemm.TILES_PER_CORE * cores
            and ((t * block.yb - 1) * window.stride[0] + halo + 1) * copy_row_bytes
            <= caches.l2 // 2]
    return max(fits, default=None)


# How each core gets the padded input of a convolution whose rows run as one axis of positions
# (`core_copy`): its own copy of the rows its positions read, or of the whole input.
PART, WHOLE = "part", "whole"


def core_copy(caches: gemm.CacheSizes | None, whole: int, part: int | None,
              weight_bytes: int) -> str | None:
    """How the cores copy the padded input where its rows run as one axis of positions (GCN's
    15x1 convolutions; rows are not cut into bands there, `copy_band`): PART, WHOLE, or None
    for one copy shared by the cores.

    One copy made in parallel over channels is written half by each core and then read whole
    by both: at every call each core's writes invalidate the lines the other read in the last
    one (GCN's 15x1 128 -> 21 at 28x28: the copy took 56 us on two cores, 20 us on one). A
    copy per core, made before its share of the tiles, stays in its own L2. PART: the
    positions split into whole vectors per core (`part`: the bytes of the rows one core's
    positions read, with the window's halo; None where they do not split so, or where the
    block holds channels in its lanes), and each core copies those rows; else WHOLE: each
    core copies the whole input (`whole` bytes). Either only where that copy and the weights
    fit half of L2 (Emerald Rapids, 2 cores, one process, alternating: 128 -> 21 at 28x28,
    49 vectors of positions, WHOLE copies of 602 KiB: 258-263 -> 213-217 us; 21 -> 21 at
    28x28 60 -> 41 us; 64 -> 21 at 56x56, a 0.96 MiB copy, PART: 440-457 -> 414-418 us,
    where WHOLE had measured no gain)."""
    if caches is None:
        return None
    for mode, size in ((PART, part), (WHOLE, whole)):
        if size is not None and size + weight_bytes <= caches.l2 // 2:
            return mode
    return None


def _step_cycles(isa, block: ConvBlock, shape: ConvShape, caches: gemm.CacheSizes | None
                 ) -> tuple[Fraction, Fraction]:
    """(register-model cycles, L2-streaming cycles) of one reduction step of `block`."""
    unit = _unit(isa, block, shape.dtype)
    return (gemm.micro_cycles(unit, block.broadcasts, block.vectors),
            streamed_cycles(block, shape, caches))


def _waits_on_l2(register: Fraction, streamed: Fraction) -> bool:
    return streamed > register


def _unit(isa, block: ConvBlock, dtype: str):
    """The vector unit as `block` uses it: full width, or narrowed to its lanes."""
    if block.lanes == isa.lanes(dtype):
        return isa
    return isa.narrowed(block.lanes * tvm.runtime.DataType(dtype).bits)


def _narrow_row_blocks(isa, shape: ConvShape) -> list:
    """Depthwise row blocks of one narrower whole vector, for rows no full vector divides:
    the low half of a register (128-bit <4 x float> on AVX2) is a legal vector that LLVM loads
    in one instruction, where a 7-lane block of a 256-bit one is assembled lane by lane
    (192 ch at 28x28 on a Zen 1 core, whose pipes are 128 bits wide: 105 -> 75 us)."""
    blocks = []
    bits = isa.bits // 2
    while bits >= 128:
        unit = isa.narrowed(bits)
        lanes = unit.lanes(shape.dtype)
        if lanes > 1 and shape.width % lanes == 0:
            for yb in [d for d in _divisors(shape.height) if d <= MAX_Y_BLOCK]:
                if yb <= unit.fma_units * unit.fma_latency:
                    blocks.append(ConvBlock(1, yb, lanes, lanes))
        bits //= 2
    return blocks


def _vars(expr) -> set:
    return set(tirx.analysis.undefined_vars(expr))


class Conv2D(gemm.AnalyticRule):
    """dlight-style rule for NCHW conv2d / conv2d_transpose: a Schedule or None."""

    @staticmethod
    def schedule(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        return schedule_conv(func, target)


def _match(sch: s_tir.Schedule, block) -> tuple[int, int, ConvShape] | None:
    """(data read index, weight read index, shape) if `block` is an NCHW convolution."""
    stmt = sch.get(block)
    ivs = list(stmt.iter_vars)
    if len(stmt.reads) != 2 or len(stmt.writes) != 1 or len(ivs) < 5:
        return None
    spatial, reduce = ivs[:4], ivs[4:]
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in spatial) or any(
            iv.iter_type != tirx.IterVar.CommReduce for iv in reduce):
        return None
    if any(gemm._static(iv.dom.extent) is None for iv in ivs):
        return None
    if sum(int(iv.dom.extent) > 1 for iv in reduce) <= 1:
        # Pointwise (1x1) convolution: a plain GEMM over channels; the GEMM rule's panels
        # measured 2x faster on 256 -> 64 channels at 56x56, so leave it to that rule.
        return None
    out = stmt.writes[0].region
    if len(out) != 4 or any(gemm._static(r.extent) != 1 for r in out) or not all(
            r.min.same_as(iv.var) for r, iv in zip(out, spatial)):
        return None
    f_var, x_var = spatial[1].var, spatial[3].var
    roles = {}
    for index, region in enumerate(stmt.reads):
        used = set().union(*(_vars(r.min) for r in region.region))
        if x_var in used:
            roles["data"] = index
        elif f_var in used:
            roles["weight"] = index
    if set(roles) != {"data", "weight"}:
        return None
    n, f, h, w = (int(iv.dom.extent) for iv in spatial)
    dtype = str(stmt.writes[0].source.dtype)
    if not dtype.startswith("float"):
        return None
    data_index = [r.min for r in stmt.reads[roles["data"]].region]
    shared = tuple(mr for mr in _divisors(f) if _rows_share(data_index, f_var, f, mr))
    window = _window(data_index, spatial, reduce)
    return roles["data"], roles["weight"], ConvShape(n, f, h, w, dtype, shared, window)


def _window(data_index, spatial, reduce) -> ConvWindow | None:
    """The input window of one output, read off the data's last two indices (rows, columns):
    one reduced iterator in each (the kernel row / column, their coefficients the dilation),
    the output row / column coefficients the stride; the other reduced iterators are the input
    channels. None for any other form (the block choice then goes without it)."""
    if len(data_index) < 2:
        return None
    row, col = data_index[-2], data_index[-1]
    row_vars, col_vars = _vars(row), _vars(col)
    kernel, dilation, channels = [], [], 1
    for index, index_vars in ((row, row_vars), (col, col_vars)):
        used = [iv for iv in reduce if iv.var in index_vars]
        if len(used) != 1:
            return None
        kernel.append(int(used[0].dom.extent))
        dilation.append(_coefficient(index, used[0].var))
    for iv in reduce:
        if iv.var not in row_vars and iv.var not in col_vars:
            channels *= int(iv.dom.extent)
    stride = (_coefficient(row, spatial[2].var), _coefficient(col, spatial[3].var))
    if min(*stride, *dilation) < 1:
        return None
    return ConvWindow(channels, tuple(kernel), stride, tuple(dilation))


def _rows_share(indices, f_var, channels: int, mr: int) -> bool:
    """Whether the data index is the same for the mr channels of a block: with f = q*mr + r
    (0 <= r < mr), r must simplify away (grouped convolution: mr divides the group size;
    depthwise: only mr = 1)."""
    q = tirx.Var("q", f_var.ty)
    r = tirx.Var("r", f_var.ty)
    analyzer = Analyzer()
    analyzer.bind(q, ir.Range(0, channels // mr))
    analyzer.bind(r, ir.Range(0, mr))
    analyzer.bind(f_var, q * mr + r)  # simplify() substitutes a variable bound to an expression
    return all(r not in _vars(analyzer.simplify(i)) for i in indices)


def _coefficient(index, var) -> int:
    """The coefficient of `var` in `index`: the index at var = 1 minus the index at var = 0,
    every other variable at 0; 0 where that does not simplify to constants."""
    values = []
    for x in (0, 1):
        analyzer = Analyzer()
        for v in _vars(index):
            analyzer.bind(v, tirx.const(x if v.same_as(var) else 0, str(v.ty.dtype)))
        value = analyzer.simplify(index)
        if not isinstance(value, tirx.IntImm):
            return 0
        values.append(int(value))
    return values[1] - values[0]


def _column_stride(index, x_var) -> int:
    """The coefficient of the output column `x_var` in the data's last index (the stride)."""
    return max(1, _coefficient(index, x_var))


def _vectorize_copy(sch: s_tir.Schedule, producer, target: Target) -> None:
    """Vectorise the padded input copy along its rows (`injective.vectorize_segments`: the
    row loop is cut around the positions where the padding condition changes, the row's
    edges, so that only those run scalar)."""
    params = injective.cpu_params(target)
    lanes = params.lanes(str(sch.get(producer).writes[0].source.dtype))
    injective.vectorize_segments(sch, producer, sch.get_loops(producer)[-1], lanes, params)


def _flat_positions(sch: s_tir.Schedule, conv, data_index: int, shape: ConvShape,
                    lanes: int) -> bool:
    """Whether the output rows can run as one axis of positions p = y * W + x: kernel width 1
    and stride 1 in both directions, and data rows (after padding) as wide as the output
    rows, so the data is read at column x and row y + ky * dilation, i.e. position p reads
    element p + ky * dilation * W of its channel: contiguous across the ends of output rows.
    Vectors of positions then fill every lane where rows alone do not (GCN's 15x1
    convolutions: 56-wide rows fill 14 of 16 lanes, 56 x 56 positions are 196 vectors)."""
    window = shape.window
    if window is None or window.kernel[1] != 1 or tuple(window.stride) != (1, 1):
        return False
    data = sch.get(conv).reads[data_index].source
    if len(data.shape) != 4 or gemm._static(data.shape[-1]) != shape.width:
        return False
    # Only where it fills lanes the rows leave empty (a 14x14 map is 196 positions, no
    # whole vector either; 112-wide rows are whole vectors already, and measured 4 % slower
    # as positions).
    return shape.width % lanes != 0 and shape.height * shape.width % lanes == 0


def _producers_of(sch, block, buffer) -> list:
    return [p for p in sch.get_producers(block)
            if any(w.source.same_as(buffer) for w in sch.get(p).writes)]


def _inline_chain(sch, block, buffer) -> None:
    """Inline every producer (recursively) of `buffer` read by `block`."""
    for producer in _producers_of(sch, block, buffer):
        gemm._inline_producers(sch, producer)
        sch.compute_inline(producer)


def schedule_conv(func: tirx.PrimFunc, target: Target, block: ConvBlock | None = None
                  ) -> s_tir.Schedule | None:
    """Schedule an NCHW convolution (see the module docstring); None if `func` is not one.
    `block` overrides the analytic register block (tests)."""
    sch = s_tir.Schedule(func)
    conv = gemm.find_gemm_block(sch)
    if conv is None:
        return None
    found = _match(sch, conv)
    if found is None:
        return None
    data_index, weight_index, shape = found
    width = shape.width
    isa = vector_isa(target)
    flat = _flat_positions(sch, conv, data_index, shape, isa.lanes(shape.dtype))
    if flat:
        shape = replace(shape, height=1, width=shape.height * shape.width, positions=True)
    caches = gemm.cache_sizes(target)
    block = block or choose_conv_block(isa, shape, caches)
    mr = block.mr

    # 1. Weights: inline the flip etc., reindex to [f, c, kh, kw], pack [F/mr, c, kh, kw, mr].
    _inline_chain(sch, conv, sch.get(conv).reads[weight_index].source)
    pack = sch.reindex(conv, ("read", weight_index))
    n_axes = len(sch.get(pack).writes[0].region)  # f first (block order), then c, kh, kw
    sch.transform_layout(pack, ("write", 0), tirx.IndexMap.from_func(
        lambda *i: (i[0] // mr, *i[1:], i[0] % mr), ndim=n_axes))
    if gemm._reads_only_layout_free(sch, pack, func):
        sch.annotate(pack, gemm.LAYOUT_REWRITE_ATTR, True)
    pack_loops = sch.get_loops(pack)
    sch.parallel(pack_loops[0])

    # 2. Data: producers of the padded input fold into one materialised copy. With a column
    # stride s the copy is split into s column phases, [.., W/s, s] -> [.., s, W/s]
    # (x*s + kx lands in phase kx % s at column x + kx // s), so the kernel's row of outputs
    # reads contiguous vectors instead of a stride-s gather.
    stmt = sch.get(conv)
    data_buf = stmt.reads[data_index].source
    stride = _column_stride(stmt.reads[data_index].region[-1].min,
                            stmt.iter_vars[3].var)
    producers = _producers_of(sch, conv, data_buf)
    if stride > 1 and not producers:
        producers = [sch.cache_read(conv, data_index, "global")]
    for producer in producers:
        gemm._inline_producers(sch, producer)
        if stride > 1:
            phases = tirx.IndexMap.from_func(
                lambda *i: (*i[:-1], i[-1] % stride, i[-1] // stride),
                ndim=len(sch.get(producer).writes[0].region))
            sch.transform_layout(producer, ("write", 0), phases, pad_value=0.0)
            try:  # iterate in the order the copy writes: contiguous stores, strided loads
                sch.transform_block_layout(producer, phases)
            except s_tir.ScheduleError:  # odd width: the phases are padded, not a bijection
                pass

    # 3. Tiles and register block (output rows as one axis of positions where `flat`).
    cores = gemm.target_cores(target)
    weight_bytes = buffer_bytes(sch.get(conv).reads[weight_index].source)
    copy_mode = None
    if flat and len(producers) == 1 and not shape.depthwise:  # (depthwise: copied per channel)
        copy = sch.get(producers[0]).writes[0].source  # [n, c, rows, columns]
        part_bytes = None  # one core's positions (whole vectors): its rows, one more, halo
        if not block.channels_in_lanes and shape.width % (cores * block.lanes) == 0:
            rows = int(copy.shape[2])
            part_bytes = buffer_bytes(copy) // (shape.batch * rows) * (
                math.ceil(shape.width // cores / width) + 1 + rows - shape.width // width)
        copy_mode = core_copy(caches, buffer_bytes(copy), part_bytes, weight_bytes)
    part = shape.width // cores  # PART: positions per core

    def core_and_q(y_, x_):  # PART: position p = y * W + x = core * part + q
        return (y_ * width + x_) // part, (y_ * width + x_) % part

    if copy_mode == PART:
        # The block's own iterators become (n, f, core, q, reduction...): the core's part of
        # whole vectors in place of the output rows. As block iterators (not a split of p)
        # they bound each tile's write-back by the part: a ragged last tile of one core's
        # part, written back under p < H x W alone, had overwritten the next core's first
        # positions with values it never computed (measured wrong, at random).
        sch.transform_block_layout(conv, tirx.IndexMap.from_func(
            lambda n_, f_, y_, x_, *r: (n_, f_, *core_and_q(y_, x_), *r),
            ndim=len(sch.get(conv).iter_vars)))
    elif flat:  # the block's own iterators become (n, f, p, reduction...), p = y * W + x
        sch.transform_block_layout(conv, tirx.IndexMap.from_func(
            lambda n_, f_, y_, x_, *r: (n_, f_, y_ * width + x_, *r),
            ndim=len(sch.get(conv).iter_vars)))
        sch.split(sch.get_loops(conv)[2], [1, None])
    loops = sch.get_loops(conv)
    n, f, y, x, reduction = loops[0], loops[1], loops[2], loops[3], loops[4:]
    y_tile, y_reg = sch.split(y, [None, block.yb])  # PART: y_tile is the core's part
    x_tile, x_reg = sch.split(x, [None, block.xb])
    if block.channels_in_lanes:
        f_tile, f_vec, f_lane = sch.split(f, [None, mr // block.lanes, block.lanes])
        sch.reorder(n, f_tile, y_tile, x_tile, *reduction, y_reg, x_reg, f_vec, f_lane)
        unrolled, lane = (y_reg, x_reg, f_vec), f_lane
    else:
        f_tile, f_reg = sch.split(f, [None, mr])
        tiles = (n, y_tile, f_tile) if copy_mode == PART else (n, f_tile, y_tile)
        sch.reorder(*tiles, x_tile, *reduction, f_reg, y_reg, x_reg)
        unrolled, lane = (f_reg, y_reg), x_reg
        if block.xb > block.lanes:  # several vectors per row: each one unrolled
            x_vec, lane = sch.split(x_reg, [None, block.lanes])
            unrolled = (f_reg, y_reg, x_vec)
    staging = None
    by_panel = False  # whether the parallel tiles run weight panel by weight panel
    if flat:
        # Positions as one index of a staging copy of the output: a tile of positions that
        # crosses the end of an output row writes back exactly its positions (by (row,
        # column) its region's bounding box spans whole rows, and TVM's write-back copied
        # the neighbouring tiles' positions from an accumulator that never held them:
        # measured wrong). One pass then copies the staging buffer into the output, with
        # the epilogue.
        staging = sch.cache_write(conv, 0, "global")
        if copy_mode == PART:  # [n, f, core, q] as the block's iterators
            sch.transform_layout(conv, ("write", 0),
                                 lambda n_, f_, y_, x_: (n_, f_, *core_and_q(y_, x_)))
        else:
            sch.transform_layout(conv, ("write", 0),
                                 lambda n_, f_, y_, x_: (n_, f_, y_ * width + x_))
    accumulator = sch.cache_write(conv, 0, gemm.accumulator_scope(
        block.mr * block.yb * block.xb, shape.dtype))
    if block.channels_in_lanes:  # the accumulator keeps channels innermost, like its lanes
        sch.transform_layout(conv, ("write", 0), (lambda n_, f_, p_: (n_, p_, f_)) if flat
                             else (lambda n_, f_, y_, x_: (n_, y_, x_, f_)))
    if shape.depthwise and len(producers) == 1 and shape.batch * shape.channels >= 2 * cores:
        # Each channel reads only its own plane: pad it inside the channel's parallel
        # iteration, where the copy stays in L1 for the kernel, instead of one padded
        # copy of the whole input through L2 (measured ~40 % of a depthwise kernel's time).
        channel = sch.fuse(n, f_tile)
        tile = sch.fuse(y_tile, x_tile)
        sch.compute_at(producers[0], channel, preserve_unit_loops=True)
        sch.parallel(channel)
        _vectorize_copy(sch, producers[0], target)
    else:
        data_bytes = buffer_bytes(sch.get(conv).reads[data_index].source)
        band = None
        if not flat and len(producers) == 1:
            copy = sch.get(producers[0]).writes[0].source  # [n, c, rows, (phases,) columns]
            band = copy_band(shape, block, caches, cores, weight_bytes,
                             buffer_bytes(copy) // int(copy.shape[2]))
        if band is not None:
            # Row bands of the output, each core copying the padded rows its band reads
            # into a buffer that stays in its L2 (`copy_band`), then all its tiles.
            bands, y_in = sch.split(y_tile, [None, band])
            sch.reorder(n, bands, y_in, x_tile, f_tile)
            outer = sch.fuse(n, bands)
            sch.parallel(outer)
            tile = sch.fuse(y_in, x_tile, f_tile)
            sch.compute_at(producers[0], outer, preserve_unit_loops=True)
            _vectorize_copy(sch, producers[0], target)
        elif copy_mode is not None:
            # A copy of the padded input per core (`core_copy`), made before the core's share
            # of the tiles: the rows its positions read (PART), or all (WHOLE; the tiles in
            # weight-panel order, split into one contiguous share per core; no prefetch of
            # the next panel: the weights fit half of L2 here).
            if copy_mode == PART:
                outer, tile = sch.fuse(n, y_tile), sch.fuse(f_tile, x_tile)
            else:
                tiles = (n, f_tile, y_tile, x_tile)
                sch.reorder(*tiles)
                outer, tile = sch.split(sch.fuse(*tiles), [cores, None])
            sch.parallel(outer)
            sch.compute_at(producers[0], outer, preserve_unit_loops=True)
            _vectorize_copy(sch, producers[0], target)
        else:
            if positions_outer(block, shape, caches, data_bytes, weight_bytes):
                tiles = (n, y_tile, x_tile, f_tile)
            else:
                tiles = (n, f_tile, y_tile, x_tile)
                by_panel = True
            sch.reorder(*tiles)
            tile = sch.fuse(*tiles)
            sch.parallel(tile)
            for producer in producers:  # one copy of the whole input, parallel over channels
                sch.parallel(sch.fuse(*sch.get_loops(producer)[:2]))
                _vectorize_copy(sch, producer, target)
    sch.reverse_compute_at(accumulator, tile, preserve_unit_loops=True)
    if staging is None:
        gemm._inline_consumers(sch, accumulator)
        gemm.schedule_leftover_consumers(sch, accumulator, target)
    else:
        if copy_mode == PART:  # tiles placed: flat positions again, for the copy-out's rows
            sch.transform_layout(accumulator, ("write", 0),
                                 lambda n_, f_, c_, q_: (n_, f_, c_ * part + q_))
        gemm._inline_consumers(sch, staging)
        gemm.schedule_leftover_consumers(sch, staging, target)
        injective.schedule_spatial_block(sch, staging, injective.cpu_params(target))
    for loop in unrolled:
        sch.unroll(loop)
    sch.vectorize(lane)
    write_back = sch.get_loops(accumulator)[-1]  # along output rows (or channels in lanes)
    if block.xb > block.lanes and not block.channels_in_lanes:
        write_back = sch.split(write_back, [None, block.lanes])[1]
    sch.vectorize(write_back)
    init = sch.decompose_reduction(conv, reduction[0])
    sch.vectorize(sch.get_loops(init)[-1])
    count = shape.channels // mr  # weight panels
    if by_panel and count > 1 and prefetch_fits(weight_bytes // count, weight_bytes, caches):
        # Each panel's first tile would fetch the whole panel at once (`prefetch`).
        per_panel = int(sch.get(tile).extent) // (shape.batch * count)
        following, share = next_panel_of_tile(sch.get(tile).loop_var, per_panel, count)
        sch = hinted_schedule(sch, prefetch_next_panel(
            sch.mod["main"], sch.get(reduction[0]).loop_var, sch.get(pack).writes[0].source,
            [following], share, per_panel))
    return sch
