"""Software prefetch of the next parallel tile's weight panel, spread over the current one.

Why
---
A GEMM-class kernel whose parallel tiles run channel (column) panel by panel reads each
panel of packed weights from beyond L2 once, in its first position tile, and from L2 in the
others. Where the weights come from DRAM or a shared L3 (in a model, after other layers have
evicted them: ResNet's 512 -> 512 convolutions at 7x7 hold 9.4 MB each), that first tile asks
for a whole panel at once (590 KiB for 32 channels) while it computes 1/7 of the panel's work:
it waits on memory, the others do not. Measured on an Intel Xeon (2 cores), a chain of 512-ch
7x7 convolutions: 776 us per convolution with 9.4 MB of weights, 1047 us with 75 MB (eight
convolutions, beyond what the L3 kept).

What it does
------------
Inside the kernel's reduction loop over the panel's rows (a conv's input channels, a GEMM's
k), `prefetch_next_panel` adds a few prefetches (`tirx.prefetch`, into L2: LLVM's
`llvm.prefetch` with locality 2, `prefetcht1` on x86) of the same row of the *next* panel,
each tile (or row block) of the panel its own share of the row's lines, so that the next
panel streams in at the pace the current one computes: the address moves only with the row,
everything else is loop-invariant. Where a row has fewer lines than there are shares (a
GEMM's K x nr panel, 2 lines a row, read by 10 row blocks), each step prefetches one line and
the shares and steps walk the panel's lines in order (with only the first shares busy, the
panel came in 5x faster than it was used, and a chain of BERT FFN GEMMs with its weights
beyond L3 ran 4.5 ms per pair instead of 4.0). The next panel is the one the same core runs next under
TVM's parallel-for, which hands each thread one contiguous chunk of the iterations; at a
chunk's end one panel's prefetch is wasted. Prefetching a whole tile's share at the top of
the tile instead measured 15 % slower than none (the prefetches fill the line-fill buffers
and stall the core); spread over the rows: the chain above 1047 -> 755 us per convolution,
and 776 -> 726 us with the weights in L3. `prefetch_fits` says when: the weights do not stay
in L2 anyway, and the current and the next panel fit in L2 together.

Why it is correct
-----------------
A prefetch is a hint with no architectural effect: it reads nothing into a register and never
faults. Every address is inside the panel buffer (the next panel's index is taken modulo the
panel count and the line within a row clamped to the row), so the pointer arithmetic stays
inside the allocation. The kernel's loads, stores and their order are
unchanged, so it computes exactly what it computed before.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import tvm
from tvm import tirx
from tvm_ffi import structural_mutate

if TYPE_CHECKING:
    from .gemm import CacheSizes

CACHE_LINE = 64
# `tirx.prefetch` arguments after the address: read (0), locality 2 (L2: the next panel must not
# evict the current one's L1-resident block), data cache (1).
_READ, _LOCALITY_L2, _DATA = 0, 2, 1


def prefetch_fits(panel_bytes: int, panels_bytes: int, caches: "CacheSizes") -> bool:
    """Whether to prefetch: the panels together (`panels_bytes`) do not stay in half of L2 from
    one call to the next, so some come from beyond it, and the current panel and the next fit
    three quarters of L2 together, leaving room for the other operand and the output (else the
    prefetched lines would evict the current panel's before its last tile)."""
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
    `share` (one of `shares`) which part of each row this run of the loop prefetches, both
    expressions of the loops around it. Unchanged if no such loop is found."""
    shape = [int(d) for d in panels.shape]
    lead = len(following)
    if len(shape) < lead + 2:
        return func
    steps, rest = shape[lead], shape[lead + 1:]
    row = math.prod(rest)
    per_line = max(1, CACHE_LINE // (tvm.runtime.DataType(panels.dtype).bits // 8))
    row_lines = math.ceil(row / per_line)
    lines = math.ceil(row_lines / shares)  # per share and step
    dtype = str(step_var.ty.dtype)
    c = lambda v: tirx.const(v, dtype)  # noqa: E731

    def hints(step: tirx.Var) -> tirx.Stmt:
        j = tirx.Var("prefetch_line", dtype)
        if row_lines >= shares:  # each share its lines of every row
            element = tirx.min(_as(share, dtype) * c(lines * per_line) + j * c(per_line),
                               c(row - 1))
            inner = [step, *_unflatten(element, rest)]
        else:
            # Fewer lines in a row than shares (a GEMM's K x nr panel: 2 lines a row): one
            # line a step, the shares and steps walking the panel's lines in order, so that
            # the panel streams in over the whole tile rather than in its first row blocks.
            line = tirx.floordiv((_as(share, dtype) * c(steps) + step) * c(row_lines), c(shares))
            element = tirx.min(line * c(per_line), c(steps * row - 1))
            inner = _unflatten(element, [steps, *rest])
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
