"""Tile propagation (Welder §3.1, "Propagate"): from an output tile to every tensor's tile.

Within a PrimFunc the blocks are visited from the last to the first. For each block, the region
still needed of the buffer it writes fixes the domain of the block's iteration variables (a write
index that is one iteration variable plus a constant maps the region directly; anything else gets
the variable's full domain, a conservative bound). Reduction variables take their full domain or
one reduction step. Every read region is then bounded with TVM's interval analysis
(`Analyzer.int_set`) over those domains, and the bounds are united per buffer.

Tile origins stay symbolic (`t_d * tile_d`, with `t_d` the tile index along output dimension d), so
the extent of a region is exact whenever it does not depend on where the tile sits (matmul, conv
with stride and padding, pooling, transpose, row reductions); otherwise (irregular accesses such as
`i // 3`) the largest extent over all tile positions is taken, again a conservative bound.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import tvm
from tvm import s_tir, tirx
from tvm.ir import Range


@dataclass(frozen=True)
class Region:
    """Bounds of a tile of one buffer: inclusive symbolic lower/upper corner per dimension."""

    lo: tuple
    hi: tuple


def leaf_block_rvs(sch: s_tir.Schedule) -> list:
    """The schedule's compute blocks (no child blocks) in program order, as block RVs."""
    out = []

    def visit(rv) -> None:
        for child in sch.get_child_blocks(rv):
            if len(sch.get_child_blocks(child)):
                visit(child)
            else:
                out.append(child)

    visit(sch.get_sblock("root"))
    return out


@functools.lru_cache(maxsize=512)
def leaf_blocks(func: tirx.PrimFunc) -> tuple[s_tir.SBlock, ...]:
    """The func's compute blocks in program order (the root block excluded)."""
    sch = s_tir.Schedule(func)
    return tuple(sch.get(rv) for rv in leaf_block_rvs(sch))


class Propagator:
    """Symbolic tile bounds for one output tile; shared by all funcs of one tile-graph."""

    def __init__(self, out_shape: Sequence[int], tile: Sequence[int], dtype: str = "int64"):
        if len(out_shape) != len(tile):
            raise ValueError(f"tile {tuple(tile)} does not match output shape {tuple(out_shape)}")
        self.analyzer = tvm.sym.Analyzer()
        self.tile_vars = []
        for d, (dim, size) in enumerate(zip(out_shape, tile)):
            var = tirx.Var(f"t{d}", dtype)
            count = -(-int(dim) // int(size))
            self.analyzer.bind(var, Range.from_min_extent(tirx.const(0, dtype),
                                                          tirx.const(count, dtype)))
            self.tile_vars.append(var)
        self.out_region = Region(
            tuple(tirx.const(int(s), dtype) * v for v, s in zip(self.tile_vars, tile)),
            tuple(tirx.const(int(s), dtype) * v + tirx.const(int(s) - 1, dtype)
                  for v, s in zip(self.tile_vars, tile)),
        )

    # ----------------------------------------------------------------------------- regions
    def simplify(self, expr):
        return self.analyzer.simplify(expr)

    def extent(self, region: Region, shape: Sequence[int]) -> tuple[int, ...]:
        """Concrete extents of a region, clamped to the buffer; worst case over tile positions."""
        out = []
        for lo, hi, dim in zip(region.lo, region.hi, shape):
            ext = self.simplify(hi - lo + 1)
            if not isinstance(ext, tirx.IntImm):
                ext = self.analyzer.const_int_bound(ext).max_value
            else:
                ext = ext.value
            out.append(int(max(1, min(int(dim), ext))))
        return tuple(out)

    def union(self, a: Region | None, b: Region) -> Region:
        if a is None:
            return b
        lo = tuple(self.simplify(tirx.min(x, y)) for x, y in zip(a.lo, b.lo))
        hi = tuple(self.simplify(tirx.max(x, y)) for x, y in zip(a.hi, b.hi))
        return Region(lo, hi)

    # ------------------------------------------------------------------------------- funcs
    def propagate_func(
        self,
        func: tirx.PrimFunc,
        out_buffer: tirx.Buffer,
        out_region: Region,
        rstep: int | None = None,
    ) -> dict[tirx.Buffer, Region]:
        """Regions of every buffer of `func` needed to produce `out_region` of `out_buffer`.

        `rstep` bounds each reduction variable to one step of that many iterations (used for the
        footprint of a tile; traffic always covers the full reduction).
        """
        need: dict[tirx.Buffer, Region] = {out_buffer: out_region}
        for block in reversed(leaf_blocks(func)):
            written = [w for w in block.writes if w.source in need]
            if not written:
                continue
            dom = self._iter_domains(block, written, need, rstep)
            for read in block.reads:
                lo, hi = [], []
                for rng in read.region:
                    lo.append(self.analyzer.int_set(rng.min, dom).min_value)
                    hi.append(self.analyzer.int_set(rng.min + rng.extent - 1, dom).max_value)
                region = Region(tuple(self.simplify(x) for x in lo),
                                tuple(self.simplify(x) for x in hi))
                need[read.source] = self.union(need.get(read.source), region)
        return need

    def _iter_domains(self, block, written, need, rstep):
        dom = {}
        for write in written:
            region = need[write.source]
            for rng, lo, hi in zip(write.region, region.lo, region.hi):
                var, offset = _var_plus_const(rng.min)
                if var is None or var in dom or not _is_one(rng.extent):
                    continue
                dom[var] = tvm.sym.IntervalSet(self.simplify(lo - offset),
                                               self.simplify(hi - offset))
        for iv in block.iter_vars:
            if iv.var in dom:
                continue
            lo = iv.dom.min
            ext = iv.dom.extent
            if rstep is not None and iv.iter_type == tirx.IterVar.CommReduce:
                ext = tirx.min(ext, rstep)
            dom[iv.var] = tvm.sym.IntervalSet(lo, self.simplify(lo + ext - 1))
        return dom


def _is_one(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and expr.value == 1


def _var_plus_const(expr):
    """(v, c) when expr is `v`, `v + c` or `v - c` for a variable v and integer c."""
    if isinstance(expr, tirx.Var):
        return expr, 0
    if isinstance(expr, (tirx.Add, tirx.Sub)) and isinstance(expr.a, tirx.Var) and isinstance(
        expr.b, tirx.IntImm
    ):
        return expr.a, (expr.b.value if isinstance(expr, tirx.Add) else -expr.b.value)
    return None, 0
