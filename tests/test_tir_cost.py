"""MemTraffic / MemFootprint, including the Matmul+Softmax arithmetic of the Welder paper (§2)."""
from dataclasses import replace

import pytest
from tvm import relax

from tvm_einweld.tir_passes import workloads
from tvm_einweld.tir_passes.cost import (TileConfig, best_fit, mem_footprint, mem_traffic,
                                         propagate_subgraph, tile_cost, transfer_bytes)
from tvm_einweld.tir_passes.device import cuda_device
from tvm_einweld.tir_passes.tile_graph import build_tile_graph, subgraph

MIB = 1 << 20


@pytest.fixture(scope="module")
def paper_graph():
    mod = relax.transform.LegalizeOps()(workloads.matmul_softmax(98304, 64, 128))
    graph = build_tile_graph(mod)
    return graph, subgraph(graph, [n.name for n in graph.nodes])


def test_paper_matmul_softmax_traffic(paper_graph):
    graph, sub = paper_graph
    gpu = cuda_device("v100")
    small = tile_cost(graph, sub, TileConfig((4, 128)), gpu)
    large = tile_cost(graph, sub, TileConfig((16, 128)), gpu)
    # One 4x128 tile loads A[4x64] and B[64x128] and stores D[4x128]: 35 KB, 24,576 tiles.
    assert small.num_tiles == 24576
    assert small.traffic == (4 * 64 + 64 * 128 + 4 * 128) * 4 * 24576
    assert small.traffic / MIB == 840
    assert large.traffic / MIB == 264
    assert large.score < small.score


def test_unfused_pair_costs_more_than_the_connected_one(paper_graph):
    graph, sub = paper_graph
    gpu = cuda_device("v100")
    fused = tile_cost(graph, sub, TileConfig((16, 128)), gpu).traffic
    apart = 0
    for node in sub.nodes:
        single = subgraph(graph, [node.name])
        apart += tile_cost(graph, single, TileConfig((16, 128)), gpu).traffic
    # Unconnected, C[98304x128] is written and read back through global memory.
    assert apart - fused == 2 * 98304 * 128 * 4


def test_footprint_counts_live_tiles_and_shrinks_with_reduction_step(paper_graph):
    graph, sub = paper_graph
    gpu = cuda_device("v100")
    full = propagate_subgraph(graph, sub, TileConfig((16, 128)))
    stepped = propagate_subgraph(graph, sub, TileConfig((16, 128), rstep=16))
    big = mem_footprint(graph, sub, full, gpu)
    small = mem_footprint(graph, sub, stepped, gpu)
    a, b, c = 16 * 64 * 4, 64 * 128 * 4, 16 * 128 * 4
    row = 128  # softmax's 16-float max / sum buffers, aligned to the 128-byte transaction
    # Matmul step: A, B and C are live. Softmax step: C, exp, max, sum and D are; A and B freed.
    assert big == max(a + b + c, c + c + 2 * row + c) == a + b + c
    # With k streamed 16 at a time A and B shrink to a quarter; softmax's step now dominates.
    assert small == max(a // 4 + b // 4 + c, 3 * c + 2 * row) == 3 * c + 2 * row
    assert mem_traffic(graph, sub, full, gpu) == mem_traffic(graph, sub, stepped, gpu)


def test_transactions_of_non_contiguous_rows():
    # 4 rows of 3 floats in a 100-wide tensor: each row is its own 32-byte transaction.
    assert transfer_bytes((4, 3), (64, 100), 4, 32) == 4 * 32
    # Whole rows are contiguous: one run of 4*100 floats.
    assert transfer_bytes((4, 100), (64, 100), 4, 32) == 1600
    # Full trailing dims merge into one run even in 3-D.
    assert transfer_bytes((2, 8, 16), (4, 8, 16), 4, 128) == 2 * 8 * 16 * 4


def test_best_fit_reuses_freed_space():
    # b is freed before c starts: c reuses b's range; a stays live throughout.
    assert best_fit([(100, 0, 2), (64, 0, 0), (64, 1, 2)], alignment=1) == 164
    # Overlapping lifetimes stack up.
    assert best_fit([(100, 0, 2), (64, 0, 1), (64, 1, 2)], alignment=1) == 228
    assert best_fit([(10, 0, 0)], alignment=64) == 64


def test_parallelism_penalty(paper_graph):
    graph, sub = paper_graph
    gpu = cuda_device("v100")
    few = replace(gpu, parallel_units=100000)  # more units than tiles: most idle
    cost = tile_cost(graph, sub, TileConfig((16, 128)), few)
    assert cost.utilization == pytest.approx(6144 / 100000)
    assert cost.score == pytest.approx(cost.traffic / cost.utilization)
