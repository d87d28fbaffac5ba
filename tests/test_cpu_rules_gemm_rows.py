"""The GEMM rule with a row epilogue (tir_passes/rules/cpu/gemm_rows.py): a matrix product whose
output rows feed LayerNorm or softmax, scheduled as one kernel of whole-row tiles. Numerics
against numpy on odd shapes, the refusals, the plan's invariants, and a planted fault (row
tiles joined out of step) that the numeric comparison must catch."""
import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm_ffi import structural_mutate

from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.legalize import softmax_reciprocal
from tvm_einweld.tir_passes.rules.cpu import gemm, gemm_rows, schedule_cpu
from tvm_einweld.tir_passes.rules.cpu.isa import vector_isa

TARGET = host_target()
LANES = vector_isa(TARGET).lanes("float32")
RNG = np.random.default_rng(11)


def layer_norm_after_gemm(m: int, n: int, k: int, batch: int = 1, weight: bool = True):
    """x @ w + bias + residual, then LayerNorm over the last axis as the ONNX importer
    decomposes it (sum, mean, sum of squared deviations, normalise)."""
    x = te.placeholder((batch, m, k), name="x")
    w = te.placeholder((k, n), name="w")
    bias = te.placeholder((n,), name="bias")
    res = te.placeholder((batch, m, n), name="res")
    gamma, beta = te.placeholder((n,), name="gamma"), te.placeholder((n,), name="beta")
    r = te.reduce_axis((0, k), "r")
    mm = te.compute((batch, m, n), lambda b, i, j: te.sum(x[b, i, r] * w[r, j], axis=r),
                    name="matmul")
    added = te.compute((batch, m, n), lambda b, i, j: mm[b, i, j] + bias[j] + res[b, i, j],
                       name="T_add")
    r1 = te.reduce_axis((0, n), "r1")
    total = te.compute((batch, m), lambda b, i: te.sum(added[b, i, r1], axis=r1), name="sum")
    mean = te.compute((batch, m), lambda b, i: total[b, i] / float(n), name="mean")
    r2 = te.reduce_axis((0, n), "r2")
    dev = te.compute((batch, m), lambda b, i: te.sum(
        (added[b, i, r2] - mean[b, i]) * (added[b, i, r2] - mean[b, i]), axis=r2), name="var")
    out = te.compute((batch, m, n), lambda b, i, j: (added[b, i, j] - mean[b, i]) * tirx.rsqrt(
        dev[b, i] / float(n) + 1e-5) * gamma[j] + beta[j], name="T_layer_norm")
    func = te.create_prim_func([x, w, bias, res, gamma, beta, out])
    return func.with_attr("layout_free_buffers", [1, 2, 4, 5] if weight else [])


def softmax_after_scores(heads: int, m: int, n: int, k: int):
    """softmax(q @ k^T * scale) per head, softmax as the pipeline legalises it."""
    q = te.placeholder((1, heads, m, k), name="q")
    kt = te.placeholder((1, heads, k, n), name="kt")
    r = te.reduce_axis((0, k), "r")
    mm = te.compute((1, heads, m, n), lambda b, h, i, j: te.sum(
        q[b, h, i, r] * kt[b, h, r, j], axis=r), name="matmul")
    scaled = te.compute((1, heads, m, n), lambda *i: mm(*i) * tirx.const(0.125, "float32"),
                        name="T_multiply")
    return te.create_prim_func([q, kt, softmax_reciprocal(scaled, -1)])


def numpy_layer_norm(x, w, bias, res, gamma, beta):
    h = x.astype(np.float64) @ w + bias + res
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) / np.sqrt(var + 1e-5) * gamma + beta


def numpy_softmax(q, kt):
    s = (q.astype(np.float64) @ kt) * 0.125
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def run(func, arrays):
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target=TARGET)
    args = [tvm.runtime.tensor(a) for a in arrays[:-1]]
    out = tvm.runtime.tensor(np.full(arrays[-1].shape, np.nan, arrays[-1].dtype))
    lib["main"](*args, out)
    return out.numpy()


def inputs(func):
    return [RNG.standard_normal([int(d) for d in p.shape]).astype("float32") for p in func.params]


@pytest.mark.parametrize("m,n,k,batch", [
    (96, 4 * LANES, 40, 1),     # several row tiles, K not a multiple of the vector
    (37, 2 * LANES, 19, 1),     # prime M: one-row register blocks
    (24, 3 * LANES, 7, 3),      # batch of 3, K below the vector width
])
def test_layer_norm_after_gemm(m, n, k, batch):
    func = layer_norm_after_gemm(m, n, k, batch)
    claim = schedule_cpu(func, TARGET)
    assert claim is not None and claim[0] == "gemm-rows"
    arrays = inputs(func)
    got = run(claim[1], arrays)
    np.testing.assert_allclose(got, numpy_layer_norm(*arrays[:-1]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads,m,n,k", [(12, 128, 128, 64), (3, 40, 3 * LANES, 24)])
def test_softmax_after_scores(heads, m, n, k):
    func = softmax_after_scores(heads, m, n, k)
    claim = schedule_cpu(func, TARGET)
    assert claim is not None and claim[0] == "gemm-rows"
    arrays = inputs(func)
    np.testing.assert_allclose(run(claim[1], arrays), numpy_softmax(*arrays[:2]),
                               rtol=1e-5, atol=1e-6)


def test_refusals():
    # Rows that are not whole vectors: the row part would need a predicate.
    assert gemm_rows.schedule_gemm_rows(softmax_after_scores(2, 16, LANES + 3, 8), TARGET) \
        is None
    # B beyond half of L2 on several cores: every core would stream all of B (see row_tiling).
    two = tvm.target.Target({**TARGET.export(), "num-cores": 2})
    caches = gemm.cache_sizes(two)
    k = caches.l2 // (4 * 8 * LANES) + LANES
    assert k * 8 * LANES * 4 > caches.l2 // 2
    assert gemm_rows.schedule_gemm_rows(layer_norm_after_gemm(32, 8 * LANES, k), two) is None
    # Rows laid out in another order than the GEMM computes them: the scores transposed to
    # (query, head) rows before the softmax (an epilogue that permutes), or the row part
    # reading the heads' rows transposed.
    q = te.placeholder((1, 2, 16, 8), name="q")
    kt = te.placeholder((1, 2, 8, 2 * LANES), name="kt")
    r = te.reduce_axis((0, 8), "r")
    mm = te.compute((1, 2, 16, 2 * LANES), lambda b, h, i, j: te.sum(
        q[b, h, i, r] * kt[b, h, r, j], axis=r), name="matmul")
    permuted = te.compute((1, 16, 2, 2 * LANES), lambda b, i, h, j: mm[b, h, i, j], name="T_t")
    assert gemm_rows.schedule_gemm_rows(
        te.create_prim_func([q, kt, softmax_reciprocal(permuted, -1)]), TARGET) is None
    r2 = te.reduce_axis((0, 2 * LANES), "r2")
    sums = te.compute((1, 16, 2), lambda b, i, h: te.sum(mm[b, h, i, r2], axis=r2), name="sum")
    assert gemm_rows.schedule_gemm_rows(te.create_prim_func([q, kt, sums]), TARGET) is None
    # A plain GEMM or a lone softmax is not this rule's.
    x = te.placeholder((32, 16), name="x")
    w = te.placeholder((16, 2 * LANES), name="w")
    r = te.reduce_axis((0, 16), "r")
    plain = te.create_prim_func([x, w, te.compute(
        (32, 2 * LANES), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="matmul")])
    assert gemm_rows.schedule_gemm_rows(plain, TARGET) is None
    s = te.placeholder((4, 2 * LANES), name="s")
    assert gemm_rows.schedule_gemm_rows(te.create_prim_func([s, softmax_reciprocal(s)]),
                                        TARGET) is None


@pytest.mark.parametrize("batch,m,n,k", [(1, 128, 768, 64), (12, 128, 128, 64), (2, 96, 64, 40)])
def test_row_tiles_are_whole_and_fit(batch, m, n, k):
    shape = gemm.GemmShape(batch, m, n, k, "float32")
    tiling = gemm_rows.row_tiling(TARGET, shape)
    assert tiling is not None
    caches = gemm.cache_sizes(TARGET)
    assert m % tiling.mc == 0 and tiling.mc % tiling.block.mr == 0
    assert tiling.mc * (tiling.kc + n) * 4 <= caches.l2 // 2
    assert gemm.fits_registers(vector_isa(TARGET), tiling.block.mr, tiling.block.vectors)


def serial(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its parallel loops run serially (so a fault below shows deterministically)."""
    def visit(loop, mutator):
        loop = mutator.default_mutate(loop)
        if loop.kind != tirx.ForKind.PARALLEL:
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body,
                        None, loop.annotations)
    return structural_mutate(func, [(tirx.For, visit)])


def test_planted_join_out_of_step_is_caught(monkeypatch):
    """`merge` checks no dependences: the row part of tile t must read the rows tile t just
    computed. Joined out of step (the row loop rotated by half: the first tile normalises the
    rows of the second, not computed yet), rows are read before they are written; numpy
    catches it."""
    func = layer_norm_after_gemm(96, 2 * LANES, 16)
    real = gemm_rows._schedule_row_part

    def rotated(sch, *args):
        row = real(sch, *args)
        outer, inner = sch.split(row, [2, None])
        sch.reorder(inner, outer)  # rows of the second half first: out of step with tiles
        return sch.fuse(inner, outer)

    monkeypatch.setattr(gemm_rows, "_schedule_row_part", rotated)
    sch = gemm_rows.schedule_gemm_rows(func, TARGET)
    assert sch is not None
    arrays = inputs(func)
    got = run(serial(sch.mod["main"]), arrays)
    assert not np.allclose(got, numpy_layer_norm(*arrays[:-1]), rtol=1e-4, atol=1e-4)
