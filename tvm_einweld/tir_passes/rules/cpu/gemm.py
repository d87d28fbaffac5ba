"""Analytic CPU schedule for the GEMM class: matmul, dense/linear, batch matmul, + epilogues.

What it matches
---------------
A PrimFunc (as Relax's LegalizeOps + FuseOps + FuseTIR produce it) with exactly one reduction
block whose accesses have the einsum form `C[S, I, J] += A[S, I, K] * B[S, J, K]` after the
iterators are classified (dlight's `detect_iter_traits`: S = batch axes read by A, B and C;
I = axes of A and C; J = axes of B and C; K = reduced axes of A and B). Several axes of a kind
are fused into one, so broadcast batches (an axis only A and C have) simply join I, and a
transposed B (`linear`, `permute_dims` + matmul) is just a different access order of B.
M = 1 keeps I empty; N = 1 (a matrix times a column vector) swaps the operands, C^T = B^T A^T,
so the matrix rows fill the vector lanes, when the matrix is a weight (packed at compile
time); a matrix computed at run time stays A, read in place, against the vector padded to one
register (`analyse`). A dot product (M = N = 1) is not matched.
All other blocks must be spatial: producers are inlined, consumers (bias add, relu, clip,
residual add, ...) are inlined into the write-back of the output tile. Shapes must be static.

The schedule (BLIS-like, one register block per micro-kernel)
--------------------------------------------------------------
1. Normalise: `reindex` A, B and C into buffers in [S, I, K] / [S, J, K] / [S, I, J] order and
   `transform_block_layout` the reduction block to iterate (S, I, J, K) (as dlight's GPU matmul).
2. Pad: `pad_einsum` pads I to a multiple of `mr` and J to a multiple of `nr` (cropped
   write-back of C; B's padding is zero-filled in its pack; A is read in place, its padded
   rows clamped to its last row, `clamp_padded_rows`, unless its elements are gathered or
   strided along K and so copied), so the micro-kernel never needs a predicate. A constant
   A (weights on the left: an NCHW pointwise convolution, a Winograd form's batched matmul)
   is packed at compile time into row panels [S, I/mr, K, mr], zero-padded there: one
   contiguous stream of broadcasts instead of mr rows K apart (CSRNet's Winograd F(4, 3)
   matmul 36 x (256 x 512 . 512 x 16), 18.9 MB of weights streamed from beyond L2: 801 ->
   698 us; pointwise convolutions within 2 %; Emerald Rapids, one process, alternating).
3. Pack B into panels [S, J/nr, K, nr] (`transform_layout` of B's reindex/pad block): the
   micro-kernel then reads one contiguous vector stream. A run-time B already laid out with
   J innermost and needing no padding is read where it lies instead (`b_in_place`: its
   reindex block inlined, no pass over B at every call), unless its rows would thrash L1
   (`_panel_thrashes`); the plan charges a block whose panels do not divide N for the pack
   it forces (`B_PACK_CYCLES`). When B is a compile-time weight
   (listed in the PrimFunc's `layout_free_buffers`, see `AttachAttrLayoutFreeBuffers`) the
   pack block is annotated `meta_schedule.layout_rewrite_preproc`, which is the hook stock
   TVM's `SplitLayoutRewritePreproc` + `LiftTransformParams` / `FoldConstant` use to move the
   packing out of the inference function (see `apply.py`).
4. Tile: (S, I/mc, J/nr) fused and parallel; inside one tile the mr x nr register blocks
   (rows unrolled, columns unrolled x vectorised by the ISA's lanes) accumulate into a
   `local` cache-write buffer that LLVM keeps in vector registers over the k loop. With K
   whole, that buffer is one register block, written back (with the fused epilogue) right
   after its k loop; with K split by `kc`, it is the tile's mc x nr accumulator, written back
   once after the last K block. Where C's rows alias in L1 a tile spans several column
   panels, each row block running along them (`_panels_per_tile`).
5. Prefetch (K whole, B too large to stay in L2 from call to call): each tile prefetches the
   panels of the tile its core runs next over its row blocks and k steps (`prefetch`, where
   the measurements are), so that the first row block of the next tile does not wait for
   its panels from DRAM.

Why it is correct: every step is a TensorIR schedule primitive (reindex, transform_layout,
pad_einsum, split/reorder/fuse, cache_write, compute_inline, reverse_compute_at, parallel,
vectorize, unroll, decompose_reduction); each primitive checks its own preconditions and
preserves the function's semantics, and a primitive that refuses makes the rule return None
(the function stays unscheduled and correct). Padded rows/columns are computed (from zeros,
or for A's rows from its last row) and never written back (pad_einsum's crop). The parallel
loop only spans spatial axes, so no two threads touch the same output element. Two rewrites
are not primitives and argue for themselves: step 5 adds only prefetch hints, which change no
value (see `prefetch`), and `clamp_padded_rows` changes only values that are discarded.

Sizing (all from the target and the device model, nothing from a particular CPU):
`choose_tiling` picks (mr, nr) and the tiles together, minimising a cycle model of the padded
problem (FMA throughput, load ports, FMA latency over independent accumulators, see
`micro_cycles`) under the register budget; `choose_tiles` keeps K whole while a K x nr panel
of B fits in half of L2 (the accumulator then never leaves the registers), else blocks it for
L1, and sizes `mc` for L2 while leaving enough parallel tiles for the cores (M padded to whole
row tiles) and orders the tiles to move fewer bytes from beyond L2. Cache sizes come from sysfs
(`machine.cache_sizes`) when the target is this host, else from the `DEFAULT_CACHES` table.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import numpy as np
import tvm
from tvm import ir, s_tir, tirx
from tvm.sym import Analyzer, detect_linear_equation
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.gpu.matmul import IterKind, IterTrait, make_iter_fusion_index_map
from tvm.target import Target, codegen
from tvm_ffi import structural_map

from .fast_math import ExprRewriter
from .isa import VectorISA, vector_isa
from .prefetch import (hinted_schedule, next_panel_of_tile, prefetch_fits,
                       prefetch_next_panel)

# (schedule, block) -> the block's SBlockRealize (its predicate and iter values); the one
# lookup of it for the CPU rules and the Welder code generator.
get_sblock_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")

# Vector load ports per core (how many vector loads, broadcasts included, issue per cycle).
# Not exposed by LLVM; two is the figure for every AVX2 / AVX-512 / NEON core of the last decade
# (newer cores have three, which only makes the load side of the model pessimistic).
LOAD_PORTS = 2

# Per-core data-cache sizes for targets that are not this host (cross compilation), by vector
# width of the target's ISA: (L1 data bytes, L2 bytes). Conservative figures of the smallest
# common core of each class, so that blocks chosen from them fit everywhere.
#   512-bit (Skylake-SP .. Sapphire Rapids, Zen 4/5): 32-48 KiB L1d, 1-2 MiB L2
#   256-bit (Haswell .. Alder Lake, Zen 2/3):          32-48 KiB L1d, 256 KiB-1.25 MiB L2
#   128-bit (generic x86-64, NEON Cortex-A7x/Neoverse): 32-64 KiB L1d, 256 KiB-1 MiB L2
DEFAULT_CACHES = {
    512: (32 * 1024, 1024 * 1024),
    256: (32 * 1024, 256 * 1024),
    128: (32 * 1024, 256 * 1024),
}

# L1 associativity where the target is not this host (or sysfs does not say): 8 ways, the
# fewest of the cores above (Skylake, Zen 1-4; 12 on Golden Cove and Zen 5).
DEFAULT_L1_WAYS = 8

# Core-cycles charged per element of A (and k step) when a plan pads M. It was the cost of a
# zero-padded copy of A made at every call, measured as the gap between a padded plan and an
# unpadded one of the same micro-kernel speed: NeRF's 4096x256 . 256x256 with 14 x 2 blocks
# (M padded to 4116, A copied at every call) 1892 us, the unpadded problem (M = 4116) 1735
# us, 4096 x 256 elements on 2 cores at ~3 GHz: 0.9 cycles an element (Emerald Rapids; one
# process, alternating). A's padded rows are now read in place (`clamp_padded_rows`), so no
# copy is made; the charge stays because the plans it keeps from padding M measured no
# faster without the copy either: unpadded 8 x 2 blocks took 1719 us against those 1735 us,
# where the cycle model ranks 14 x 2 about 7 % faster (it ranks tall blocks a few % too
# high). It keeps the plans of sessions 33-35 (NeRF 17.1 -> 15.7 ms, BERT 6.58 -> 6.17 when
# it was raised from 1/2); shapes that must pad (M = 197) gain the copy's time.
PAD_COPY_CYCLES = Fraction(1)

# Core-cycles charged per element of a run-time B that a plan packs at every call because its
# panel width does not divide N, where a block whose width divides N reads B in place
# (`choose_tiling`, `b_in_place`). The pack is cheaper per element than A's padded copy above
# and gives contiguous panels in return: NAFNet's 1x1 32 -> 32 at 128x128 (a 2 MiB B, K = 32)
# packed for 8 x 3 blocks took 177-192 us, read in place by 8 x 2 136-143 us (about 0.35
# cycles an element); MobileNetV2's 1x1 144 -> 32 at 28x28, 8 x 2 blocks with B packed to
# 800 columns, 32.6 us, against 2 x 7 blocks reading it in place (112 columns divide 784),
# 36.6 us, which a charge above 0.3 cycles an element ranks first (Emerald Rapids, 2 cores,
# one process, alternating). A panel packed because it would thrash L1 (`_panel_thrashes`)
# is not charged: rare, and that pack pays for itself.
B_PACK_CYCLES = Fraction(1, 4)

# Smallest K block worth splitting to: the accumulator tile is reloaded once per block.
MIN_KC = 128

# The function attribute by which the graph asks for rows per core (`rows_per_core`); set
# by `ApplyCPURules` from `affinity.rows_per_core_hints`.
ROWS_PER_CORE_ATTR = "einweld.rows_per_core"

# How many parallel tiles per core the tiling aims for (load balance between threads).
TILES_PER_CORE = 4

# Addresses this many bytes apart share an L1 set: 64 sets of 64-byte lines on every x86 core
# of the last decade and on Arm's Cortex/Neoverse (32 KiB 8-way, 48 KiB 12-way, 64 KiB 16-way).
L1_SET_PERIOD = 4096

LAYOUT_REWRITE_ATTR = "meta_schedule.layout_rewrite_preproc"


@dataclass(frozen=True)
class RegisterBlock:
    """The micro-kernel: `mr` rows x `nr` = `vectors` * `lanes` columns of C in registers."""

    mr: int
    vectors: int
    lanes: int

    @property
    def nr(self) -> int:
        return self.vectors * self.lanes


@dataclass(frozen=True)
class Tiling:
    """A full GEMM plan: the register block plus the cache blocks `mc` (rows of a parallel
    tile, a multiple of mr) and `kc` (reduction block, K itself when not split);
    `columns_outer` orders the parallel tiles column panel first (see `_columns_outer`);
    `panels` column panels make one parallel tile, each register-block row running along all
    of them before the next row (see `_panels_per_tile`)."""

    block: RegisterBlock
    mc: int
    kc: int
    columns_outer: bool = False
    panels: int = 1


@dataclass(frozen=True)
class RowEpilogue:
    """Blocks after the GEMM that reduce its output's rows (`gemm_rows`): `names` are left
    unfolded, and `join(schedule, tile)` schedules them and merges them into the (serial,
    whole-row) tile loop, returning the loop to parallelise."""

    names: frozenset
    join: Callable[[s_tir.Schedule, s_tir.schedule.LoopRV], s_tir.schedule.LoopRV]


@dataclass(frozen=True)
class CacheSizes:
    """Per-core data-cache capacities in bytes, and the L1's associativity."""

    l1: int
    l2: int
    l1_ways: int = DEFAULT_L1_WAYS


# ------------------------------------------------------------------------------ sizing
def micro_cycles(isa: VectorISA, mr: int, vectors: int) -> Fraction:
    """Modelled cycles per k step of an mr x vectors micro-kernel.

    The bound is the larger of FMA throughput, load issue (mr broadcasts of A + `vectors`
    loads of B) and the FMA latency when there are fewer independent accumulators than
    fma_units * fma_latency. On top of it, the B loads and the loop step do not overlap
    perfectly with the FMAs: (vectors + 1) / LOAD_PORTS cycles. That additive term is the form
    that fits a hand-written C micro-kernel on an AVX-512 core within 3 % for 4x4 .. 14x2
    blocks (4x4: 74 %, 8x2: 83 %, 12x2: 89 %, 14x2: 92 % of the FMA peak); it is what makes
    tall blocks with few B vectors win when the register file allows them."""
    fmas = mr * vectors
    bound = max(Fraction(fmas, isa.fma_units), Fraction(mr + vectors, LOAD_PORTS),
                Fraction(isa.fma_latency))
    return bound + Fraction(vectors + 1, LOAD_PORTS)


def fits_registers(isa: VectorISA, mr: int, vectors: int) -> bool:
    """mr * vectors accumulators + `vectors` loaded B vectors + 1 broadcast fit the file."""
    return mr * vectors + vectors + 1 <= isa.registers


def register_blocks(isa: VectorISA, dtype: str, m: int, n: int) -> list[RegisterBlock]:
    """The (mr, vectors) blocks worth costing for an m x n product: within the register
    budget (mr * vectors accumulators + `vectors` B vectors + 1 broadcast), no whole vector of
    padding, and a single B vector only when N fits in one vector (with one B vector every FMA
    waits on its own broadcast of A: measured 2x slower than the model)."""
    lanes = isa.lanes(dtype)
    min_vectors = 1 if n <= lanes else 2
    blocks = []
    for mr in range(1, min(m, isa.registers) + 1):
        for vectors in range(min_vectors, isa.registers):
            if not fits_registers(isa, mr, vectors) or (vectors - 1) * lanes >= n:
                break
            blocks.append(RegisterBlock(mr, vectors, lanes))
    return blocks


def _padding_copy(m: int, m_padded: int) -> Fraction:
    """Cycles per k step charged for padding M to `m_padded` (`PAD_COPY_CYCLES`)."""
    return m * PAD_COPY_CYCLES if m_padded != m else Fraction(0)


def choose_tiling(isa: VectorISA, caches: CacheSizes, dtype: str, batch: int, m: int, n: int,
                  k: int, cores: int, crop_pass: bool = False, rows_hint: bool = False,
                  b_in_place_unpadded: bool = False) -> Tiling:
    """Register block and cache blocks together: every candidate block (`register_blocks`)
    with its tiles (`choose_tiles`), costed as what the schedule runs: the busiest core's
    share of the tiles (TVM splits the parallel loop into equal contiguous chunks) times a
    tile's register blocks times `micro_cycles` (per k step), plus `PAD_COPY_CYCLES` per
    element of A and k step, shared by the cores, when M is padded; ties go
    to more accumulators. M is padded to whole row tiles, so the padding of a block's row
    tiles is charged, not only that of its register blocks: on a Zen 5 core (AVX-512) BERT's
    512 x 768 . 768 x 3072 took 14 x 2 blocks when the block was chosen alone, and row tiles
    of 140 padded M to 560 (406 GFLOP/s); chosen together, 13 x 2 in tiles of 130 (M 520) ran
    476, 8 x 3 in tiles of 128 489-506 (one process, alternating). On a shape every block
    divides (1680 x 768 . 768 x 3072) blocks from 4 x 4 to 14 x 2 measured within 4 % there.
    With N in one vector the padding charge weighs about as much per element of A as the
    micro-kernel itself (NeRF's 4096x256 . 256x1: 14 rows and, then, a copy of A, or 8 rows
    and none), which keeps such products on blocks that divide M.
    `crop_pass`: a consumer of the output reads it through composite indices that a padded
    tile's crop cannot be folded into (`_crop_kept`): padding M or N then costs a whole extra
    pass over the padded output, at `PAD_COPY_CYCLES` per element. MobileNetV2's 1x1
    32 -> 192 at 28x28 (N = 784) on a Zen 5, one process, alternating, while its epilogue
    could not be folded: 12 x 2 blocks (N padded to 800 and the extra pass) 60-66 us; the plan
    with the pass charged, 3 x 7 blocks (112 columns divide 784) in row tiles of 96, 42 us;
    2 x 7 in one row tile 26 us, which this model does not rank first (it has no term for the
    locality of the runtime-packed B between cores). Folded (`_crop_kept` proves the crop
    p < 784 survives), 12 x 2 needs no pass: 25-27 us with that epilogue, and the projection
    192 -> 32 at 28x28 went 27.9 -> 25.9 us.
    `rows_hint`: the readers of C split it by rows (`affinity`; see `rows_per_core`).
    `b_in_place_unpadded`: B is a run-time matrix laid out along J, read in place where nr
    divides N (`b_in_place`) and packed, padded, at every call where it does not: such a
    block is charged that pass over B, `B_PACK_CYCLES` per element (where the measurements
    are). NAFNet's 1x1 32 -> 32 at 128x128 (N = 16384) had taken 8 x 3 blocks (nr = 48);
    it now takes 11 x 2 (M padded to 33, B in place): 177-192 -> 131-143 us.
    """
    def key(tiling: Tiling):
        block = tiling.block
        m_tiled = math.ceil(m / tiling.mc) * tiling.mc
        n_padded = math.ceil(n / block.nr) * block.nr
        tiles = batch * (m_tiled // tiling.mc) * (n_padded // block.nr)
        busiest = math.ceil(tiles / cores) * (tiling.mc // block.mr)
        cycles = busiest * micro_cycles(isa, block.mr, block.vectors)
        copies = _padding_copy(m, m_tiled)
        if crop_pass and (n_padded != n or m_tiled != m):
            copies += Fraction(m_tiled * n_padded, k) * PAD_COPY_CYCLES
        if b_in_place_unpadded and n_padded != n and tiling.kc >= k:
            copies += n_padded * B_PACK_CYCLES  # B's k x n_padded elements, per k step
        return (cycles + copies * batch / cores, -block.mr * block.vectors)

    return min((choose_tiles(block, caches, dtype, batch, m, n, k, cores, rows_hint)
                for block in register_blocks(isa, dtype, m, n)), key=key)


def _largest_divisor_at_most(value: int, limit: int, floor: int) -> int | None:
    for d in range(min(value, limit), floor - 1, -1):
        if value % d == 0:
            return d
    return None


def choose_tiles(block: RegisterBlock, caches: CacheSizes, dtype: str, batch: int, m: int,
                 n: int, k: int, cores: int, rows_hint: bool = False) -> Tiling:
    """Cache blocks around the register block.

    kc (K block): K is not split while a whole K x nr panel of B fits in half of L2: each
    micro-kernel then streams its panel from L2 and keeps its accumulator in registers from
    the first k to the write-back (measured 4 % faster than K blocks of the L1 size, which
    need an mc x nr accumulator tile in memory). Larger panels are split into kc x nr blocks
    taking at most half of L1 (at least MIN_KC), with kc dividing K, since a remainder would
    put a predicate inside the micro-kernel; without such a divisor K is not split.
    mc (rows of a parallel tile): the mc x kc block of A is re-read by the tile's column
    panels, and between two reads of one of its lines the core writes the mc x nr strip of C
    of a panel, which passes through L2 too; so mc * (kc + nr) takes at most half of L2
    (NeRF's 4096 x 63 . 63 x 256 on an Emerald Rapids core, 2 MiB L2: counting A alone gave
    one row tile of 4102 rows, 694 us; with the strip, two of 2058, 491 us; one process,
    alternating), and the accumulator tile of a split K lives next to the B block, so (split
    K) mc * nr takes at most half of L1; fewer rows when that leaves
    fewer than TILES_PER_CORE tiles per core; then adjusted to pad M least
    (`_whole_row_tiles`)."""
    size = tvm.runtime.DataType(dtype).bits // 8
    m_padded = math.ceil(m / block.mr) * block.mr
    kc = k_block(block, caches, size, k)
    row_limit = caches.l2 // 2 // ((kc + block.nr) * size)
    if kc < k:
        row_limit = min(row_limit, caches.l1 // 2 // (block.nr * size))
    rows = max(1, min(m_padded // block.mr, row_limit // block.mr))
    n_tiles = batch * math.ceil(n / block.nr)
    while rows > 1 and n_tiles * math.ceil(m_padded / (rows * block.mr)) < TILES_PER_CORE * cores:
        rows -= 1
    rows = _whole_row_tiles(m_padded // block.mr, rows)
    mc = rows * block.mr
    if rows_hint and rows_per_core(batch, m, n, k, block.mr, mc, cores, caches.l2 // size):
        mc = m // cores
        return Tiling(block, mc, kc, columns_outer=False,
                      panels=_panels_per_tile(caches, size, cores, block, mc, n, k, kc, cores))
    m_tiled = math.ceil(m / mc) * mc
    return Tiling(block, mc, kc, columns_outer=_columns_outer(caches, size, m_tiled, mc, n, k,
                                                             block.nr),
                  panels=_panels_per_tile(caches, size, batch * (m_tiled // mc), block, mc,
                                          n, k, kc, cores))


def b_in_place(shape: GemmShape, tiling: Tiling, caches: CacheSizes | None = None
               ) -> bool:
    """Whether the micro-kernel reads a run-time B where it lies instead of packing it into
    panels: where B is laid out with J innermost (`GemmShape.b_along_j`: a matmul's [K, N]
    operand, a pointwise convolution's NCHW input), each k step of a panel is already nr
    contiguous elements, and the pack only reads and writes all of B once more at every call.
    Not where J is padded (a padded panel's last vector would read past the row) or K is
    split (a K x nr panel beyond half of L2, which the pack lays out contiguously for the
    k blocks). Constant weights are packed anyway (at compile time, free at run time).
    Measured (Emerald Rapids, 2 cores, one process, packed and in place alternating):
    pointwise convolutions 56 -> 12 at 32x32 12.0 -> 7.8 us, 32 -> 64 at 128x128 310 ->
    247 us, 24 -> 144 at 56x56 73.5 -> 68 us, attention's 12x(128x128 . 128x64) 81.9 -> 74.4
    us, 6x(197x197 . 197x64) 94.6 -> 90.0 us. That includes B rows a multiple of 4 KiB apart
    (K rows of a panel in a few L1 sets, more lines than ways): still faster than the pack
    where few row blocks read each panel (`_panel_thrashes`)."""
    return shape.b_along_j and shape.n % tiling.block.nr == 0 and tiling.kc >= shape.k \
        and not _panel_thrashes(shape, tiling, caches)


# Row blocks reading one in-place panel of B beyond which a panel that cannot stay in L1
# is packed instead (`_panel_thrashes`): 8 gain from reading in place, 64 lose 1.9x.
THRASHING_ROW_BLOCKS = 16


def _panel_thrashes(shape: GemmShape, tiling: Tiling, caches: CacheSizes | None) -> bool:
    """Whether a panel of B read in place would be fetched from L2 again by each of many
    row blocks: its K rows lie a multiple of `L1_SET_PERIOD` bytes apart, so all of them
    share the same L1 sets, more rows than the L1 has ways (the panel cannot stay in L1),
    and more than `THRASHING_ROW_BLOCKS` row blocks read it. A packed panel is contiguous
    (it stays in L1 from one row block to the next), for one pass over B at every call.
    Measured (Emerald Rapids, 2 cores, one process, alternating): CSRNet's Winograd
    F(2, 3) matmul 16 x (512 x 512 . 512 x 64), B's rows 4 KiB apart, 64 row blocks: in
    place 3589 us, packed 1871 us; NAFNet's 1x1 32 -> 64 at 128x128 (rows 64 KiB apart,
    K = 32, 8 row blocks): in place 267 us, packed 322 us."""
    if caches is None or not shape.b_k_stride:
        return False
    size = tvm.runtime.DataType(shape.dtype).bits // 8
    return (shape.b_k_stride * size) % L1_SET_PERIOD == 0 and shape.k > caches.l1_ways \
        and shape.m // tiling.block.mr > THRASHING_ROW_BLOCKS


def k_block(block: RegisterBlock, caches: CacheSizes, size: int, k: int) -> int:
    """kc of `choose_tiles`: K whole while a K x nr panel of B fits half of L2, else the
    largest divisor of K whose kc x nr block takes at most half of L1 (at least MIN_KC)."""
    if k * block.nr * size <= caches.l2 // 2:
        return k
    kc_max = max(MIN_KC, caches.l1 // 2 // (block.nr * size))
    return _largest_divisor_at_most(k, kc_max, max(1, kc_max // 2)) or k


def _panels_per_tile(caches: CacheSizes, size: int, row_tiles: int, block: RegisterBlock,
                     mc: int, n: int, k: int, kc: int, cores: int) -> int:
    """Column panels per parallel tile (1: a tile is one mc x nr panel, its register blocks
    written row block after row block). Where the rows of C lie a multiple of `L1_SET_PERIOD`
    bytes apart (N * itemsize: a 1x1 convolution over 128 x 128 positions, 64 KiB), the mr
    rows of one register block's write-back all fall in the same L1 sets, and the next block's
    in the same sets again; more rows than the L1 has ways evict each other. With K whole and
    short, written back every K steps, that cost a third of the kernel (NAFNet's 64 x 32 .
    32 x 16384 in 13 x 2 blocks on a Zen 5, 12 ways: 232 us; 166 us with N = 16400).
    Several panels per tile, each register-block row running along them, write each row in a
    long contiguous run (173 us). In the einweld modules (one process, old and new
    alternating): FSRCNN's 1x1 12 -> 56 at 32x32 (14-row blocks, 4 KiB rows) 10.5 -> 5.7 us,
    NAFNet's 32 -> 64 at 128x128 180 -> 168 us; blocks of no more rows than ways gain nothing
    (12 rows: 7.4 us either way) or lose (NAFNet's 32 -> 32, 8 rows: 96 -> 102 us), and keep
    one panel per tile. Each row block then reads the tile's panels of B
    again, so they must stay in L2 beside the tile's rows of A (half of L2 for both, as in
    `choose_tiles`): BERT's 128 x 768 . 768 x 3072 keeps one panel. As many panels as that
    allows while leaving TILES_PER_CORE tiles per core, dividing the panel count (so no tile
    is partial), and no more panels on the busiest core than one panel per tile would leave
    it (9 tiles of 38 panels on two cores: 13 % slower than one panel per tile); 1 elsewhere,
    and where K is split."""
    if kc < k or (n * size) % L1_SET_PERIOD or block.mr <= caches.l1_ways:
        return 1
    nr = block.nr
    count = math.ceil(n / nr)
    room = caches.l2 // 2 - mc * k * size

    def busiest(panels: int) -> int:  # panels the busiest core runs
        return math.ceil(row_tiles * (count // panels) / cores) * panels

    return max((d for d in range(1, count + 1) if count % d == 0
                and d * k * nr * size <= room and busiest(d) <= busiest(1)
                and row_tiles * (count // d) >= TILES_PER_CORE * cores), default=1)


def rows_per_core(batch: int, m: int, n: int, k: int, mr: int, mc: int, cores: int,
                  l2_elements: int) -> bool:
    """Whether the one row tile of all M rows is cut into one tile of M / cores rows a core,
    row tiles outer, so that core t writes rows [t M / cores, (t + 1) M / cores) of C, every
    column of them, instead of a range of columns of every row; asked only where every
    kernel reading C splits it by rows in that order (`affinity.rows_per_core_hints`: a
    pointwise convolution's output channels, read by a depthwise convolution or an
    element-wise kernel, each core its own channel range).

    Then the rows a core writes are those it reads next, from its own L2 (what the other
    core has just written is read at about a fifth of the speed: `affinity`), and only B is
    read by both cores; worth it where C is the larger (M >= 2K: MobileNetV2's 24 -> 144
    and 32 -> 192) and a core's rows of C stay in its L2 for the reader (at most half of it:
    beyond, both splits stream C through L3 and the row split only reads B twice; NAFNet's
    32 -> 64 at 128 x 128, 2 MiB of C a core, 2.24 -> 2.40 ms with the split forced). The
    cycle model ranks both splits alike (as many register blocks a core). Only for batch 1
    (a batch splits by images already), a single row tile and M a multiple of cores x mr
    (no padding)."""
    return (batch == 1 and cores > 1 and mc >= m and m >= 2 * k
            and m % (cores * mr) == 0 and m // cores * n <= l2_elements // 2)


def _whole_row_tiles(blocks: int, limit: int) -> int:
    """Register blocks per row tile, at most `limit` and at least half of it, that pad the
    `blocks` register-block rows of M least (ties: the larger tile). M is padded to whole row
    tiles (`schedule_gemm`): the write-back of a tile that ran past M would have no row guard
    (TVM's reverse_compute_at does not carry the block predicate; a heap corruption seen on
    384 x 1536 x 197). Padding beats a small divisor: 512 rows (86 blocks of 6 = 2 x 43) had
    row tiles of 12 and re-read B 43 times."""
    return min(range(max(1, (limit + 1) // 2), limit + 1),
               key=lambda rows: (math.ceil(blocks / rows) * rows, -rows))


def _columns_outer(caches: CacheSizes, size: int, m: int, mc: int, n: int, k: int, nr: int
                   ) -> bool:
    """Order of the parallel tiles within one batch element (the batch loop is outermost):
    column panels outer (each panel of B read once, A re-read per panel) or row tiles outer
    (A once, B re-read per row tile), whichever moves fewer bytes from beyond L2. An operand
    fitting half of L2 is read once either way. Measured on a Zen 1 (L2 512 KiB), rows outer
    vs columns outer: BERT's 128x3072 . 3072x768 9.96 vs 8.83 ms (B 9 MiB, 11 row tiles),
    NeRF's 4096x256 . 256x256 8.7 vs 9.6 ms (B fits L2, A does not)."""
    a_bytes, b_bytes = m * k * size, n * k * size
    rows_outer = beyond_l2(caches, a_bytes, b_bytes, m // mc)
    cols_outer = beyond_l2(caches, b_bytes, a_bytes, math.ceil(n / nr))
    return cols_outer < rows_outer


def beyond_l2(caches: CacheSizes, once: int, again: int, times: int) -> int:
    """Bytes read from beyond L2 when an outer loop over the tiles of one operand (`once`
    bytes, each tile read once) runs `times` passes over the other (`again` bytes): one pass
    when the other fits half of L2 and stays there, `times` passes otherwise."""
    return once + (again if again <= caches.l2 // 2 else times * again)


@functools.lru_cache(maxsize=None)
def _host_caches() -> CacheSizes:
    """This machine's per-core L1d / L2 from sysfs (the smallest class figures where sysfs has
    none); read, never measured."""
    from ....machine import cpu_caches  # pylint: disable=import-outside-toplevel

    caches = cpu_caches()  # one read of sysfs
    l1, l2 = DEFAULT_CACHES[128]
    ways = caches[1].ways if 1 in caches else 0
    return CacheSizes(l1=caches[1].size if 1 in caches else l1,
                      l2=caches[2].size if 2 in caches else l2,
                      l1_ways=ways or DEFAULT_L1_WAYS)


def cache_sizes(target: Target) -> CacheSizes:
    """This machine's caches when `target` compiles for it (same triple and no other mcpu),
    else DEFAULT_CACHES by the target's vector width."""
    host_triple = codegen.llvm_get_system_triple()
    triple = str(target.attrs.get("mtriple", "") or host_triple)
    mcpu = str(target.attrs.get("mcpu", "") or "")
    if triple == host_triple and mcpu in ("", codegen.llvm_get_system_cpu()):
        return _host_caches()
    l1, l2 = DEFAULT_CACHES.get(vector_isa(target).bits, DEFAULT_CACHES[128])
    return CacheSizes(l1, l2)


def target_cores(target: Target) -> int:
    """The target's `num-cores`, else this machine's CPU count."""
    return int(target.attrs.get("num-cores", 0) or 0) or os.cpu_count() or 1


# TVM's runtime::kMaxStackAlloca: LowerTVMBuiltin keeps a CPU allocation of constant size
# below this many bytes on the stack, and only in the "global" scope; a "local" buffer (or a
# larger one) becomes a TVMBackendAllocWorkspace / FreeWorkspace call pair.
MAX_STACK_BYTES = 1024


def accumulator_scope(elements: int, dtype: str) -> str:
    """The storage scope of a register block's accumulator of `elements` values.

    Inside a parallel tile a workspace allocation is a call pair per tile (~13 ns measured:
    1.75x on a depthwise convolution's 9-FMA tiles), and LLVM must zero and spill a block it
    cannot see is private; on the stack it is free and the unrolled block stays in registers.
    So: "global" when it fits TVM's own stack limit (on the stack in any TIR pipeline), else
    "local", which the einweld TIR pipeline also keeps on the stack up to the size of the
    register file (`tir_passes.stack_buffers`)."""
    return "global" if elements * np.dtype(dtype).itemsize < MAX_STACK_BYTES else "local"


# ------------------------------------------------------------------------------ matching
@dataclass(frozen=True)
class GemmShape:
    """Extents of the normalised problem C[S, I, J] += A[S, I, K] * B[S, J, K]."""

    batch: int
    m: int
    n: int
    k: int
    dtype: str
    a_read: int = 0  # which of the reduction block's reads is A (1: operands swapped, N = 1)
    a_gather: bool = False  # A's elements come from composite indices (an implicit im2col)
    a_along_k: bool = True  # A is laid out with K innermost (read in place along K)
    b_along_j: bool = False  # B is laid out with J innermost (read in place: `b_in_place`)
    b_k_stride: int = 0  # elements between B's consecutive k (in place), 0 where unknown


def _static(extent) -> int | None:
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _is_reduction(block: s_tir.SBlock) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)


def _is_spatial(block: s_tir.SBlock) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)


def find_gemm_block(sch: s_tir.Schedule) -> s_tir.schedule.SBlockRV | None:
    """The single reduction block of a function whose other blocks are all spatial, if it has
    the einsum form of a matrix product; None otherwise."""
    try:
        blocks = sch.get_child_blocks(get_root_block(sch))
    except ValueError:  # the body is not a root block (an already lowered function)
        return None
    reductions = []
    for block in blocks:
        stmt = sch.get(block)
        if _is_reduction(stmt):
            if not all(iv.iter_type in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce)
                       for iv in stmt.iter_vars):
                return None
            reductions.append(block)
        elif not _is_spatial(stmt):
            return None
    if len(reductions) != 1:
        return None
    return reductions[0]


def _access_vars(regions) -> list[set] | None:
    """Per region, the block variables its indices use; None unless every access is one
    element (the einsum form)."""
    out = []
    for region in regions:
        used: set = set()
        for rng in region.region:
            if _static(rng.extent) != 1:
                return None
            used |= {v for v in tirx.analysis.undefined_vars(rng.min)}
        out.append(used)
    return out


@dataclass(frozen=True)
class GemmMaps:
    """Index maps normalising a block to C[S,I,J] += A[S,I,K] * B[S,J,K]; `a_read` is the
    position of the A operand in the block's reads (1 when the operands are swapped)."""

    block: tirx.IndexMap
    a: tirx.IndexMap
    b: tirx.IndexMap
    c: tirx.IndexMap
    a_read: int
    has_i: bool = True  # False: A is a vector (M = 1)
    c_kinds: tuple = ()  # the kind (S, I, J; T for extent 1) of each of C's dimensions


def _classify(block: s_tir.SBlock, a_vars: set, b_vars: set, c_vars: set,
              unit_j: bool = False) -> dict | None:
    """{block var: IterTrait} for the einsum form with A = `a_vars`' operand, or None. With
    `unit_j`, an extent-1 axis of B and C alone is J (kept: N = 1 as a real axis)."""
    traits = {}
    for iv in block.iter_vars:
        var, extent = iv.var, iv.dom.extent
        if unit_j and _static(extent) == 1 and iv.iter_type == tirx.IterVar.DataPar and \
                var in b_vars and var in c_vars and var not in a_vars:
            kind = IterKind.kIter_J
        elif _static(extent) == 1:
            kind = IterKind.kIter_T
        elif iv.iter_type == tirx.IterVar.DataPar:
            where = (var in a_vars, var in b_vars, var in c_vars)
            kind = {(True, True, True): IterKind.kIter_S, (True, False, True): IterKind.kIter_I,
                    (False, True, True): IterKind.kIter_J}.get(where)
        elif iv.iter_type == tirx.IterVar.CommReduce and var in a_vars and var in b_vars \
                and var not in c_vars:
            kind = IterKind.kIter_K
        else:
            kind = None
        if kind is None:
            return None
        traits[var] = IterTrait(kind, extent)
    return traits


def _innermost_kind(region, traits: dict) -> IterKind | None:
    """The kind of the block variable indexing the last non-constant dimension of `region`."""
    for rng in reversed(list(region.region)):
        found = [v for v in _used_vars(rng.min) if v in traits
                 and traits[v].kind != IterKind.kIter_T]
        if found:
            return traits[found[0]].kind if len(found) == 1 else None
    return None


def _last_moving(block: s_tir.SBlock, region) -> tuple[set, tirx.Expr | None]:
    """The block variables of extent > 1 that index the last dimension of `region` indexed
    by any, and that dimension's index; (empty, None) when no dimension moves."""
    moving = {iv.var for iv in block.iter_vars if _static(iv.dom.extent) != 1}
    for rng in reversed(list(region.region)):
        used = _used_vars(rng.min) & moving
        if used:
            return used, rng.min
    return set(), None


def _read_along_k(block: s_tir.SBlock, region) -> bool:
    """True when the last dimension of `region` that moves is indexed by reduction axes."""
    reduce = {iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    used, _ = _last_moving(block, region)
    return bool(used) and used <= reduce


def _read_along_j(block: s_tir.SBlock, b_region, a_region) -> bool:
    """True when B's last dimension that moves is indexed by one J axis (spatial, not read by
    A) with coefficient 1 (plus axes of extent 1: a pointwise convolution's x + kx):
    consecutive j are consecutive elements of B."""
    spatial = {iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar}
    a_vars = set().union(*(_used_vars(r.min) for r in a_region.region))
    used, index = _last_moving(block, b_region)
    if len(used) != 1 or not used <= spatial - a_vars:
        return False
    coefficients = detect_linear_equation(index, list(used))
    return len(coefficients) == 2 and _static(coefficients[0]) == 1


def _k_stride(block: s_tir.SBlock, region) -> int:
    """Elements of `region`'s buffer between consecutive steps of the block's innermost
    reduced axis (the k step of a B read in place); 0 where the index is not linear in it or
    the buffer's shape is not static."""
    dims = [_static(d) for d in region.source.shape]
    reduce = [iv.var for iv in block.iter_vars
              if iv.iter_type == tirx.IterVar.CommReduce and _static(iv.dom.extent) != 1]
    if not reduce or None in dims:
        return 0
    flat, stride = None, 1
    for rng, dim in zip(reversed(list(region.region)), reversed(dims)):
        term = rng.min * tirx.const(stride, str(rng.min.ty.dtype))
        flat, stride = term if flat is None else flat + term, stride * dim
    coefficients = detect_linear_equation(flat, [reduce[-1]])
    if len(coefficients) != 2:
        return 0
    return _static(coefficients[0]) or 0


def _used_vars(expr) -> set:
    return set(tirx.analysis.undefined_vars(expr))


def gemm_index_maps(block: s_tir.SBlock, a_read: int | None = None, unit_j: bool = False
                    ) -> GemmMaps | None:
    """Index maps normalising `block` to C[S,I,J] += A[S,I,K] * B[S,J,K], or None.

    Like dlight's `get_index_map`, with extensions: an absent I axis is allowed (M = 1: a row
    vector times a matrix keeps the columns in the vector lanes); the operands may swap roles
    (C^T = B^T A^T), which is the only form when J is absent (N = 1: a matrix times a column
    vector) and the preferred one when it makes A contiguous along K. K must exist;
    extent-1 axes are dropped. `a_read` forces the orientation (the block after reindexing
    keeps the one chosen on the original accesses); `unit_j` takes an extent-1 axis of B and
    C as J (N = 1 without the swap: see `analyse`)."""
    if len(block.reads) != 2 or len(block.writes) != 1:
        return None
    used = _access_vars([block.reads[0], block.reads[1], block.writes[0]])
    if used is None:
        return None
    S, I, J, K = IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K
    valid = []
    for candidate in (0, 1) if a_read is None else (a_read,):
        traits = _classify(block, used[candidate], used[1 - candidate], used[2], unit_j)
        if traits is not None and {J, K} <= {t.kind for t in traits.values()}:
            valid.append((candidate, traits))
    if not valid:
        return None
    # A is broadcast element by element along k, B is packed: prefer the orientation whose A
    # is contiguous along K (a pointwise convolution's weights rather than its NCHW input:
    # measured 1.3-1.4x faster, packing of the input included).
    a_read, traits = next((v for v in valid if _innermost_kind(block.reads[v[0]], v[1]) == K),
                          valid[0])
    a_vars, b_vars, c_vars = used[a_read], used[1 - a_read], used[2]

    def of(vars_):
        return [traits[iv.var] for iv in block.iter_vars if iv.var in vars_]

    return GemmMaps(
        block=make_iter_fusion_index_map([traits[iv.var] for iv in block.iter_vars],
                                         [S, I, J, K]),
        a=make_iter_fusion_index_map(of(a_vars), [S, I, K]),
        b=make_iter_fusion_index_map(of(b_vars), [S, J, K]),
        c=make_iter_fusion_index_map(of(c_vars), [S, I, J]),
        a_read=a_read,
        has_i=any(t.kind == I for t in traits.values()),
        c_kinds=tuple(traits[next(iter(_used_vars(r.min)))].kind if _used_vars(r.min)
                      else IterKind.kIter_T for r in block.writes[0].region),
    )


def _inline_producers(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Inline every spatial producer chain of `block` (casts, transposes, broadcasts) so the
    reduction reads function parameters; producers that refuse stay materialised."""
    changed = True
    while changed:
        changed = False
        for producer in sch.get_producers(block):
            try:
                sch.compute_inline(producer)
                changed = True
            except Exception:  # pylint: disable=broad-except
                continue


def _all_consumers(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> list:
    out = []
    for consumer in sch.get_consumers(block):
        out.append(consumer)
        out.extend(_all_consumers(sch, consumer))
    return out


def _simple_reads(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """Every index `block` reads with is a block variable or a constant (an element-wise or
    broadcast consumer), not a composite such as a reshape's `p // 100`."""
    return all(isinstance(rng.min, (tirx.Var, tirx.IntImm))
               for region in sch.get(block).reads for rng in region.region)


def _crop_kept(sch: s_tir.Schedule, consumer: s_tir.schedule.SBlockRV) -> bool:
    """Whether reverse-inlining `consumer` (one that reads through composite indices) into
    its producer, a padded tile's cropped write-back, keeps the crop: TVM 0.27 derives the
    merged block's predicate from the consumer's domain, and where the padding lies on an
    inner axis of the consumer's index it replaced the crop `col < 100` by the reshape's
    bound `row * 100 + col < 800`, writing the padded columns over the next row (a 1x1 conv +
    reshape merged by TileGraphFusion; caught by its check). Tried on a copy of the
    schedule: kept only where TVM's analyzer proves, over the loops' ranges, that the merged
    predicate implies the write-back's own (padding at the end of a flattened axis, a 1x1
    convolution's positions y * W + x read back as (y, x), passes: the bound stays p < H * W)."""
    producers = sch.get_producers(consumer)
    if len(producers) != 1:
        return False
    producer = producers[0]
    before = get_sblock_realize(sch, producer).predicate
    trial = sch.copy()
    try:
        trial.reverse_compute_inline(consumer)
    except (RuntimeError, ValueError):
        return False
    after = get_sblock_realize(trial, producer).predicate
    analyzer = Analyzer()
    for loop in trial.get_loops(producer):
        stmt = trial.get(loop)
        analyzer.bind(stmt.loop_var, ir.Range.from_min_extent(stmt.min, stmt.extent))
    with analyzer.constraint_scope(after):
        return analyzer.can_prove(before)


def _inline_consumers(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV,
                      padded: bool = False, keep: frozenset = frozenset()) -> None:
    """Fold the consumer graph (reindex/pad crops, epilogues) into `block`, as dlight does:
    first inline intermediate consumers forward into their own consumers (so a value read
    twice, like GELU's x * erf(x), becomes one expression), then reverse-inline the rest
    into `block`. Consumers that refuse stay at the root, still correct.
    With `padded` (the output tile has padding that a crop predicate removes), nothing is
    inlined forward into a consumer reading through composite indices (a reshape), and such
    a consumer is reverse-inlined only where the crop provably survives (`_crop_kept`).
    Blocks named in `keep` (a row epilogue, `gemm_rows`) are neither inlined nor inlined into.
    """

    def kept(consumer) -> bool:
        return sch.get(consumer).name_hint in keep

    def foldable(consumer) -> bool:
        return not kept(consumer) and (not padded or _simple_reads(sch, consumer))

    changed = True
    while changed:
        changed = False
        consumers = _all_consumers(sch, block)
        for consumer in consumers:
            try:  # a handle inlined away on an earlier pass raises, like a refusal
                if not kept(consumer) and all(foldable(c) for c in sch.get_consumers(consumer)):
                    sch.compute_inline(consumer)
                    changed = True
            except (RuntimeError, ValueError):
                continue
        for consumer in consumers:
            try:
                if not kept(consumer) and (foldable(consumer) or _crop_kept(sch, consumer)):
                    sch.reverse_compute_inline(consumer)
                    changed = True
            except (RuntimeError, ValueError):
                continue


def schedule_leftover_consumers(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV,
                                target: Target) -> None:
    """Consumers `_inline_consumers` could not fold (a padded tile's crop read through a
    reshape) stay whole-output passes at the root: give each the memory-bound rule's loops
    (parallel outer, vectorised contiguous run) instead of TVM's serial scalar default, which
    cost more than the 1x1 convolution itself (192 x 784 x 32: 126 us of which the epilogue
    was most). A block whose loops are not plainly its axes is left as it is.
    The consumer's other spatial producers (blocks at the root that do not read `block`'s
    output: in a tile kernel that ends a transposed convolution, the stack and reshape of the
    other phases' outputs) are inlined into it first, so that one block puts the phases
    together and the memory-bound rule vectorises it as an interleave
    (`injective.interleave_factor`); left at the root they had run as three serial scalar
    passes (GCN's 21-channel 4x4/s2 at 56x56: 60 us of the kernel's 95)."""
    from . import injective  # pylint: disable=import-outside-toplevel

    params = injective.cpu_params(target)
    for consumer in _all_consumers(sch, block):
        try:
            _inline_side_producers(sch, consumer, block)
            if injective.loops_match_iters(sch, consumer):
                injective.schedule_spatial_block(sch, consumer, params)
        except (RuntimeError, ValueError):
            continue


def _inline_side_producers(sch: s_tir.Schedule, consumer: s_tir.schedule.SBlockRV,
                           block: s_tir.schedule.SBlockRV) -> None:
    """Inline into `consumer` each of its spatial producers (and theirs) that is neither
    `block` nor fed by it; a producer that refuses stays materialised (still correct)."""
    # By sref: inlining a block replaces the other blocks' nodes as the function changes,
    # not their srefs.
    fed = [sch.get_sref(b) for b in [block, *_all_consumers(sch, block)]]
    for producer in sch.get_producers(consumer):
        if any(sch.get_sref(producer).same_as(other) for other in fed) or \
                not _is_spatial(sch.get(producer)):
            continue
        _inline_producers(sch, producer)
        try:
            sch.compute_inline(producer)
        except (RuntimeError, ValueError):
            continue


def _param_index_of(func: tirx.PrimFunc, buffer: tirx.Buffer) -> int | None:
    for index, param in enumerate(func.params):  # TVM 0.27: a buffer parameter is its own Var
        if param.same_as(buffer):
            return index
    return None


def _is_layout_free(func: tirx.PrimFunc, buffer: tirx.Buffer) -> bool:
    """True when `buffer` is a parameter listed in `layout_free_buffers` (a weight)."""
    free = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    return bool(free) and _param_index_of(func, buffer) in {int(i) for i in free}


def _reads_only_layout_free(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV,
                            func: tirx.PrimFunc) -> bool:
    """True when every buffer `block` reads is a parameter listed in `layout_free_buffers`."""
    reads = sch.get(block).reads
    return bool(reads) and all(_is_layout_free(func, r.source) for r in reads)


# ------------------------------------------------------------------------------ the rule
class AnalyticRule(ScheduleRule):
    """A dlight-style rule around an analytic `schedule(func, target)`: `apply` returns its
    schedule when TVM's own lowering accepts it (`well_formed`), else None."""

    @staticmethod
    def schedule(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        raise NotImplementedError

    def is_target_available(self, target: Target) -> bool:
        return target.kind.name == "llvm"

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool = False
              ) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        try:
            return well_formed(self.schedule(func, target))
        except (RuntimeError, ValueError):
            # A primitive refused (an access pattern we did not foresee): leave the function
            # to other rules rather than risk a wrong or half-made schedule.
            return None


class GEMM(AnalyticRule):
    """The GEMM-class rule: `apply(func, target, tunable)` returns a Schedule or None."""

    @staticmethod
    def schedule(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        return schedule_gemm(func, target)


def well_formed(sch: s_tir.Schedule | None) -> s_tir.Schedule | None:
    """`sch` if its function survives the start of TVM's own lowering (block lowering up to
    buffer flattening, a few milliseconds), else None: a last guard against a primitive
    sequence that leaves e.g. a dangling buffer, seen with TVM 0.27's reverse_compute_inline
    on a diamond of consumers (GELU)."""
    if sch is None:
        return None
    try:
        flat_lowering()(tvm.IRModule({"main": sch.mod["main"]}))
    except (RuntimeError, ValueError):
        return None
    return sch


def flat_lowering() -> tvm.transform.Pass:
    """The start of TVM's own lowering (`default_s_tir_pipeline`'s passes that apply to a CPU
    function), block lowering up to buffer flattening. Its simplification matters: without
    it, FlattenBuffer divided by zero on index expressions like `(t + 0) - t` that region
    compaction leaves (a GEMM with a softmax merged into its tiles), which TVM's own
    pipeline simplifies away first."""
    from tvm.s_tir import transform as st  # pylint: disable=import-outside-toplevel

    return tvm.transform.Sequential([
        st.CanonicalizeLoop(), st.LowerInitBlock(), st.PlanAndUpdateBufferAllocationLocation(),
        st.ConvertBlocksToOpaque(), st.CompactBufferAllocation(), st.LowerMatchBuffer(),
        st.StmtSimplify(), st.LowerOpaqueBlock(), tirx.transform.FlattenBuffer(),
    ])


def analyse(func: tirx.PrimFunc, find=find_gemm_block
            ) -> tuple[s_tir.Schedule, s_tir.schedule.SBlockRV, GemmShape] | None:
    """Normalise a matmul-class function. Returns the schedule (producers inlined, block
    reindexed to (S, I, J, K)), the reduction block and the problem shape; None if no match.
    `find(schedule)` picks the reduction block (`gemm_rows` allows a row epilogue)."""
    sch = s_tir.Schedule(func)
    main = find(sch)
    if main is None:
        return None
    _inline_producers(sch, main)
    stmt = sch.get(main)
    maps = gemm_index_maps(stmt)
    if maps is None:
        return None
    if any(_static(iv.dom.extent) is None for iv in stmt.iter_vars):
        return None
    if not maps.has_i and not _is_layout_free(func, stmt.reads[1 - maps.a_read].source) and \
            _read_along_k(stmt, stmt.reads[1 - maps.a_read]):
        # A vector times a matrix computed at run time and read along K (NeRF's 4096x256 .
        # 256x1): as B the matrix would be packed into panels at every call, a transposed
        # copy of the whole matrix. As A it is read in place, each element broadcast once
        # against the vector padded to one register (measured 2.1-2.5x faster on the NeRF
        # shape, one process per runner); K stays in order.
        maps = gemm_index_maps(stmt, 1 - maps.a_read, unit_j=True) or maps
    dtype = str(stmt.writes[0].source.dtype)
    if not dtype.startswith("float"):
        return None
    # A read through composite indices (a convolution's x + kx, or a K fused from several
    # axes) would cost div/mod per broadcast inside the micro-kernel: copy it once instead.
    a_region = stmt.reads[maps.a_read].region
    a_gather = any(not isinstance(r.min, tirx.Var) and _static(r.min) is None
                   for r in a_region)
    a_along_k = _read_along_k(stmt, stmt.reads[maps.a_read])
    b_along_j = _read_along_j(stmt, stmt.reads[1 - maps.a_read], stmt.reads[maps.a_read])
    b_k_stride = _k_stride(stmt, stmt.reads[1 - maps.a_read]) if b_along_j else 0
    reindex_a = sch.reindex(main, ("read", maps.a_read))
    reindex_b = sch.reindex(main, ("read", 1 - maps.a_read))
    reindex_c = sch.reindex(main, ("write", 0))
    maps = gemm_index_maps(sch.get(main), maps.a_read, unit_j=True)
    block_map, a_map, b_map, c_map = maps.block, maps.a, maps.b, maps.c
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main, block_map)
    # The copies iterate in the normalised order too, so their loops are (S, I|J, K).
    sch.transform_block_layout(reindex_a, a_map)
    sch.transform_block_layout(reindex_b, b_map)
    batch, m, n, k = (int(iv.dom.extent) for iv in sch.get(main).iter_vars)
    return sch, main, GemmShape(batch, m, n, k, dtype, maps.a_read, a_gather, a_along_k,
                                b_along_j, b_k_stride)


def plan(shape: GemmShape, target: Target, crop_pass: bool = False, rows_hint: bool = False,
         b_constant: bool = False) -> Tiling:
    """Register and cache blocks for `shape` on `target` (`crop_pass`, `rows_hint`: see
    `choose_tiling`; `b_constant`: B is packed at compile time, whatever the padding)."""
    return choose_tiling(vector_isa(target), cache_sizes(target), shape.dtype, shape.batch,
                         shape.m, shape.n, shape.k, target_cores(target), crop_pass,
                         rows_hint, shape.b_along_j and not b_constant)


def schedule_gemm(func: tirx.PrimFunc, target: Target, tiling: Tiling | None = None
                  ) -> s_tir.Schedule | None:
    """Schedule a matmul-class PrimFunc (see the module docstring); None if it is not one.
    `tiling` overrides the analytic plan (tests use it to plant faults / odd blocks)."""
    found = analyse(func)
    if found is None:
        return None
    sch, main, shape = found
    if tiling is not None:
        return _schedule_tiles(sch, main, shape, tiling, func, target)[0]
    # Planned as if the padded tile's crop takes every consumer; where one stays a pass of its
    # own (`_crop_kept` refused it), planned again with that pass charged (`choose_tiling`).
    rows_hint = _rows_hinted(func, shape)
    b_producer = _producer_of(sch, main, 1 - shape.a_read)
    b_constant = b_producer is not None and _reads_only_layout_free(sch, b_producer, func)
    tiling = plan(shape, target, rows_hint=rows_hint, b_constant=b_constant)
    sch, leftover = _schedule_tiles(sch, main, shape, tiling, func, target)
    if leftover:
        charged = plan(shape, target, crop_pass=True, rows_hint=rows_hint,
                       b_constant=b_constant)
        if charged != tiling:
            sch, main, shape = analyse(func)
            sch = _schedule_tiles(sch, main, shape, charged, func, target)[0]
    return sch


def _rows_hinted(func: tirx.PrimFunc, shape: GemmShape) -> bool:
    """Whether `func` carries the row-split hint (`ROWS_PER_CORE_ATTR`) and its
    product's rows are its output's channels: an NCHW output of batch 1 with M channels."""
    attrs = func.attrs
    if attrs is None or not attrs.get(ROWS_PER_CORE_ATTR):
        return False
    out = func.params[-1].shape
    return len(out) == 4 and _static(out[0]) == 1 and _static(out[1]) == shape.m


def _schedule_tiles(sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, shape: GemmShape,
                    tiling: Tiling, func: tirx.PrimFunc, target: Target,
                    rows: "RowEpilogue | None" = None) -> tuple[s_tir.Schedule, bool]:
    """Steps 2-4 of the module docstring on `analyse`'s schedule; and whether a consumer of
    the padded output stayed a separate pass.
    With `rows` (a row epilogue, `gemm_rows`), a parallel tile is whole rows: it runs over
    the (S, I) row tiles only, every column panel inside it; the epilogue's blocks are not
    folded, `rows.join` puts them into the tile loop before it is parallelised, and no
    prefetch is planned."""
    mr, nr, lanes = tiling.block.mr, tiling.block.nr, tiling.block.lanes

    # Step 2: pad I to whole row tiles and J to whole panels (no-op axes are left alone, so
    # no copy is made when divisible). Whole row tiles matter for more than the predicate:
    # the write-back of a ragged last tile would get no row guard (see `choose_tiles`), so
    # a tiling whose mc does not divide M (only a forced one) is padded to it.
    mc = tiling.mc
    pad_m, pad_n = -shape.m % mc, -shape.n % nr
    if pad_m or pad_n:
        sch.pad_einsum(main, [1, mc if pad_m else 1, nr if pad_n else 1, 1])
    # A padded along M is read in place, its padded rows clamped (`clamp_padded_rows`), where
    # its elements lie along K; gathered, or strided along K, it is copied (the copy also
    # lays it out along K for the micro-kernel's broadcasts, as before the clamp).
    copy_a = shape.a_gather or (pad_m > 0 and not shape.a_along_k)
    a_block, b_block = _operand_blocks(sch, main, shape.a_read)
    pack_a = _reads_only_layout_free(sch, a_block, func)
    if pack_a:
        # A constant A (weights on the left: an NCHW pointwise convolution, a Winograd
        # form's batched matmul) is packed at compile time into row panels [S, I/mr, K, mr]:
        # each k step's mr broadcasts are then one contiguous run, where read in place they
        # came from mr rows K elements apart.
        sch.transform_layout(a_block, ("write", 0), lambda s, i, k: (s, i // mr, k, i % mr))
        sch.annotate(a_block, LAYOUT_REWRITE_ATTR, True)
        sch.parallel(sch.get_loops(a_block)[0])
    elif copy_a:
        _schedule_copy(sch, a_block, lanes)
    else:
        sch.compute_inline(a_block)
    a_in_place = not (pack_a or copy_a)

    # Step 3: B into panels [S, J/nr, K, nr], or read in place (`b_in_place`).
    b_constant = _reads_only_layout_free(sch, b_block, func)
    if b_in_place(shape, tiling, cache_sizes(target)) and not b_constant:
        sch.compute_inline(b_block)
        b_block = None
    else:
        sch.transform_layout(b_block, ("write", 0), lambda s, j, k: (s, j // nr, k, j % nr))
        if b_constant:
            sch.annotate(b_block, LAYOUT_REWRITE_ATTR, True)
        _schedule_pack(sch, b_block, nr, lanes)

    # Step 4: tiles, register block, local accumulator, epilogue in the write-back.
    s, i, j, k = sch.get_loops(main)
    i_tile, i_block, i_reg = sch.split(i, [None, tiling.mc // mr, mr])
    j_tile, j_vec, j_lane = sch.split(j, [None, nr // lanes, lanes])
    j_panel = None
    if tiling.panels > 1 and tiling.kc >= shape.k:
        j_tile, j_panel = sch.split(j_tile, [None, tiling.panels])
    outer = (j_tile, i_tile) if tiling.columns_outer else (i_tile, j_tile)
    if tiling.kc < shape.k:
        # K blocked: the tile's accumulator (mc x nr) outlives each K block.
        k_outer, k_inner = sch.split(k, [None, tiling.kc])
        sch.reorder(s, *outer, k_outer, i_block, k_inner, i_reg, j_vec, j_lane)
        accumulator_at, accumulator_rows = outer[1], tiling.mc
    else:
        # Whole K per register block: the accumulator is just the mr x nr registers, zeroed,
        # filled and written back (with the epilogue) by one micro-kernel.
        # With several panels per tile, each row block runs along them (`_panels_per_tile`).
        k_outer, k_inner = sch.add_unit_loop(k), k
        panel = [j_panel] if j_panel is not None else []
        sch.reorder(s, *outer, i_block, *panel, k_outer, k_inner, i_reg, j_vec, j_lane)
        accumulator_at = j_panel if j_panel is not None else i_block
        accumulator_rows = mr
    accumulator = sch.cache_write(main, 0, accumulator_scope(accumulator_rows * nr,
                                                             shape.dtype))
    sch.reverse_compute_at(accumulator, accumulator_at, preserve_unit_loops=True)
    keep = rows.names if rows is not None else frozenset()
    _inline_consumers(sch, accumulator, padded=bool(pad_m or pad_n), keep=keep)
    leftover = bool(pad_m or pad_n) and any(sch.get(c).name_hint not in keep
                                            for c in _all_consumers(sch, accumulator))
    if rows is None:
        tile = sch.fuse(s, *outer)
        sch.parallel(tile)
        schedule_leftover_consumers(sch, accumulator, target)
    elif not leftover:  # (with a leftover pass the caller refuses the schedule)
        sch.parallel(rows.join(sch, sch.fuse(s, outer[0])))
    sch.unroll(i_reg)
    sch.unroll(j_vec)
    sch.vectorize(j_lane)
    _vectorize_inner(sch, accumulator, lanes)
    if accumulator_rows == mr:
        _unroll_register_block(sch, accumulator, mr, nr // lanes)
    init = sch.decompose_reduction(main, k_outer)
    _vectorize_inner(sch, init, lanes)
    if tiling.kc >= shape.k and rows is None and b_block is not None:
        sch = _prefetch_following_tile(sch, tile, i_block, j_panel, k_inner, b_block,
                                       shape.batch, tiling, cache_sizes(target))
    if pad_m and a_in_place:
        sch = s_tir.Schedule(clamp_padded_rows(sch.mod["main"]))
    return sch, leftover


def clamp_padded_rows(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Read A's padded rows as its last row instead of as zeros: every
    `if_then_else(i < M, A[..i..], 0)` (what pad_einsum's padding of A becomes once inlined
    into the micro-kernel) is replaced by `A[..min(i, M - 1)..]`, so no zero-padded copy of A
    is made at every call, and no branch is left in the micro-kernel.
    Why it is correct: in the einsum form row i of the accumulator is computed from row i of
    A alone (I is an axis of A and C only), and the rows i >= M of the padded accumulator are
    never written back (pad_einsum's crop, `T.where(i < M)`, guards the write-back and the
    epilogue folded into it); so the values those rows read do not matter, and min(i, M - 1)
    keeps every read inside A. Measured (Emerald Rapids, 2 cores, one process, alternating):
    ViT's 197 x 384 . 384 x 384 (11 x 2 blocks, M padded to 198) 217 -> 187 us, as fast as
    198 rows with nothing padded (187 us)."""
    return _ClampRows().rewrite(func)


IF_THEN_ELSE = ir.Op.get("prim.if_then_else")  # TVM 0.27's name of tirx.if_then_else


class _ClampRows(ExprRewriter):
    """`clamp_padded_rows`'s rewrite of one guarded load."""

    def visit(self, e: tirx.Expr) -> tirx.Expr:
        if not (isinstance(e, ir.Call) and e.op.same_as(IF_THEN_ELSE)):
            return e
        cond, then, other = e.args
        if not (isinstance(cond, tirx.LT) and isinstance(cond.a, tirx.Var)
                and isinstance(cond.b, tirx.IntImm) and isinstance(then, ir.TensorLoad)
                and isinstance(other, (tirx.FloatImm, tirx.IntImm)) and other.value == 0):
            return e
        row = cond.a
        clamped = tirx.Min(row, cond.b - 1)
        return tirx.BufferLoad(then.source, [structural_map(
            i, [(ir.Var, lambda v: clamped if v.same_as(row) else v)]) for i in then.indices])


def _prefetch_following_tile(sch: s_tir.Schedule, tile: s_tir.schedule.LoopRV,
                             i_block: s_tir.schedule.LoopRV,
                             j_panel: s_tir.schedule.LoopRV | None, k: s_tir.schedule.LoopRV,
                             b_block: s_tir.schedule.SBlockRV, batch: int, tiling: Tiling,
                             caches: CacheSizes) -> s_tir.Schedule:
    """Step 5 (`prefetch`): the panels of B that the core's next tile reads are prefetched
    over this tile's row blocks and k steps (panel p of this tile's group, `j_panel`, the
    next group's panel p). The parallel loop runs the tiles (s, i, g) with rows outer, every
    tile then reading a new group (that of tile t + 1), or (s, g, i) with columns outer,
    where the tiles of one group follow each other (its I tiles share the prefetch of the
    next group), as they also do with rows outer when there is one group per batch."""
    panels = sch.get(b_block).writes[0].source  # [S, J/nr, K, nr]: S is never broadcast
    dims = [int(d) for d in panels.shape]
    size = tvm.runtime.DataType(panels.dtype).bits // 8
    group = tiling.panels if j_panel is not None else 1
    groups = dims[1] // group  # column tiles per batch
    row_tiles = int(sch.get(tile).extent) // (batch * groups)
    if dims[0] != batch or dims[1] % group or batch * groups < 2 or \
            not prefetch_fits(group * math.prod(dims[2:]) * size, math.prod(dims) * size,
                              caches):
        return sch
    t = sch.get(tile).loop_var
    blocks = tiling.mc // tiling.block.mr
    if tiling.columns_outer or groups == 1:  # t = (s * G + g) * I + i
        following, tile_share = next_panel_of_tile(t, row_tiles, batch * groups)
        share = tile_share * blocks + sch.get(i_block).loop_var
        shares = row_tiles * blocks
    else:  # t = (s * I + i) * G + g: the group of tile t + 1
        nxt = t + tirx.const(1, str(t.ty.dtype))
        following = tirx.floormod(tirx.floordiv(nxt, row_tiles * groups), batch) * groups \
            + tirx.floormod(nxt, groups)
        share, shares = sch.get(i_block).loop_var, blocks
    column = tirx.floormod(following, groups) * group
    if j_panel is not None:
        column = column + sch.get(j_panel).loop_var
    return hinted_schedule(sch, prefetch_next_panel(
        sch.mod["main"], sch.get(k).loop_var, panels,
        [tirx.floordiv(following, groups), column], share, shares))


def _producer_of(sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, read: int
                 ) -> s_tir.schedule.SBlockRV | None:
    """The block that writes the buffer of `main`'s read number `read` (its reindex)."""
    buffer = sch.get(main).reads[read].source
    return next((p for p in sch.get_producers(main)
                 if sch.get(p).writes[0].source.same_as(buffer)), None)


def _operand_blocks(sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, a_read: int
                    ) -> tuple[s_tir.schedule.SBlockRV, s_tir.schedule.SBlockRV]:
    """After normalisation (and padding), the blocks that produce the reduction's A and B,
    each with its reindex folded into its pad block, so that one block reads the original
    operand (the caller packs, copies or inlines it)."""
    stmt = sch.get(main)
    a_buf, b_buf = stmt.reads[a_read].source, stmt.reads[1 - a_read].source
    producers = {sch.get(p).writes[0].source.name: p for p in sch.get_producers(main)}
    a_block, b_block = producers[a_buf.name], producers[b_buf.name]
    for block in (a_block, b_block):  # pad block <- reindex block: fold the reindex in
        _inline_producers(sch, block)
    return a_block, b_block


def _schedule_pack(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, nr: int,
                   lanes: int) -> None:
    """Loops of the B pack (S, J, K): panels in parallel, K, then the nr columns vectorised,
    so each panel row is written as whole vectors."""
    s, j, k = sch.get_loops(block)
    j_panel, j_vec, j_lane = sch.split(j, [None, nr // lanes, lanes])
    sch.reorder(s, j_panel, k, j_vec, j_lane)
    sch.parallel(sch.fuse(s, j_panel))
    sch.vectorize(j_lane)


def _schedule_copy(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """A's zero-padding copy: rows in parallel, K vectorised when it is a multiple of lanes."""
    loops = sch.get_loops(block)
    sch.parallel(sch.fuse(*loops[:-1]))
    _vectorize_inner(sch, block, lanes)


def _unroll_register_block(sch: s_tir.Schedule, write_back: s_tir.schedule.SBlockRV, mr: int,
                           vectors: int) -> None:
    """Unroll the write-back of a register block (its mr rows and `vectors` vectors; the
    lanes are vectorised): every access to the `local` accumulator then has a constant
    index, and LLVM keeps it in registers from the init to the store into C. A write-back
    loop with a variable index made LLVM give the accumulator a stack array: zeroed by a
    memset call, stored after the k loop and loaded again for the write-back, every register
    block: ViT's 6x(197x64 . 64x197) (K = 64) 146 -> 130 us; BERT 5.41 -> 5.25 ms, ViT 2.57 ->
    2.52 ms (one process, alternating)."""
    for loop in sch.get_loops(write_back)[-3:-1]:
        if _static(sch.get(loop).extent) in (mr, vectors) and _static(sch.get(loop).extent) > 1:
            sch.unroll(loop)


def _vectorize_inner(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int) -> None:
    """Vectorise the innermost loop of `block` by `lanes` when it divides the extent."""
    inner = sch.get_loops(block)[-1]
    extent = _static(sch.get(inner).extent)
    if extent is None or extent % lanes:
        return
    _, lane = sch.split(inner, [None, lanes])
    sch.vectorize(lane)
