"""MemTraffic and MemFootprint of a tiled sub-graph (Welder §3.1, §4.1).

`propagate_subgraph` runs tile propagation through the nodes of a sub-graph (last node first) and
records, for one output tile, the tile of every tensor and of every buffer internal to a node.

* Traffic: one tile reads its input tiles from the level below and writes its output tile there;
  connected intermediates never leave the fast level. Each tile region is counted in whole
  transactions of the lower level (a row that is not contiguous costs its own transactions), and
  the sum is multiplied by the number of tiles.
* Footprint: every tile that is live at the fast level (inputs, intermediates, node-internal
  buffers, output), allocated best-fit in topological order with alignment; inputs that carry a
  reduction are streamed in steps of `rstep` along it. That is Welder's code generator, which
  stages inputs through shared memory. On CUDA the footprint is instead what tvm_einweld's
  code generator allocates there (`generated_footprint`): it reads inputs and writes the output
  in global memory, and keeps every connected intermediate and node-internal buffer of a tile
  whole in shared memory (each producer is computed at the tile loop, never in reduction
  steps), which the stepped count undercounted (MobileNetV2's inverted-residual group at tile
  1x8x2x14: 176,512 B modelled, 363,488 B in its tile buffers). The kernel generated is still
  checked against the device's limits after TVM's lowering (`codegen.cuda_kernel_problem`),
  which can change the buffers again: the model only ranks and prunes.
* Parallelism: a tile count that leaves parallel units idle in the last wave inflates the traffic
  by the inverse of the utilisation, so that tiles too large to keep the device busy lose.

`sub_tile_cost` prices one level further up (Welder's recursion of SubGraphTiling): one node's
sub-tile inside its tile of the level below. Nothing is connected above the fuse level (the code
generator keeps intermediates in the fuse level's tile buffers), so at an upper level every node
is its own sub-graph: its sub-tiles read their inputs from, and write their output to, the level
below, in that level's buffers (the whole tensor for a tensor that lives in DRAM, the tile buffer
for a connected intermediate), counted in whole transactions of the upper level.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .device import Device
from .propagate import Propagator
from .tile_graph import SubGraph, TileGraph


@dataclass(frozen=True)
class TileConfig:
    """An output tile of a sub-graph and the reduction step used for its footprint."""

    tile: tuple[int, ...]
    rstep: int | None = None


@dataclass(frozen=True)
class TilePlan:
    """Propagated tile shapes of a sub-graph for one TileConfig."""

    config: TileConfig
    num_tiles: int
    tiles: dict  # tensor name -> tile extents (full reduction)
    step_tiles: dict  # tensor name -> tile extents with reduction steps of config.rstep
    internal: tuple  # (node index, buffer name, extents, dtype) of buffers inside node funcs


@dataclass(frozen=True)
class TileCost:
    traffic: int
    footprint: int
    num_tiles: int
    utilization: float

    @property
    def score(self) -> float:
        """Traffic penalised by idle parallel units: what the scheduler ranks by."""
        return self.traffic / self.utilization


def _count_tiles(shape, tile) -> int:
    return int(np.prod([-(-int(s) // int(t)) for s, t in zip(shape, tile)], dtype=np.int64))


def propagate_subgraph(graph: TileGraph, sub: SubGraph, config: TileConfig) -> TilePlan:
    """Propagate(g, tile): tile of every tensor and node-internal buffer of `sub`."""
    out = graph.tensors[sub.output]
    tiles, internal = _propagate(graph, sub, config.tile, None)
    step_tiles = tiles if config.rstep is None else _propagate(graph, sub, config.tile,
                                                               config.rstep)[0]
    return TilePlan(config, _count_tiles(out.shape, config.tile), tiles, step_tiles, internal)


def _propagate(graph, sub, tile, rstep):
    """Propagated tiles, memoised: the scheduler prices the same node and tile many times (every
    group that contains it, every fuse-level tile whose sub-tiles it enumerates)."""
    names = dict.fromkeys((*sub.inputs, *(n.output for n in sub.nodes)))
    shapes = tuple((t, tuple(int(d) for d in graph.tensors[t].shape)) for t in names)
    return _propagate_memo(sub, shapes, tuple(int(t) for t in tile), rstep)


@functools.lru_cache(maxsize=8192)
def _propagate_memo(sub, shapes, tile, rstep):
    shape_of = dict(shapes)
    prop = Propagator(shape_of[sub.output], tile)
    regions = {sub.output: prop.out_region}
    tiles: dict[str, tuple[int, ...]] = {}
    internal = []
    for index in range(len(sub.nodes) - 1, -1, -1):
        node = sub.nodes[index]
        func = node.func
        if node.output not in regions:
            raise ValueError(f"node {node.name} does not contribute to the output of its group")
        need = prop.propagate_func(func, func.params[-1], regions[node.output], rstep)
        params = list(func.params[:-1])
        for buffer, region in need.items():
            if buffer in params:
                tensor = node.inputs[params.index(buffer)]
                regions[tensor] = prop.union(regions.get(tensor), region)
            elif not buffer.same_as(func.params[-1]):
                shape = [int(s) for s in buffer.shape]
                internal.append((index, buffer.name, prop.extent(region, shape),
                                 str(buffer.dtype)))
    for tensor, region in regions.items():
        tiles[tensor] = prop.extent(region, shape_of[tensor])
    return tiles, tuple(internal)


def intermediate_bytes(graph: TileGraph, sub: SubGraph, plan: TilePlan) -> int:
    """Bytes of the tiles that never leave the fast level: intermediates and node internals."""
    total = 0
    for tensor in sub.intermediates:
        meta = graph.tensors[tensor]
        total += int(np.prod(plan.tiles[tensor], dtype=np.int64)) * np.dtype(meta.dtype).itemsize
    for _, _, extents, dtype in plan.internal:
        total += int(np.prod(extents, dtype=np.int64)) * np.dtype(dtype).itemsize
    return total


def transfer_bytes(extents, shape, itemsize: int, transaction: int) -> int:
    """Bytes moved for one tile region, in whole transactions of contiguous runs."""
    run = 1
    dim = len(shape) - 1
    while dim >= 0:
        run *= int(extents[dim])
        full = int(extents[dim]) == int(shape[dim])
        dim -= 1
        if not full:
            break
    rows = int(np.prod([int(e) for e in extents[: dim + 1]], dtype=np.int64))
    return rows * math.ceil(run * itemsize / transaction) * transaction


def mem_traffic(graph: TileGraph, sub: SubGraph, plan: TilePlan, device: Device,
                level: int = 0) -> int:
    """MemTraffic: bytes between `level` and the level above it for the whole output."""
    txn = device.level(level).transaction
    per_tile = 0
    for tensor in (*sub.inputs, sub.output):
        meta = graph.tensors[tensor]
        if tensor not in plan.tiles:
            continue  # an input the output does not depend on
        per_tile += transfer_bytes(plan.tiles[tensor], meta.shape,
                                   np.dtype(meta.dtype).itemsize, txn)
    return per_tile * plan.num_tiles


def _align(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def best_fit(buffers, alignment: int = 64) -> int:
    """Peak bytes of a best-fit allocation of (size, first step, last step) buffers.

    Buffers are placed in order of their first step; a freed range is reused by the smallest
    gap that fits, as in Welder's shared-memory planner.
    """
    live: list[tuple[int, int, int]] = []  # (offset, size, last step)
    peak = 0
    for size, first, last in sorted(buffers, key=lambda b: (b[1], -b[0])):
        size = _align(int(size), alignment)
        live = [b for b in live if b[2] >= first]
        live.sort()
        best = None
        cursor = 0
        for offset, used, _ in live:
            gap = offset - cursor
            if gap >= size and (best is None or gap < best[1]):
                best = (cursor, gap)
            cursor = max(cursor, offset + used)
        offset = best[0] if best else cursor
        live.append((offset, size, last))
        peak = max(peak, offset + size)
    return peak


def mem_footprint(graph: TileGraph, sub: SubGraph, plan: TilePlan, device: Device) -> int:
    """MemFootprint: bytes of all tiles live at once at the fuse level (best-fit)."""
    last_step = len(sub.nodes)
    first_use: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for step, node in enumerate(sub.nodes):
        for tensor in node.inputs:
            first_use.setdefault(tensor, step)
            last_use[tensor] = step
    buffers = []
    for tensor, extents in plan.step_tiles.items():
        nbytes = int(np.prod(extents, dtype=np.int64)) * np.dtype(graph.tensors[tensor].dtype).itemsize
        if tensor == sub.output:
            buffers.append((nbytes, last_step - 1, last_step))
        elif tensor in sub.inputs:
            buffers.append((nbytes, first_use[tensor], last_use[tensor]))
        else:
            produced = next(i for i, n in enumerate(sub.nodes) if n.output == tensor)
            buffers.append((nbytes, produced, last_use[tensor]))
    for step, _, extents, dtype in plan.internal:
        buffers.append((int(np.prod(extents, dtype=np.int64)) * np.dtype(dtype).itemsize,
                        step, step))
    return best_fit(buffers, device.level(device.fuse_level).transaction)


def generated_footprint(graph: TileGraph, sub: SubGraph, plan: TilePlan, alignment: int
                        ) -> int:
    """Bytes the CUDA tile code generator keeps in shared memory for one tile: each connected
    intermediate and node-internal buffer at its whole (unstepped) tile, best-fit over their
    lifetimes (an intermediate from its producer to its last consumer, an internal buffer
    within its node), as TVM's StorageRewrite may reuse a buffer's space once it is dead.
    Inputs and the output are not counted: the kernel reads and writes them in global memory.
    """
    steps = {n.output: i for i, n in enumerate(sub.nodes)}
    last_use: dict[str, int] = {}
    for step, node in enumerate(sub.nodes):
        for tensor in node.inputs:
            last_use[tensor] = step
    buffers = []
    for tensor in sub.intermediates:
        nbytes = int(np.prod(plan.tiles[tensor], dtype=np.int64)) * \
            np.dtype(graph.tensors[tensor].dtype).itemsize
        buffers.append((nbytes, steps[tensor], last_use.get(tensor, steps[tensor])))
    for step, _, extents, dtype in plan.internal:
        buffers.append((int(np.prod(extents, dtype=np.int64)) * np.dtype(dtype).itemsize,
                        step, step))
    return best_fit(buffers, alignment)


def sub_tile_cost(graph: TileGraph, node, config: TileConfig, parent, parents: int,
                  buffer_shapes: dict, level: int, device: Device) -> TileCost:
    """Traffic and footprint of node `node` tiled by `config.tile` at memory `level`.

    `parent` is the node's tile one level down (the sub-tile splits it; a sub-tile that does not
    divide it is counted rounded up) and `parents` how many such tiles the whole run has.
    `buffer_shapes` maps tensors held in a tile buffer one level down to that buffer's shape (the
    run of a row that is contiguous there); other tensors are laid out as in DRAM.
    Traffic: input and output sub-tiles of every sub-tile, in transactions of `level`.
    Footprint: the sub-tile's inputs (streamed by `config.rstep` along a reduction), its output and
    node-internal buffers, all live at once (a single node has no lifetimes to overlap).
    `num_tiles` is the number of sub-tiles of the whole run; `utilization` is 1 (the scheduler
    applies the level's own constraints, e.g. CUDA threads per block).
    """
    single = SubGraph((node,), tuple(dict.fromkeys(node.inputs)), node.output)
    plan = propagate_subgraph(graph, single, config)
    count = _count_tiles(parent, config.tile)
    txn = device.level(level).transaction
    per_tile = 0
    footprint = 0
    for tensor in (*single.inputs, node.output):
        if tensor not in plan.tiles:
            continue  # an input the output does not depend on
        meta = graph.tensors[tensor]
        itemsize = np.dtype(meta.dtype).itemsize
        shape = buffer_shapes.get(tensor, meta.shape)
        per_tile += transfer_bytes(plan.tiles[tensor], shape, itemsize, txn)
        footprint += int(np.prod(plan.step_tiles[tensor], dtype=np.int64)) * itemsize
    for _, _, extents, dtype in plan.internal:
        footprint += int(np.prod(extents, dtype=np.int64)) * np.dtype(dtype).itemsize
    return TileCost(per_tile * count * parents, footprint, count * parents, 1.0)


def tile_cost(graph: TileGraph, sub: SubGraph, config: TileConfig, device: Device) -> TileCost:
    """Propagate a tile through `sub` and price it: traffic, footprint (on CUDA the code
    generator's, `generated_footprint`; module docstring), parallel utilisation."""
    plan = propagate_subgraph(graph, sub, config)
    units = device.parallel_units
    waves = -(-plan.num_tiles // units)
    utilization = plan.num_tiles / (waves * units)
    if device.kind == "cuda":
        footprint = generated_footprint(graph, sub, plan,
                                        device.level(device.fuse_level).transaction)
    else:
        footprint = mem_footprint(graph, sub, plan, device)
    return TileCost(mem_traffic(graph, sub, plan, device), footprint, plan.num_tiles,
                    utilization)
