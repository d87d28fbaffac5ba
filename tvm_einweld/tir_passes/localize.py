"""LocalizeIntermediates: global intermediates of a fused kernel become per-tile buffers.

After `codegen.schedule_group` every producer of a fused group is computed at the tile loop, but
the intermediates are still allocated at full size in global memory at the root of the PrimFunc.
This pass

1. retags each intermediate buffer (every global buffer allocated by the root block) with the scope of
   the connected memory level: `shared` on CUDA, `local` (a stack scratch buffer of the tile, hot
   in the core's cache) on CPU;
2. moves each allocation to the lowest loop that encloses all its accesses — the tile loop, since
   producers and consumers of an intermediate were both placed under it — and shrinks it to the
   region one tile touches (TVM's `PlanAndUpdateBufferAllocationLocation` and
   `CompactBufferAllocation` do the region arithmetic);
3. checks the result against the plan: no intermediate may remain at the root, and together they
   may not exceed the bytes the tile-graph model planned for the intermediate tiles of one tile.

It is correct because every access of an intermediate happens inside one iteration of the tile
loop (the tile loop's iterations write disjoint output tiles and recompute whatever halo they
need), so a buffer private to one iteration holding exactly the touched region is equivalent to
the global one; the retagging changes where the buffer lives, never which values it holds.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .propagate import leaf_block_rvs


class LocalizeError(RuntimeError):
    """An intermediate could not be made tile-local as planned."""


def allocations(func: tirx.PrimFunc) -> list[tuple[str, tirx.Buffer, int]]:
    """(block name, buffer, loop depth) of every buffer allocated by a block of `func`."""
    out = []

    def walk(stmt, depth):
        if stmt is None:
            return
        if isinstance(stmt, s_tir.SBlock):
            out.extend((stmt.name_hint, b, depth) for b in stmt.alloc_buffers)
        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                walk(s, depth)
            return
        nested = depth + 1 if isinstance(stmt, tirx.For) else depth
        for attr in ("block", "body", "init", "then_case", "else_case"):
            child = getattr(stmt, attr, None)
            if isinstance(child, tirx.Stmt):
                walk(child, nested)

    walk(func.body, 0)
    return out


def buffer_bytes(buffer: tirx.Buffer) -> int:
    """Bytes of `buffer` (a constant shape; elements of vector types, as lowered TIR has them,
    counted with all their lanes)."""
    element = tvm.runtime.DataType(str(buffer.dtype))
    count = 1
    for dim in buffer.shape:
        count *= int(dim)
    return count * element.bits * element.lanes // 8


def retag_intermediates(func: tirx.PrimFunc, scope: str) -> tirx.PrimFunc:
    """Give every root-allocated global buffer the storage scope `scope`.

    Buffers the schedule already placed elsewhere (a reduction's register accumulator) keep theirs.
    """
    sch = s_tir.Schedule(func)
    root_buffers = {b.name for b in sch.get(sch.get_sblock("root")).alloc_buffers
                    if b.scope() == "global"}
    for rv in leaf_block_rvs(sch):
        for index, write in enumerate(sch.get(rv).writes):
            if write.source.name in root_buffers:
                sch.set_scope(rv, index, scope)
    return sch.mod["main"]


def localize(func: tirx.PrimFunc, scope: str, planned_bytes: int | None = None
             ) -> tirx.PrimFunc:
    """Apply the rewrite described in the module docstring to one PrimFunc."""
    def root_globals(f):
        return [b.name for _, b, depth in allocations(f) if depth == 0 and b.scope() == "global"]

    original = root_globals(func)
    func = retag_intermediates(func, scope)
    # set_scope renames buffers (C -> C_local); the root keeps their order.
    renamed = dict(zip([b.name for _, b, depth in allocations(func)
                        if depth == 0 and b.scope() == scope], original))
    mod = tvm.IRModule({"main": func})
    # The stock lowering order: region compaction needs opaque blocks, which need inits lowered.
    mod = tvm.transform.Sequential([
        s_tir.transform.LowerInitBlock(),
        s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(),
        s_tir.transform.CompactBufferAllocation(),
    ])(mod)
    func = mod["main"]
    placed = {b.name: (b, depth) for _, b, depth in allocations(func)}
    total = 0
    for new_name, name in renamed.items():
        buffer, depth = placed.get(new_name, (None, 0))
        if buffer is None:
            continue  # removed as dead by the stock passes
        if depth == 0:
            raise LocalizeError(f"intermediate {name} is still allocated outside the tile loop")
        total += buffer_bytes(buffer)
    if planned_bytes is not None and total > planned_bytes:
        raise LocalizeError(f"the intermediates need {total} bytes per tile, the plan allowed "
                            f"{planned_bytes}")
    return func


def LocalizeIntermediates(scope: str, planned_bytes: int | None = None):
    """A `tvm.tirx` PrimFunc pass: intermediates of fused tile kernels become tile buffers.

    See the module docstring for what is rewritten and why it is correct. Functions without
    root-allocated intermediates are returned unchanged.
    """

    @tvm.tirx.transform.prim_func_pass(opt_level=0, name="LocalizeIntermediates")
    def _pass(func, _mod, _ctx):
        if not any(depth == 0 for _, _, depth in allocations(func)):
            return func
        return localize(func, scope, planned_bytes)

    return _pass
