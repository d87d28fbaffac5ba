"""LocalizeIntermediates: global intermediates of a tiled kernel become per-tile buffers."""
import numpy as np
import pytest
import tvm
from tvm import relax, s_tir

from tvm_einweld.tir_passes import LocalizeIntermediates, workloads
from tvm_einweld.tir_passes.codegen import group_prim_func
from tvm_einweld.tir_passes.localize import LocalizeError, allocations, buffer_bytes, localize
from tvm_einweld.tir_passes.tile_graph import build_tile_graph, subgraph


@pytest.fixture(scope="module")
def merged():
    graph = build_tile_graph(relax.transform.LegalizeOps()(workloads.matmul_softmax(64, 16, 32)))
    return group_prim_func(graph, subgraph(graph, [n.name for n in graph.nodes]))


def _tiled(func, rows):
    """Tile the softmax output by `rows` rows and compute every producer at the tile loop."""
    sch = s_tir.Schedule(func)
    out = sch.get_sblock("T_softmax_norm")
    i, _ = sch.get_loops(out)
    outer, _ = sch.split(i, [None, rows])
    for name in ["T_softmax_expsum", "T_softmax_exp", "T_softmax_maxelem", "matmul"]:
        sch.compute_at(sch.get_sblock(name), outer)
    return sch.mod["main"]


def _run(func, a, b):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
    out = tvm.runtime.empty((a.shape[0], b.shape[1]), "float32", tvm.cpu())
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    return out.numpy()


def test_intermediates_move_under_the_tile_loop_and_shrink(merged):
    tiled = _tiled(merged, 8)
    mod = LocalizeIntermediates("local")(tvm.IRModule({"main": tiled}))
    placed = {b.name: (b, depth) for _, b, depth in allocations(mod["main"])}
    matmul_out = [n for n in placed if n.startswith("matmul")][0]
    buffer, depth = placed[matmul_out]
    assert depth == 1 and buffer.scope() == "local"
    assert [int(d) for d in buffer.shape] == [8, 32]  # one 8-row tile, not 64 rows
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 16)).astype("float32")
    b = rng.standard_normal((16, 32)).astype("float32")
    np.testing.assert_allclose(_run(mod["main"], a, b), _run(merged, a, b), rtol=1e-5, atol=1e-6)


def test_untiled_intermediate_is_refused(merged):
    # Without compute_at the matmul result is shared by all rows: it cannot become tile-local.
    with pytest.raises(LocalizeError, match="outside the tile loop"):
        localize(merged, "local")
    # Through the pass infrastructure the same error surfaces as a RuntimeError.
    with pytest.raises(RuntimeError, match="outside the tile loop"):
        LocalizeIntermediates("local")(tvm.IRModule({"main": merged}))


def test_plan_mismatch_is_refused(merged):
    tiled = _tiled(merged, 8)
    # One 8-row tile: matmul result and exp (8x32 each), row max and row sum (8 each).
    planned = (8 * 32 * 2 + 8 * 2) * 4
    with pytest.raises(RuntimeError, match="the plan allowed"):
        LocalizeIntermediates("local", planned - 4)(tvm.IRModule({"main": tiled}))
    ok = LocalizeIntermediates("local", planned)(tvm.IRModule({"main": tiled}))
    assert sum(buffer_bytes(b) for _, b, depth in allocations(ok["main"]) if depth) == planned
