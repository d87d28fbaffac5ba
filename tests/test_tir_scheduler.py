"""Two-step scheduling: SubGraphTiling candidates and GraphConnecting decisions."""
from dataclasses import replace

from tvm import relax

from tvm_einweld.tir_passes import workloads
from tvm_einweld.tir_passes.cost import tile_cost
from tvm_einweld.tir_passes.device import MemoryLevel, cuda_device
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
    graph, sub = _paper_graph()
    gpu = cuda_device("v100")
    tiny = replace(gpu, levels=(gpu.levels[0], MemoryLevel("shared", 16 * 1024, 128, 1e13),
                                gpu.levels[2]))
    for cand in subgraph_tiling(graph, sub, tiny, topk=4):
        assert cand.cost.footprint <= 16 * 1024
    # B alone (64x128 floats, 32 KB) cannot be resident: every candidate streams k.
    assert all(c.config.rstep is not None for c in subgraph_tiling(graph, sub, tiny, topk=4))


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
