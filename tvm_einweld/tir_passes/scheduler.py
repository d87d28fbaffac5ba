"""Two-step tile-graph scheduling (Welder §3.2, Figure 7).

* `subgraph_tiling` (SubGraphTiling): enumerate output tiles of a sub-graph Roller-style — start
  from the unit tile and grow one dimension at a time to the next divisor of its extent, best
  candidates first — propagate each one, drop those whose footprint exceeds the connected level's
  capacity (trying smaller reduction steps first), and keep the top-k by penalised traffic. Then it
  recurses to the upper memory levels (Figure 7, lines 19-24): for each top-k tile it extracts the
  sub-graphs of the next level and runs SubGraphTiling on them inside that tile. Edges are only
  connected at the fuse level (the code generator keeps intermediates in the fuse level's tile
  buffers, never in L1 or registers across operators), so above it every node is its own
  sub-graph: `_node_tiling` enumerates sub-tiles of the node's tile (its propagated output tile),
  checks the level's capacity, keeps the top-k by that level's traffic and recurses again. A
  candidate is thus the fuse-level `TileConfig` plus one `SubTile` chain per node.
* `graph_connecting` (GraphConnecting): visit the nodes in topological order and, for each output
  edge, compare connecting it at the fast level (the producer's and consumer's groups become one
  kernel) with leaving it in DRAM; each side is priced by measuring its top-k tile configurations
  on the target (or, without a measurer, by the model's traffic over DRAM bandwidth).
  SetConnect is the union of the two groups (and the `connected` edge set); Propagate is
  `cost.propagate_subgraph`.

Ranking across levels. By the paper's inter-layer independence, the traffic of level i depends
only on the tile of level i: a sub-tile cannot change the DRAM traffic of the tile it splits, and
the best sub-tile of one tile is found without looking at the others. So the fuse-level tiles are
ranked by DRAM traffic (the penalised `TileCost.score`), as before, and each one takes the upper
levels' best chain; the upper levels' time (sum of traffic / bandwidth) only breaks ties between
tiles of equal DRAM traffic. Summing all levels into the primary key would let the weakest figures
decide: the CPU's L1 bandwidth is a numpy-copy lower bound and the GPU's on-chip bandwidths are
data-sheet guesses, while the groups scheduled here are bound by DRAM. The final choice among the
top-k is measured on the target anyway, with the upper-level tiles in the generated code.

Level constraints above the fuse level: on CPU a sub-tile's working set (its input panels over
the whole reduction, which the inner loops reuse, plus its output) must fit L1. On CUDA the upper
level is the per-thread register tile: the block's `device.threads` threads each own one sub-tile
(threads = tile / sub-tile), the reduction is streamed one step at a time through registers, and
the registers one thread needs must fit its share of the register file (and 255 registers).

Only single-output groups are formed (a tensor read by several nodes, or returned, stays in
DRAM): that is where the code generator's compute_at rewrite applies.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from .cost import TileConfig, TileCost, propagate_subgraph, sub_tile_cost, tile_cost
from .device import Device
from .tile_graph import SubGraph, TileGraph, subgraph

_RSTEPS = (None, 32, 8, 1)


@dataclass(frozen=True)
class SubTile:
    """SubGraphTiling's choice for one node at an upper memory level.

    `config.tile` splits the node's tile one level down (its output tile; the sizes divide it);
    `cost` is the traffic between that level and `level`, and the footprint of one sub-tile at
    `level`; `inner` is the chosen sub-tile one level further up, if any.
    """

    node: str
    level: int
    config: TileConfig
    cost: TileCost
    inner: "SubTile | None" = None

    def chain(self) -> tuple["SubTile", ...]:
        return (self,) + (self.inner.chain() if self.inner is not None else ())


@dataclass(frozen=True)
class Candidate:
    """A fuse-level tile of a group (`config`, priced by `cost`) and, per node, its chain of
    sub-tiles at the levels above (`inner`; nodes without a fitting sub-tile have none)."""

    config: TileConfig
    cost: TileCost
    inner: tuple[SubTile, ...] = ()

    def upper_seconds(self, device: Device) -> float:
        """Time of the levels above the fuse level: their traffic over their bandwidth."""
        return _seconds([t for s in self.inner for t in s.chain()], device)


def _seconds(tiles, device: Device) -> float:
    return sum(t.cost.traffic / device.level(t.level).bandwidth for t in tiles)


@dataclass(frozen=True)
class GroupPlan:
    """A scheduled group: its nodes, the chosen tile and its seconds (measured or estimated;
    NaN where nothing was to be chosen, so nothing was timed: see `graph_connecting`).
    A single node whose own kernel (an analytic schedule rule's) is faster than every tile
    config has no candidate: it is left to that rule."""

    sub: SubGraph
    candidate: Candidate | None
    latency: float


@dataclass(frozen=True)
class GraphPlan:
    groups: tuple[GroupPlan, ...]
    connected: frozenset = field(default_factory=frozenset)  # (producer, consumer) node names
    seconds: float = 0.0  # scheduling time, measurements included


def _next_divisor(dim: int, current: int) -> int | None:
    """The next tile size along a dimension: a divisor at least twice as large, or the whole."""
    for size in range(current + 1, dim + 1):
        if (dim % size == 0 and size >= 2 * current) or size == dim:
            return size
    return None


def _fit(graph, sub, tile, device) -> Candidate | None:
    """The tile with the largest reduction step whose footprint fits the fuse level."""
    capacity = device.level(device.fuse_level).capacity
    for rstep in _RSTEPS:
        config = TileConfig(tile, rstep)
        cost = tile_cost(graph, sub, config, device)
        if cost.footprint <= capacity:
            return Candidate(config, cost)
    return None


def _roller(shape, price, budget: int) -> list:
    """Roller-style expansion over tiles of `shape`, best first; returns the accepted items.

    `price(tile)` returns (item or None, score, grow): the item is accepted when not None; a tile
    is grown further (one dimension to its next divisor) when `grow`. Growth is monotone in the
    footprint, so a tile that does not fit is not grown; one rejected for another reason (too
    many CUDA threads) still is.
    """
    start = tuple(1 for _ in shape)
    seen = {start}
    found = []
    item, score, grow = price(start)
    frontier = [(score, start, item)] if grow or item is not None else []
    evaluated = 1
    while frontier and evaluated < budget:
        _, tile, item = heapq.heappop(frontier)
        if item is not None:
            found.append(item)
        for dim, size in enumerate(tile):
            grown = _next_divisor(int(shape[dim]), size)
            if grown is None:
                continue
            nxt = tile[:dim] + (grown,) + tile[dim + 1:]
            if nxt in seen:
                continue
            seen.add(nxt)
            evaluated += 1
            item, score, grow = price(nxt)
            if grow:
                heapq.heappush(frontier, (score, nxt, item))
            elif item is not None:
                found.append(item)
    found.extend(i for _, _, i in frontier if i is not None)
    return found


Acceptor = Callable[[SubGraph, Candidate], bool]
# With an acceptor, SubGraphTiling stops looking for the k tiles it accepts at this many
# refused ones. Each costs a kernel's generation and check (~0.08 s); where the model misjudges
# a group it tends to misjudge every tile of it (FSRCNN's 16-phase interleave: 8 of 8 refused,
# in 17 groups; BERT's attention groups: all 40 tiles).
MAX_REFUSED = 3


def subgraph_tiling(graph: TileGraph, sub: SubGraph, device: Device, topk: int = 4,
                    budget: int = 40, accept: Acceptor | None = None) -> list[Candidate]:
    """SubGraphTiling at the fuse level, recursing to the levels above (module docstring).

    Returns the top-k fuse-level tiles that fit, ranked by penalised DRAM traffic (ties: the
    upper levels' time, then the larger tile), each with its best upper-level sub-tiles.
    With `accept` (a check of the candidate's real kernel, e.g. CUDA's limits on what is
    emitted), the top-k are the best k that it accepts: a refused tile makes room for the
    next-ranked one, so a model that misjudges a tile costs a smaller tile, not the group.
    """
    shape = graph.tensors[sub.output].shape

    def price(tile):
        cand = _fit(graph, sub, tile, device)
        return (cand, cand.cost.score, True) if cand is not None else (None, 0.0, False)

    found = _roller(shape, price, budget)
    found.sort(key=lambda c: (c.cost.score, -_volume(c.config.tile)))
    if accept is None:
        top = [_with_upper_levels(graph, sub, c, device, topk) for c in found[:topk]]
    else:
        top, refused = [], 0
        for cand in found:
            cand = _with_upper_levels(graph, sub, cand, device, topk)
            if accept(sub, cand):
                top.append(cand)
            else:
                refused += 1
            if len(top) == topk or refused == MAX_REFUSED:
                break
    top.sort(key=lambda c: (c.cost.score, c.upper_seconds(device), -_volume(c.config.tile)))
    return top


def _with_upper_levels(graph, sub, cand: Candidate, device: Device, topk: int) -> Candidate:
    """The candidate with each node's best sub-tile chain above the fuse level."""
    level = device.fuse_level + 1
    if level >= len(device.levels):
        return cand
    plan = propagate_subgraph(graph, sub, cand.config)
    # Connected intermediates live in tile buffers of the fuse level; the rest keep their layout.
    buffers = {t: plan.tiles[t] for t in sub.intermediates}
    inner = []
    for node in sub.nodes:
        tiles = _node_tiling(graph, node, plan.tiles[node.output], plan.num_tiles, buffers,
                             level, device, topk)
        if tiles:
            inner.append(tiles[0])
    return replace(cand, inner=tuple(inner))


# The reduction step of an upper-level sub-tile, as the code generator runs it: the CPU's inner
# loops sweep the whole reduction of a sub-tile (its input panels stay in L1); a CUDA thread
# streams it one step at a time through registers.
_UPPER_RSTEP = {"cpu": None, "cuda": 1}
_MAX_THREAD_REGISTER_BYTES = 255 * 4


def _node_tiling(graph, node, parent, parents: int, buffers, level: int, device: Device,
                 topk: int, budget: int = 24) -> list[SubTile]:
    """SubGraphTiling of one node at `level` inside its tile `parent` of the level below.

    The top-k sub-tiles by that level's traffic (ties: larger first) that fit the level, each
    with its best chain further up; sorted by (traffic here, time further up).
    """
    cuda = device.kind == "cuda"
    limit = device.level(level).capacity
    if cuda:  # one sub-tile per thread: its share of the register file, at most 255 registers
        limit = min(_MAX_THREAD_REGISTER_BYTES, limit // device.threads)

    def price(tile):
        config = TileConfig(tuple(int(t) for t in tile), _UPPER_RSTEP[device.kind])
        cost = sub_tile_cost(graph, node, config, parent, parents, buffers, level, device)
        if cost.footprint > limit:
            return None, 0.0, False
        # On CUDA only sub-tiles that give exactly the block's threads are usable; smaller ones
        # are still grown towards them.
        usable = not cuda or _count(parent, tile) == device.threads
        return (SubTile(node.name, level, config, cost) if usable else None), cost.score, True

    found = _roller(parent, price, budget)
    found.sort(key=lambda t: (t.cost.score, -_volume(t.config.tile)))
    found = found[:topk]
    if level + 1 < len(device.levels):
        found = [replace(t, inner=next(iter(_node_tiling(
            graph, node, t.config.tile, t.cost.num_tiles, buffers, level + 1, device, topk)),
            None)) for t in found]

    found.sort(key=lambda t: (t.cost.score, _seconds(t.chain()[1:], device),
                              -_volume(t.config.tile)))
    return found


def _count(parent, tile) -> int:
    out = 1
    for p, t in zip(parent, tile):
        out *= -(-int(p) // int(t))
    return out


def _volume(tile) -> int:
    out = 1
    for t in tile:
        out *= int(t)
    return out


Evaluator = Callable[[SubGraph, Candidate], "float | None"]

# A measured tile config slower than this many times the time it must beat (its members
# apart, or the analytic kernel of the same nodes) ends the measuring of that sub-graph: the
# remaining configs are ranked worse by the same model. Such configs were 6-30x off on
# ResNet-18 and GCN (a conv + max-pool tile kernel 91 ms against 3.4 ms apart), and each
# costs a build, ~0.3-2 s of compile time.
EARLY_STOP_RATIO = 2.0


def estimated_seconds(cost: TileCost, device: Device) -> float:
    """The model's time: penalised DRAM traffic over DRAM bandwidth."""
    return cost.score / device.level(0).bandwidth


class _Groups:
    """Union-find over node names: the components formed by connected edges."""

    def __init__(self, names):
        self.parent = {n: n for n in names}

    def find(self, name):
        while self.parent[name] != name:
            name = self.parent[name]
        return name

    def members(self, name) -> frozenset:
        root = self.find(name)
        return frozenset(n for n in self.parent if self.find(n) == root)

    def union(self, a, b) -> None:
        self.parent[self.find(a)] = self.find(b)


def _join_shared_producers(graph: TileGraph, groups: _Groups, connected: set,
                           join: Callable[[str, str], bool]) -> None:
    """A node whose output has several consumers, all of them in one group after the edge
    sweep, joins that group where together they price below apart (`join`): its output then
    lives only in tiles, as a single consumer's does. (Welder's edge-by-edge sweep keeps every
    multi-consumer tensor in memory; a LayerNorm over channels exported as ReduceMean, Sub,
    Mul, ReduceMean, ... has x - mean read by the square and by the division, which the sweep
    puts in one group without it: NAFNet's two such LayerNorms became one kernel each,
    2.14 -> 2.08 ms, one process, alternating; no other zoo model's groups changed.) Later
    nodes first, so that a chain of such producers joins from its consumers up. The joined
    group is a sub-graph like any other (`tile_graph.subgraph`: every consumer inside), and
    TileGraphFusion checks its kernel against the unfused ones before using it."""
    for node in reversed(graph.nodes):
        consumers = graph.consumers(node.output)
        if len(consumers) < 2 or node.output in graph.outputs:
            continue
        roots = {groups.find(c.name) for c in consumers}
        if len(roots) != 1 or groups.find(node.name) in roots:
            continue
        if join(node.name, consumers[0].name):
            connected.update((node.name, c.name) for c in consumers)


def graph_connecting(graph: TileGraph, device: Device, topk: int = 4,
                     evaluate: Evaluator | None = None,
                     alone: Callable[[SubGraph], "float | None"] | None = None,
                     tiles_wanted: Callable[[SubGraph], bool] | None = None,
                     claimed: Callable[[SubGraph], bool] | None = None,
                     prefetch: Callable[[list], None] | None = None,
                     accept: Acceptor | None = None) -> GraphPlan:
    """GraphConnecting: decide, edge by edge, which tensors stay at the fast level; then a
    tensor several nodes read joins the group that holds all of them where that prices lower
    (`_join_shared_producers`).

    `evaluate(sub, candidate)` returns the seconds of that tile config measured on the target,
    or None when it cannot be built; without it, configs are priced by `estimated_seconds`.
    `alone(sub)` returns the seconds of the sub-graph's kernel under an analytic schedule
    instead of a tile config (a single node's own kernel; a group's merged function, e.g. a
    GEMM with its reshape prologue and bias/activation epilogue inlined), or None: a sub-graph
    is priced at the better of the two, so a group is formed only when it beats its members'
    best kernels, not their default tiles. `tiles_wanted(sub)` False says that `evaluate`
    refuses every tile config of `sub`: they are then not enumerated at all (the same plan,
    without the cost of tiling it). Measured configs are tried best-ranked first and stop at
    one slower than `EARLY_STOP_RATIO` times the time to beat (`bar`: the members apart, or
    the sub-graph's analytic kernel).

    `claimed(sub)` says without measuring whether `alone(sub)` has a kernel to time (default:
    whenever `alone` is given). With it, nothing is measured that cannot change the plan: an
    edge whose joined group could run no kernel at all (no analytic kernel, no tile config
    wanted or fitting) stays in DRAM without pricing either side, and a group left with one
    way to run — its analytic kernel, tile configs refused — is planned without timing it
    (latency NaN: there was nothing to choose between). On GCN this skipped most of ~90
    kernel timings, each a build and ~0.3 s of compile time. `prefetch(subs)` is told the
    sub-graphs whose analytic kernels an edge is about to time (its two sides and their
    union), so that it can build them together. `accept` is `subgraph_tiling`'s.
    """
    start = time.perf_counter()
    groups = _Groups([n.name for n in graph.nodes])
    best: dict[frozenset, GroupPlan | None] = {}
    tilings: dict[frozenset, list[Candidate]] = {}

    def tiling(sub: SubGraph) -> list[Candidate]:
        """The sub-graph's top-k tile configs, or none where they are not wanted."""
        if sub.names not in tilings:
            wanted = tiles_wanted is None or tiles_wanted(sub)
            tilings[sub.names] = subgraph_tiling(graph, sub, device, topk,
                                                 accept=accept) if wanted else []
        return tilings[sub.names]

    def has_kernel(sub: SubGraph) -> bool:
        return alone is not None and (claimed is None or claimed(sub))

    def possible(names: frozenset) -> bool:
        sub = subgraph(graph, names)
        return sub is not None and (has_kernel(sub) or bool(tiling(sub)))

    def price(names: frozenset, bar: float = math.inf) -> GroupPlan | None:
        if names in best:
            return best[names]
        sub = subgraph(graph, names)
        plan = None
        if sub is not None:
            own = alone(sub) if has_kernel(sub) else None
            if own is not None:
                plan = GroupPlan(sub, None, own)
                bar = min(bar, own)
            for cand in tiling(sub):
                if evaluate is None:
                    seconds = estimated_seconds(cand.cost, device)
                else:
                    seconds = evaluate(sub, cand)
                if seconds is not None and (plan is None or seconds < plan.latency):
                    plan = GroupPlan(sub, cand, seconds)
                if evaluate is not None and seconds is not None and \
                        seconds > EARLY_STOP_RATIO * bar:
                    break
        best[names] = plan
        return plan

    def value(plan: GroupPlan | None) -> float:
        return float("inf") if plan is None else plan.latency

    def join(a: str, b: str, warm: bool = False) -> bool:
        """Unite the groups of nodes `a` and `b` where the joined group is possible and
        prices below the two apart (`warm`: their kernels are first built in one batch,
        `prefetch`); whether they were united."""
        mine, theirs = groups.members(a), groups.members(b)
        joined = mine | theirs
        if not possible(joined):
            return False
        if warm and prefetch is not None:
            subs = [subgraph(graph, names) for names in (mine, theirs, joined)
                    if names not in best]
            prefetch([sub for sub in subs if sub is not None and has_kernel(sub)])
        apart = value(price(mine)) + value(price(theirs))
        if value(price(joined, apart)) < apart:
            groups.union(a, b)
            return True
        return False

    connected = set()
    for node in graph.nodes:
        consumers = graph.consumers(node.output)
        if len(consumers) != 1 or node.output in graph.outputs:
            continue  # multi-consumer (see `_join_shared_producers`) or returned: in DRAM
        if join(node.name, consumers[0].name, warm=True):
            connected.add((node.name, consumers[0].name))
    _join_shared_producers(graph, groups, connected, join)
    plans = []
    for root in dict.fromkeys(groups.find(n.name) for n in graph.nodes):
        names = groups.members(root)
        sub = subgraph(graph, names)
        if names not in best and sub is not None and has_kernel(sub) and not tiling(sub):
            plan = GroupPlan(sub, None, math.nan)  # its analytic kernel is the only choice
        else:
            plan = price(names)
        if plan is not None:
            plans.append(plan)
    return GraphPlan(tuple(plans), frozenset(connected), time.perf_counter() - start)


