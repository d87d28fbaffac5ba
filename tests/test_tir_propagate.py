"""Tile propagation over legalized TIR: output tile -> input tiles via TVM's bound analysis."""
import pytest
import tvm
from tvm import relax
from tvm.relax import op

from tvm_einweld.tir_passes.cost import TileConfig, propagate_subgraph
from tvm_einweld.tir_passes import tile_graph
from tvm_einweld.tir_passes.tile_graph import build_tile_graph, subgraph


def _single_op(inputs, make):
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(s, d)) for n, s, d in inputs]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(*params))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def _tiles(mod, tile, rstep=None):
    graph = build_tile_graph(mod)
    sub = subgraph(graph, [n.name for n in graph.nodes])
    plan = propagate_subgraph(graph, sub, TileConfig(tile, rstep))
    return plan.tiles if rstep is None else plan.step_tiles, plan, graph


def test_matmul_full_reduction_and_reduction_step():
    mod = _single_op([("a", (64, 48), "float32"), ("b", (48, 96), "float32")], op.matmul)
    tiles, plan, _ = _tiles(mod, (4, 32))
    assert tiles["a"] == (4, 48) and tiles["b"] == (48, 32)
    assert plan.num_tiles == (64 // 4) * (96 // 32)
    step, _, _ = _tiles(mod, (4, 32), rstep=8)
    assert step["a"] == (4, 8) and step["b"] == (8, 32)


def test_conv_stride_two_with_padding():
    mod = _single_op([("x", (1, 8, 32, 32), "float32"), ("w", (16, 8, 3, 3), "float32")],
                     lambda x, w: op.nn.conv2d(x, w, strides=2, padding=1))
    tiles, plan, graph = _tiles(mod, (1, 4, 4, 8))
    assert tiles["x"] == (1, 8, (4 - 1) * 2 + 3, (8 - 1) * 2 + 3)
    assert tiles["w"] == (4, 8, 3, 3)
    assert graph.tensors[graph.nodes[0].output].shape == (1, 16, 16, 16)
    # The padded copy inside the conv func is an internal buffer with the same halo.
    assert any(extents[2:] == (9, 17) for _, _, extents, _ in plan.internal)


def test_max_pool_window():
    mod = _single_op([("x", (1, 8, 16, 16), "float32")],
                     lambda x: op.nn.max_pool2d(x, pool_size=2, strides=2))
    tiles, _, _ = _tiles(mod, (1, 8, 4, 4))
    assert tiles["x"] == (1, 8, 8, 8)


def test_transpose_permutes_the_tile():
    mod = _single_op([("x", (4, 8, 16), "float32")], lambda x: op.permute_dims(x, [2, 0, 1]))
    tiles, _, _ = _tiles(mod, (2, 4, 8))
    assert tiles["x"] == (4, 8, 2)


def test_softmax_row_reduction_needs_whole_rows():
    mod = _single_op([("x", (64, 128), "float32")], lambda x: op.nn.softmax(x, axis=-1))
    tiles, plan, _ = _tiles(mod, (4, 32))
    assert tiles["x"] == (4, 128)
    internal = {name: extents for _, name, extents, _ in plan.internal}
    assert internal["T_softmax_maxelem"] == (4,)
    assert internal["T_softmax_exp"] == (4, 128)


def test_a_gather_is_not_tiled():
    """A load at an index read from memory bounds no region: the node stays out of the tile
    graph (left to its own kernel)."""
    mod = _single_op([("x", (100, 16), "float32"), ("i", (10,), "int64")],
                     lambda x, i: op.take(x, i, axis=0))
    assert build_tile_graph(mod).nodes == ()
    assert all(tile_graph.gathers(f) for _, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc))


def test_gather_gets_a_conservative_bound(monkeypatch):
    """Were a gather tiled, propagation would bound its data by the whole tensor."""
    monkeypatch.setattr(tile_graph, "gathers", lambda func: False)
    mod = _single_op([("x", (100, 16), "float32"), ("i", (10,), "int64")],
                     lambda x, i: op.take(x, i, axis=0))
    tiles, _, _ = _tiles(mod, (2, 16))
    assert tiles["x"] == (100, 16)  # data-dependent rows: the whole tensor
    assert tiles["i"] == (2,)


def test_chain_propagates_through_intermediates():
    # transpose -> softmax over the transposed rows: the transpose tile follows from softmax's.
    mod = _single_op([("x", (128, 64), "float32")],
                     lambda x: op.nn.softmax(op.permute_dims(x, [1, 0]), axis=-1))
    mod = relax.transform.Normalize()(mod)
    graph = build_tile_graph(mod)
    if len(graph.nodes) != 2:
        pytest.fail(f"expected transpose and softmax nodes, got {[n.name for n in graph.nodes]}")
    sub = subgraph(graph, [n.name for n in graph.nodes])
    plan = propagate_subgraph(graph, sub, TileConfig((8, 64)))
    transposed = graph.nodes[0].output
    assert plan.tiles[transposed] == (8, 128)
    assert plan.tiles["x"] == (128, 8)
