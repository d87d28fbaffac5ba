"""Analytic CPU schedule for a GEMM whose output rows feed row-wise reductions: LayerNorm after
a projection (+ bias + residual), softmax after attention scores.

What it matches
---------------
A PrimFunc (a group TileGraphFusion merged) with one GEMM-class reduction (`gemm.analyse`'s
einsum form) and, downstream of it, row reductions over the last axis of the GEMM's output
(`injective.is_row_reduction`: sums, maxima) with the blocks that consume them: the
"row part", every block downstream of such a reduction, and the reductions themselves.
The GEMM's output must be laid out [S..., I..., J] (batch axes, then rows, then the N columns
the rows reduce over), N a whole number of vectors (the row part then vectorises without a
predicate), M a multiple of a register block's rows, static shapes. Anything else: None.

The schedule
------------
One parallel loop over tiles of whole rows (S x M / mc of them). Tile t first computes its
mc rows of the GEMM, every column panel of them, with the GEMM rule's micro-kernel, packed B
and its epilogue (bias, residual add) folded into the write-back (`gemm._schedule_tiles`
with `row_part`); then the row part for the same mc rows, as the reduction rule schedules a
row (`reduction.schedule_rows`: vector accumulators, vectorised spatial blocks). The rows
are then still in the core's L1/L2 (mc x N was sized to fit half of L2 with A's block:
`row_tiling`), written and read back by one core. Unfused, the GEMM splits columns across
cores and the LayerNorm rows across cores: half of every row comes from the other core's
cache (BERT's LayerNorm after its projection: 20-22 us in the model, 9-11 us alone).

Why it is correct
-----------------
- The GEMM part and the row part are each scheduled by primitives that check their own
  preconditions (see gemm.py and reduction.py); a refusal returns None.
- The two loops are joined by `merge`, which checks no dependences, so this is argued here:
  the GEMM tile loop is fuse(s, i_tile) (index t = s * M/mc + i_tile) and each of its
  iterations writes rows i_tile*mc .. +mc of batch s, every column (the column loop is inside
  the tile). The row loop is fuse of the row part's leading axes, which index the GEMM
  output's leading axes in order ([S..., I...] checked, row-major), so row r = s * M + i, and
  split by mc its outer index is r // mc = s * M/mc + i // mc (mc divides M): the same t.
  Row r's blocks read only row r of the GEMM output, parameters and their own row's
  intermediates (compute_at under the row loop placed them by their regions). So iteration t
  of the merged loop computes its rows of the GEMM, then reads only those: the order the
  original program had for those elements; different t touch disjoint rows and
  intermediates, so the merged loop may run in parallel.
- The planner checks every fused group against the unfused kernels on random inputs before
  it replaces them (`fusion.check_group`).
"""
from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.matmul import IterKind
from tvm.target import Target

from . import gemm
from .injective import (cpu_params, inline_spatial, is_gemm_like, is_param, is_reduction,
                        is_row_reduction, loop_extent)
from .isa import vector_isa
from .reduction import _calls_expensive, _consumers, row_count, schedule_rows


def find_gemm_with_rows(sch: s_tir.Schedule) -> s_tir.schedule.SBlockRV | None:
    """The GEMM-class block of a function whose other reductions are row reductions fed by
    it, and whose other blocks are spatial; None otherwise (or without a row reduction)."""
    try:
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except (RuntimeError, ValueError):
        return None
    stmts = [sch.get(b) for b in blocks]
    contractions = [b for b, s in zip(blocks, stmts) if is_gemm_like(s)]
    if len(contractions) != 1:
        return None
    main = contractions[0]
    downstream = {sch.get(c).name_hint for c in gemm._all_consumers(sch, main)}
    rows = [s for s in stmts if is_reduction(s) and not s.same_as(sch.get(main))]
    if not rows or any(not is_row_reduction(s) or s.name_hint not in downstream for s in rows):
        return None
    if any(not is_reduction(s) and not gemm._is_spatial(s) for s in stmts):
        return None
    return main


def row_part(sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV) -> list[str]:
    """Names, in program order, of the row reductions after `main` and every block
    downstream of one of them."""
    names: set = set()
    for block in gemm._all_consumers(sch, main):
        if is_reduction(sch.get(block)):
            names.add(sch.get(block).name_hint)
            names.update(sch.get(c).name_hint for c in gemm._all_consumers(sch, block))
    order = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    return [n for n in order if n in names]


def row_tiling(target: Target, shape: gemm.GemmShape) -> gemm.Tiling | None:
    """Register block and whole-row tiles for a GEMM with a row epilogue: mc rows (a multiple
    of the block's rows dividing M, so no row is padded) whose block of A and whose mc x N
    rows of C together take at most half of L2 (the row part reads them back there), the
    fewest rows on the busiest core, then the largest mc (each tile reads all of B); the
    register block with the fewest modelled cycles (`gemm.micro_cycles`) on that core.
    None when no register block's rows divide M, or when B (per batch element) does not fit
    half of L2 and there are several cores: whole-row tiles then make every core stream all
    of B, where the GEMM alone splits its columns between the cores, each keeping its half
    (BERT's projection 128x768 . 768x768 + LayerNorm on 2 cores with 2 MiB L2: 727 us fused
    against 555 us for the two kernels, one process, alternating; its attention scores
    12x(128x64 . 64x128) + softmax, B 32 KiB a head: 126 us either way)."""
    isa, caches, cores = vector_isa(target), gemm.cache_sizes(target), gemm.target_cores(target)
    size = tvm.runtime.DataType(shape.dtype).bits // 8
    batch, m, n, k = shape.batch, shape.m, shape.n, shape.k
    if cores > 1 and n * k * size > caches.l2 // 2:
        return None
    best = None
    for block in gemm.register_blocks(isa, shape.dtype, m, n):
        if m % block.mr:
            continue
        kc = gemm.k_block(block, caches, size, k)
        limit = caches.l2 // 2 // ((kc + n) * size)
        if kc < k:
            limit = min(limit, caches.l1 // 2 // (block.nr * size))
        sizes = [mc for mc in range(block.mr, min(m, limit) + 1, block.mr) if m % mc == 0]
        if not sizes:
            continue

        def busiest(mc: int) -> int:  # rows the busiest core computes
            return math.ceil(batch * (m // mc) / cores) * mc

        mc = min(sizes, key=lambda rows: (busiest(rows), -rows))
        cycles = busiest(mc) // block.mr * math.ceil(n / block.nr) * \
            gemm.micro_cycles(isa, block.mr, block.vectors)
        key = (cycles, -block.mr * block.vectors)
        if best is None or key < best[0]:
            best = (key, gemm.Tiling(block, mc, kc))
    return best[1] if best else None


def _rows_in_order(block: s_tir.SBlock, shape: gemm.GemmShape) -> bool:
    """The GEMM's output (`block`'s, in `analyse`'s orientation) is [S..., I..., J] (extent-1
    axes anywhere): its leading axes, read row-major, are the normalised row s * M + i, and
    its last axis is J."""
    maps = gemm.gemm_index_maps(block, shape.a_read)
    if maps is None:
        return False
    kinds = [kind for kind in maps.c_kinds if kind != IterKind.kIter_T]
    order = {IterKind.kIter_S: 0, IterKind.kIter_I: 1, IterKind.kIter_J: 2}
    return bool(kinds) and kinds[-1] == IterKind.kIter_J and \
        maps.c_kinds[-1] == IterKind.kIter_J and kinds.count(IterKind.kIter_J) == 1 and \
        [order.get(kind, 3) for kind in kinds] == sorted(order.get(kind, 3) for kind in kinds)


def _epilogue_pointwise(sch: s_tir.Schedule, main: s_tir.schedule.SBlockRV, names: list
                        ) -> bool:
    """Every block between the GEMM and the row part (bias, residual add, scale) is
    element-wise in the GEMM output's own layout: it writes, and reads what the GEMM or
    another of them computed, at exactly its axes in order. So the buffer the row part reads
    has the GEMM output's layout, whose row order `_rows_in_order` checks (a transpose here
    would lay the rows out in another order than the tile loop computes them)."""
    out = sch.get(main).writes[0].source
    epilogue = [sch.get(b) for b in gemm._all_consumers(sch, main)
                if sch.get(b).name_hint not in names]
    chain = {out.name} | {w.source.name for b in epilogue for w in b.writes}
    for block in epilogue:
        axes = [iv.var for iv in block.iter_vars]
        if len(block.writes) != 1 or [int(d) for d in block.writes[0].source.shape] != \
                [int(d) for d in out.shape] or not _at_axes(block.writes[0], axes):
            return False
        if any(not _at_axes(r, axes) for r in block.reads if r.source.name in chain):
            return False
    return True


def _at_axes(region, axes: list) -> bool:
    """`region` is one element at exactly `axes`, in order."""
    ranges = list(region.region)
    return len(ranges) == len(axes) and all(
        isinstance(r.min, tirx.Var) and r.min.same_as(v) and int(r.extent) == 1
        for r, v in zip(ranges, axes))


def schedule_gemm_rows(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """Schedule a GEMM with a row epilogue (see the module docstring); None if `func` is not
    one or a step refuses."""
    first = s_tir.Schedule(func)
    main = find_gemm_with_rows(first)
    if main is None:
        return None
    names = row_part(first, main)
    gemm_block = first.get(main)
    if not _epilogue_pointwise(first, main, names):
        return None
    found = gemm.analyse(func, find_gemm_with_rows)
    if found is None:
        return None
    sch, main, shape = found
    params = cpu_params(target)
    if shape.n % params.lanes(shape.dtype) or not _rows_in_order(gemm_block, shape):
        return None
    tiling = row_tiling(target, shape)
    if tiling is None:
        return None

    def join(sch: s_tir.Schedule, tile: s_tir.schedule.LoopRV) -> s_tir.schedule.LoopRV:
        row = _schedule_row_part(sch, func, names, shape, params)
        outer, _ = sch.split(row, [None, tiling.mc])
        return sch.merge(tile, outer)

    try:
        sch, leftover = gemm._schedule_tiles(sch, main, shape, tiling, func, target,
                                             gemm.RowEpilogue(frozenset(names), join))
    except ValueError:  # the row part is not the GEMM's rows (`_schedule_row_part`)
        return None
    return None if leftover else sch


def _schedule_row_part(sch: s_tir.Schedule, func: tirx.PrimFunc, names: list,
                       shape: gemm.GemmShape, params) -> s_tir.schedule.LoopRV:
    """The row part in a serial row loop over the GEMM's batch x M rows (`schedule_rows`),
    its spatial intermediates inlined first as the reduction rule does (an exp feeding two
    blocks is computed once per row); the GEMM's blocks are left as they are. Raises
    ValueError where the row part is not one output indexed by the GEMM's rows."""
    inline_spatial(sch, func, keep=lambda b: b.name_hint not in names or (
        _calls_expensive(b) and _consumers(sch, b) > 1))
    present = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    names = [n for n in names if n in present]
    blocks = [sch.get(sch.get_sblock(n)) for n in names]
    anchor = blocks[-1]
    if is_reduction(anchor):  # (the row part ends in a spatial block: a norm or softmax)
        raise ValueError("the row part ends in a reduction")
    rows = row_count(sch, names, func)
    if rows == 0:
        raise ValueError("the row part is not one output")
    extents = [int(iv.dom.extent) for iv in anchor.iter_vars[:rows]]
    if rows != len(anchor.iter_vars) - 1 or math.prod(extents) != shape.batch * shape.m or \
            not all(_row_aligned(b, rows, extents, func) for b in blocks):
        raise ValueError("the row part's rows are not the GEMM's")
    row = schedule_rows(sch, names, rows, params)
    if row is None or loop_extent(sch, row) != shape.batch * shape.m:
        raise ValueError("the row part did not make one row loop")
    return row


def _row_aligned(block: s_tir.SBlock, rows: int, extents: list, func: tirx.PrimFunc) -> bool:
    """`block`'s first `rows` axes are spatial with the anchor's extents, and every buffer
    it reads or writes that is not a parameter (the GEMM's output, the row part's
    intermediates) it indexes by exactly those axes, in order, in its leading dimensions:
    row r of the block touches row r of each, which is what the join relies on (a row part
    reading the GEMM's output transposed would read other tiles' rows)."""
    axes = block.iter_vars[:rows]
    if len(axes) != rows or any(int(iv.iter_type) != tirx.IterVar.DataPar
                                or int(iv.dom.extent) != e for iv, e in zip(axes, extents)):
        return False
    for region in [*block.reads, *block.writes]:
        if is_param(region.source, func):
            continue
        lead = list(region.region)[:rows]
        if len(lead) != rows or any(not (isinstance(r.min, tirx.Var) and r.min.same_as(iv.var)
                                         and int(r.extent) == 1) for r, iv in zip(lead, axes)):
            return False
    return True


class GemmRows(gemm.AnalyticRule):
    """The rule: `apply(func, target, tunable)` returns a Schedule or None."""

    @staticmethod
    def schedule(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
        return schedule_gemm_rows(func, target)
