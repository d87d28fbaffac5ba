"""Two-step tile-graph scheduling (Welder §3.2, Figure 7).

* `subgraph_tiling` (SubGraphTiling): enumerate output tiles of a sub-graph Roller-style — start
  from the unit tile and grow one dimension at a time to the next divisor of its extent, best
  candidates first — propagate each one, drop those whose footprint exceeds the connected level's
  capacity (trying smaller reduction steps first), and keep the top-k by penalised traffic.
* `graph_connecting` (GraphConnecting): visit the nodes in topological order and, for each output
  edge, compare connecting it at the fast level (the producer's and consumer's groups become one
  kernel) with leaving it in DRAM; each side is priced by measuring its top-k tile configurations
  on the target (or, without a measurer, by the model's traffic over DRAM bandwidth).
  SetConnect is the union of the two groups (and the `connected` edge set); Propagate is
  `cost.propagate_subgraph`.

Only single-output groups are formed (a tensor read by several nodes, or returned, stays in
DRAM): that is where the code generator's compute_at rewrite applies.
The code generator keeps connected tiles at one fast level (`device.fuse_level`); the register
level is what its inner vectorised (CPU) or per-thread (CUDA) loops use, not scheduled here.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

from .cost import TileConfig, TileCost, tile_cost
from .device import Device
from .tile_graph import SubGraph, TileGraph, subgraph

_RSTEPS = (None, 32, 8, 1)


@dataclass(frozen=True)
class Candidate:
    config: TileConfig
    cost: TileCost


@dataclass(frozen=True)
class GroupPlan:
    """A scheduled group: its nodes, the chosen tile and its seconds (measured or estimated)."""

    sub: SubGraph
    candidate: Candidate
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


def subgraph_tiling(graph: TileGraph, sub: SubGraph, device: Device, topk: int = 4,
                    budget: int = 40) -> list[Candidate]:
    """SubGraphTiling at the fuse level: the top-k tiles by penalised traffic that fit."""
    shape = graph.tensors[sub.output].shape
    start = tuple(1 for _ in shape)
    seen = {start}
    found: list[Candidate] = []
    first = _fit(graph, sub, start, device)
    if first is None:
        return []
    frontier = [(first.cost.score, start, first)]
    evaluated = 1
    while frontier and evaluated < budget:
        _, tile, cand = heapq.heappop(frontier)
        found.append(cand)
        for dim, size in enumerate(tile):
            grown = _next_divisor(int(shape[dim]), size)
            if grown is None:
                continue
            nxt = tile[:dim] + (grown,) + tile[dim + 1:]
            if nxt in seen:
                continue
            seen.add(nxt)
            evaluated += 1
            fitted = _fit(graph, sub, nxt, device)
            if fitted is not None:
                heapq.heappush(frontier, (fitted.cost.score, nxt, fitted))
    found.extend(c for _, _, c in frontier)
    found.sort(key=lambda c: (c.cost.score, -_volume(c.config.tile)))
    return found[:topk]


def _volume(tile) -> int:
    out = 1
    for t in tile:
        out *= int(t)
    return out


Evaluator = Callable[[SubGraph, Candidate], "float | None"]


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


def graph_connecting(graph: TileGraph, device: Device, topk: int = 4,
                     evaluate: Evaluator | None = None) -> GraphPlan:
    """GraphConnecting: decide, edge by edge, which tensors stay at the fast level.

    `evaluate(sub, candidate)` returns the seconds of that tile config measured on the target,
    or None when it cannot be built; without it, configs are priced by `estimated_seconds`.
    """
    start = time.perf_counter()
    groups = _Groups([n.name for n in graph.nodes])
    best: dict[frozenset, GroupPlan | None] = {}

    def price(names: frozenset) -> GroupPlan | None:
        if names in best:
            return best[names]
        sub = subgraph(graph, names)
        plan = None
        if sub is not None:
            for cand in subgraph_tiling(graph, sub, device, topk):
                if evaluate is None:
                    seconds = estimated_seconds(cand.cost, device)
                else:
                    seconds = evaluate(sub, cand)
                if seconds is not None and (plan is None or seconds < plan.latency):
                    plan = GroupPlan(sub, cand, seconds)
        best[names] = plan
        return plan

    def value(plan: GroupPlan | None) -> float:
        return float("inf") if plan is None else plan.latency

    connected = set()
    for node in graph.nodes:
        consumers = graph.consumers(node.output)
        if len(consumers) != 1 or node.output in graph.outputs:
            continue  # multi-consumer or returned tensors stay in DRAM
        consumer = consumers[0]
        apart = value(price(groups.members(node.name))) + value(price(
            groups.members(consumer.name)))
        together = price(groups.members(node.name) | groups.members(consumer.name))
        if value(together) < apart:
            groups.union(node.name, consumer.name)
            connected.add((node.name, consumer.name))
    plans = []
    for root in dict.fromkeys(groups.find(n.name) for n in graph.nodes):
        plan = price(groups.members(root))
        if plan is not None:
            plans.append(plan)
    return GraphPlan(tuple(plans), frozenset(connected), time.perf_counter() - start)


