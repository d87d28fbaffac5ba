"""Two-step scheduling: SubGraphTiling candidates and GraphConnecting decisions."""
from dataclasses import replace

from tvm import relax

from tvm_einweld.tir_passes import workloads
from tvm_einweld.tir_passes.cost import TileConfig, propagate_subgraph, sub_tile_cost, tile_cost
from tvm_einweld.tir_passes.device import MemoryLevel, cpu_device, cuda_device
from tvm_einweld.tir_passes.scheduler import graph_connecting, subgraph_tiling
from tvm_einweld.tir_passes.tile_graph import build_tile_graph, subgraph


def _paper_graph(rows=98304):
    graph = build_tile_graph(relax.transform.LegalizeOps()(workloads.matmul_softmax(rows, 64, 128)))
    return graph, subgraph(graph, [n.name for n in graph.nodes])


def test_tiling_candidates_fit_and_are_ranked():
    graph, sub = _paper_graph()
    gpu = cuda_device("v100")
    cands = subgraph_tiling(graph, sub, gpu, topk=4)
    assert len(cands) == 4
    scores = [c.cost.score for c in cands]
    assert scores == sorted(scores)
    for cand in cands:
        assert cand.cost.footprint <= gpu.level(gpu.fuse_level).capacity
        assert all(s % t == 0 for s, t in zip((98304, 128), cand.config.tile))
        assert tile_cost(graph, sub, cand.config, gpu) == cand.cost
    # The best tile moves less data than the paper's 16x128 one.
    assert cands[0].cost.traffic <= 264 << 20


def test_small_capacity_forces_reduction_steps_or_small_tiles():
    # Welder's footprint (inputs staged at the fuse level too): the CPU's model of its L2.
    graph, sub = _paper_graph()
    cpu = cpu_device()
    tiny = replace(cpu, levels=(cpu.levels[0], MemoryLevel("L2", 16 * 1024, 64,
                                                           cpu.levels[1].bandwidth),
                                cpu.levels[2]))
    for cand in subgraph_tiling(graph, sub, tiny, topk=4):
        assert cand.cost.footprint <= 16 * 1024
    # B alone (64x128 floats, 32 KB) cannot be resident: every candidate streams k.
    assert all(c.config.rstep is not None for c in subgraph_tiling(graph, sub, tiny, topk=4))


def test_cuda_footprint_is_the_generated_kernels_shared_memory():
    # The CUDA code generator reads A and B from global memory and keeps whole tiles of the
    # intermediates in shared memory: matmul's C, and softmax's exp plus its per-row max and
    # sum, all live while softmax runs (rows x 128 floats twice, two 128-byte-aligned rows,
    # whatever columns of the output the tile covers: a row's sum needs all of C's).
    graph, sub = _paper_graph()
    gpu = cuda_device("h100")
    tiny = replace(gpu, levels=(gpu.levels[0], MemoryLevel("shared", 16 * 1024, 128, 1e13),
                                gpu.levels[2]))
    cands = subgraph_tiling(graph, sub, tiny, topk=4)
    assert cands
    for cand in cands:
        rows = cand.config.tile[0]
        row = -(-rows * 4 // 128) * 128
        assert cand.cost.footprint == 2 * rows * 128 * 4 + 2 * row <= 16 * 1024


def test_graph_connecting_by_model_connects_the_paper_pair():
    graph, _ = _paper_graph()
    plan = graph_connecting(graph, cuda_device("v100"), topk=2)
    assert plan.connected == frozenset({(graph.nodes[0].name, graph.nodes[1].name)})
    assert len(plan.groups) == 1 and len(plan.groups[0].sub.nodes) == 2


def test_graph_connecting_uses_the_evaluator():
    graph, _ = _paper_graph(4096)
    calls = []

    def slower_when_fused(sub, cand):
        calls.append(sub.names)
        return 1.0 if len(sub.nodes) > 1 else 0.1

    plan = graph_connecting(graph, cuda_device("v100"), topk=2, evaluate=slower_when_fused)
    assert not plan.connected and len(plan.groups) == 2
    assert any(len(names) == 2 for names in calls)  # the connected option was priced


# ------------------------------------------------------------- recursion to the upper levels
def _conv_graph():
    from tvm_einweld.tir_passes import prepare  # pylint: disable=import-outside-toplevel

    graph = build_tile_graph(prepare()(workloads.conv_relu_maxpool(channels=16, size=56,
                                                                  filters=32)))
    return graph, subgraph(graph, [n.name for n in graph.nodes])


def _small_l1_cpu():
    cpu = cpu_device()
    return replace(cpu, levels=cpu.levels[:2] + (MemoryLevel("L1", 8 * 1024, 64,
                                                             cpu.levels[2].bandwidth),))


def _check_nesting(graph, sub, device, cands):
    """Every SubTile splits its node's tile one level down and fits its own level."""
    assert cands
    nested = 0
    for cand in cands:
        plan = propagate_subgraph(graph, sub, cand.config)
        assert len({t.node for t in cand.inner}) == len(cand.inner) <= len(sub.nodes)
        for first in cand.inner:
            parent = plan.tiles[graph.node(first.node).output]
            for tile in first.chain():
                level = device.level(tile.level)
                assert tile.level > device.fuse_level
                assert all(p % t == 0 and t <= p for p, t in zip(parent, tile.config.tile))
                if device.kind == "cuda":
                    assert tile.cost.footprint <= min(255 * 4, level.capacity // device.threads)
                    count = 1
                    for p, t in zip(parent, tile.config.tile):
                        count *= p // t
                    assert count == device.threads  # threads = tile / sub-tile
                else:
                    assert tile.cost.footprint <= level.capacity
                nested += tuple(parent) != tuple(tile.config.tile)
                parent = tile.config.tile
    return nested


def test_matmul_softmax_sub_tiles_nest_and_fit():
    graph, sub = _paper_graph(4096)
    for device in (cpu_device(), _small_l1_cpu(), cuda_device("a100")):
        cands = subgraph_tiling(graph, sub, device, topk=3)
        nested = _check_nesting(graph, sub, device, cands)
        assert nested, device.name  # some tile is really split at the upper level
        # Inter-layer independence: the fuse-level ranking is the DRAM traffic, as before.
        scores = [c.cost.score for c in cands]
        assert scores == sorted(scores)
    # The matmul needs its register tile on the GPU: one sub-tile per thread.
    gpu = subgraph_tiling(graph, sub, cuda_device("a100"), topk=1)[0]
    assert graph.nodes[0].name in {t.node for t in gpu.inner}


def test_conv_sub_tiles_nest_and_fit():
    graph, sub = _conv_graph()
    small = _small_l1_cpu()
    for device in (cpu_device(), small, cuda_device("a100")):
        _check_nesting(graph, sub, device, subgraph_tiling(graph, sub, device, topk=2))
    # With an 8 KiB L1 the conv tile must be split for its working set to fit.
    assert _check_nesting(graph, sub, small, subgraph_tiling(graph, sub, small, topk=2))


def test_upper_level_traffic_counts_the_sub_tiles():
    # A whole-tile "sub-tile" moves every tensor of the node once per tile; halving the output
    # columns of a matmul sub-tile re-reads the A rows once more per tile.
    graph, sub = _paper_graph(4096)
    cpu = cpu_device()
    node = graph.nodes[0]
    tile = (64, 128)
    whole = sub_tile_cost(graph, node, TileConfig(tile), tile, 1, {}, 2, cpu)
    half = sub_tile_cost(graph, node, TileConfig((64, 64)), tile, 1, {}, 2, cpu)
    a_bytes = 64 * 64 * 4
    assert half.traffic == whole.traffic + a_bytes
    assert half.num_tiles == 2 and whole.num_tiles == 1
    assert half.footprint < whole.footprint


def test_graph_connecting_stops_measuring_configs_far_slower_than_apart():
    """The best-ranked config of the fused pair measured 10x slower than its members apart:
    the worse-ranked ones are not measured. One within 2x: every config is measured."""
    graph, _ = _paper_graph(4096)
    for fused_seconds, fused_calls in ((1.0, 1), (0.15, 3)):
        calls = []

        def evaluate(sub, cand):
            calls.append(len(sub.nodes))
            return fused_seconds if len(sub.nodes) > 1 else 0.05

        graph_connecting(graph, cuda_device("v100"), topk=3, evaluate=evaluate)
        assert calls.count(2) == fused_calls
        assert calls.count(1) == 6  # each single node: all three configs (the bar is inf)


def test_nothing_is_timed_that_cannot_change_the_plan():
    """Both nodes have an analytic kernel and refuse tile configs; their pair has neither
    (e.g. two convolutions): the edge stays in DRAM without timing either node, and each
    node, with one way to run, is planned untimed (latency NaN). When the pair has an
    analytic kernel too, all three are timed and the faster side wins."""
    import math

    graph, _ = _paper_graph(4096)
    for pair_claimed, timed in ((False, 0), (True, 3)):
        calls, prefetched = [], []

        def alone(sub):
            calls.append(sub.names)
            return 0.5 if len(sub.nodes) > 1 else 1.0

        plan = graph_connecting(graph, cuda_device("v100"), topk=2, alone=alone,
                                tiles_wanted=lambda sub: False,
                                claimed=lambda sub: len(sub.nodes) == 1 or pair_claimed,
                                prefetch=lambda subs: prefetched.append(
                                    sorted(len(s.nodes) for s in subs)))
        assert len(calls) == timed
        # The edge's three kernels are announced together, before the first is timed.
        assert prefetched == ([[1, 1, 2]] if pair_claimed else [])
        if pair_claimed:
            assert plan.connected and len(plan.groups) == 1
            assert plan.groups[0].candidate is None and plan.groups[0].latency == 0.5
        else:
            assert not plan.connected and len(plan.groups) == 2
            assert all(g.candidate is None and math.isnan(g.latency) for g in plan.groups)
