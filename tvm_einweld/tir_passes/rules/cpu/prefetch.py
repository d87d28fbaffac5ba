"""Software prefetch of the next parallel tile's weight panel, spread over the current tile.

Why
---
The GEMM and convolution rules pack constant weights into panels (a GEMM's K x nr columns of
B, a convolution's mr output channels) and run each parallel tile on one panel (or a group of
panels), its register blocks (GEMM rows, convolution positions) one after another, each over
the whole reduction. The tile's first register block reads the panel from beyond L2, the
others from L2. Where the weights come from DRAM (in a model, other layers have evicted them
from a shared L3), that first block asks for the whole panel at once while it computes only
its share of the tile: it waits on memory, the others do not. Measured on an Intel Xeon
(Emerald Rapids, 2 cores), old and new modules alternating in one process:

- eight 512 -> 512 3x3 convolutions at 7x7 in a chain (75 MB of weights): 1021 us per
  convolution against 762 us for one alone; with the prefetch 792 us (one alone: 719 us);
  ResNet-18 in the einweld pipeline 12.2 -> 11.1 ms (its three such convolutions 1.07 ->
  0.77 ms each, in two runs of a VM profile);
- six BERT FFN pairs 128x768 . 768x3072 . 3072x768 in a chain (113 MB): 5.0 -> 4.0 ms per
  pair (one pair alone: 4.04 -> 3.83 ms).

What it does
------------
Inside the kernel's reduction loop over the panel's rows (a convolution's input channels, a
GEMM's k), `prefetch_next_panel` adds prefetches (`tirx.prefetch` into L2: LLVM's
`llvm.prefetch` with locality 2, `prefetcht1` on x86) of the panel the same core runs next, so
that it streams in at the pace the current one is used. Two modes, by the lines of a panel row:

- at least as many lines as the tile has register blocks (a convolution's row: kh * kw * mr
  values): each block prefetches its share of the lines of the row it reads, in the next
  panel, at each step; the address moves only with the step, the rest is loop-invariant;
- fewer (a GEMM's row: nr values, 1-2 lines): one line per step, the blocks and steps walking
  the next panel's lines in order. (Each block its share of a row would leave all but the
  first blocks idle: the panel then came in 5x faster than it was used, and the BERT chain
  above ran 4.5 ms per pair instead of 4.0.)

The panel the same core runs next is the following iteration of the parallel loop: TVM's
parallel-for hands each thread one contiguous chunk of the iterations; at a chunk's end one
panel's prefetch is wasted. Prefetching a tile's whole share at its top instead of spreading
it over the steps measured 15 % slower than no prefetch (the prefetches fill the line-fill
buffers and stall). `prefetch_fits` says when: the weights do not stay in L2 anyway, and the
current and the next panel fit in L2 together.

Why it is correct
-----------------
A prefetch is a hint with no architectural effect: it reads nothing into a register and never
faults. Every address is inside the panel buffer (the next panel's index is taken modulo the
panel count, the element within the panel clamped to the panel's last), so the pointer
arithmetic stays inside the allocation. The kernel's loads, stores and their order are
unchanged, so it computes exactly what it computed before. The function is rewritten after
scheduling (no schedule primitive inserts a statement), so the returned Schedule has no trace
of its own: callers use its module, as they do for the fast-math post-pass.
"""
from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm_ffi import structural_mutate

from .isa import CACHE_LINE

# `tirx.prefetch` arguments after the address: read (0), locality 2 (into L2: the next panel
# must not evict the current block's lines from L1), data cache (1).
_READ, _LOCALITY_L2, _DATA = 0, 2, 1


def prefetch_fits(panel_bytes: int, panels_bytes: int, caches) -> bool:
    """Whether to prefetch (`caches`: a `gemm.CacheSizes`): the panels together
    (`panels_bytes`) do not stay in half of L2 from one call to the next, so they come from
    beyond it, and the current panel and the next (`panel_bytes` each) fit three quarters of L2
    together, leaving room for the other operand and the output (else the prefetched lines
    would evict the current panel's before its last block)."""
    return panels_bytes > caches.l2 // 2 and 2 * panel_bytes <= caches.l2 * 3 // 4


def _unflatten(index: tirx.PrimExpr, shape: list[int]) -> list[tirx.PrimExpr]:
    """Row-major multi-dimensional indices of element `index` of a buffer of `shape`."""
    indices = []
    for extent in reversed(shape):
        indices.append(tirx.floormod(index, extent))
        index = tirx.floordiv(index, extent)
    return list(reversed(indices))


def _as(expr: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    return expr if str(expr.ty.dtype) == dtype else tirx.Cast(dtype, expr)


def next_panel_of_tile(tile_var: tirx.Var, tiles_per_panel: int, count: int
                       ) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
    """(next panel, share) for a parallel loop whose iteration t works on panel
    (t // tiles_per_panel) % count as its (t % tiles_per_panel)-th tile."""
    dtype = str(tile_var.ty.dtype)
    per = tirx.const(tiles_per_panel, dtype)
    return (tirx.floormod(tirx.floordiv(tile_var, per) + tirx.const(1, dtype),
                          tirx.const(count, dtype)),
            tirx.floormod(tile_var, per))


def prefetch_next_panel(func: tirx.PrimFunc, step_var: tirx.Var, panels: tirx.Buffer,
                        following: list[tirx.PrimExpr], share: tirx.PrimExpr, shares: int
                        ) -> tirx.PrimFunc:
    """`func` with the prefetches of the module docstring. `panels` is [*panel axes, steps,
    ...] (row-major) and the loop over `step_var` (extent `steps`) reads row [panel, step] at
    step `step`; `following` (indices of the panel axes) is the panel the core runs next and
    `share`, one of `shares`, the register block (or tile) of the current panel that this run
    of the loop is: both expressions of the loops around it. Unchanged if no such loop is
    found."""
    shape = [int(d) for d in panels.shape]
    lead = len(following)
    if len(shape) < lead + 2:
        return func
    steps, rest = shape[lead], shape[lead + 1:]
    row = math.prod(rest)
    per_line = max(1, CACHE_LINE // (tvm.runtime.DataType(panels.dtype).bits // 8))
    row_lines = math.ceil(row / per_line)
    walk = row_lines < shares  # the second mode of the module docstring
    lines = 1 if walk else math.ceil(row_lines / shares)  # per share and step
    dtype = str(step_var.ty.dtype)
    c = lambda v: tirx.const(v, dtype)  # noqa: E731

    def hints(step: tirx.Var) -> tirx.Stmt:
        j = tirx.Var("prefetch_line", dtype)
        if walk:  # one line a step, shares and steps walking the panel's lines in order
            total = math.ceil(steps * row / per_line)
            line = tirx.floordiv((_as(share, dtype) * c(steps) + step) * c(total),
                                 c(shares * steps))
            element = tirx.min(line * c(per_line), c(steps * row - 1))
            inner = _unflatten(element, [steps, *rest])
        else:  # each share its lines of every row
            element = tirx.min(_as(share, dtype) * c(lines * per_line) + j * c(per_line),
                               c(row - 1))
            inner = [step, *_unflatten(element, rest)]
        address = tirx.address_of(tirx.BufferLoad(
            panels, [*(_as(f, dtype) for f in following), *inner]))
        hint = tirx.call_intrin("void", "tirx.prefetch", address, _READ, _LOCALITY_L2, _DATA)
        return tirx.For(j, c(0), c(lines), tirx.ForKind.UNROLLED, tirx.Evaluate(hint))

    found = []

    def visit(node, mutator):
        node = mutator.default_mutate(node)
        if not node.loop_var.same_as(step_var) or not isinstance(node.extent, tirx.IntImm) \
                or int(node.extent) != steps:
            return node
        found.append(node)
        return tirx.For(node.loop_var, node.min, node.extent, node.kind,
                        tirx.SeqStmt([hints(node.loop_var), node.body]),
                        node.thread_binding, node.annotations)

    result = structural_mutate(func, [(tirx.For, visit)])
    return result if found else func


def hinted_schedule(sch: s_tir.Schedule, hinted: tirx.PrimFunc) -> s_tir.Schedule:
    """A Schedule of `hinted` (`sch`'s function with `prefetch_next_panel`'s hints), or `sch`
    itself where TVM 0.27 refuses the hinted function: a copy made in loop_partition's
    pieces (rows of positions whose ends are partial vectors) defines a block's variables
    twice, which TVM lowers but schedules no further (`rules._schedulable`). The kernel
    then runs without the hints instead of its whole rule failing (a 15x1 convolution
    512 -> 42 at 12x20 had lost its schedule so)."""
    try:
        return s_tir.Schedule(hinted)
    except tvm.error.InternalError:
        return sch
