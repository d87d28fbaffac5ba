"""Prefetch of the next panel (tir_passes/rules/cpu/prefetch.py) in the GEMM and conv rules:
with caches small enough that the rules prefetch, every tile order and panel grouping still
computes what numpy computes, and every prefetched address lies inside its buffer (proved on
the lowered function for all loop values; a planted out-of-range panel index is caught)."""
from collections import OrderedDict

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.sym import Analyzer

import tvm_einweld.tir_passes.rules.cpu as cpu_rules
from conftest import run_vm
from test_cpu_rules_conv import conv_module, numpy_conv2d
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu import conv, gemm, prefetch
from tvm_einweld.tir_passes.rules.cpu.apply import cpu_gemm_pipeline
from tvm_einweld.tir_passes.rules.cpu.isa import vector_isa

TARGET = host_target()
RNG = np.random.default_rng(5)
# L2 of 64 KiB: weights of more than 32 KiB do not stay in it, panels of up to 24 KiB are
# prefetched (`prefetch.prefetch_fits`), whatever this machine's caches are.
SMALL = gemm.CacheSizes(l1=32 * 1024, l2=64 * 1024)


@pytest.fixture
def small_caches(monkeypatch):
    monkeypatch.setattr(gemm, "_host_caches", lambda: SMALL)
    monkeypatch.setattr(cpu_rules, "_MEMO", OrderedDict())  # schedules made for other caches


def _flat(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` lowered to flat buffers, as `gemm.well_formed` lowers it."""
    return gemm.flat_lowering()(tvm.IRModule({"main": func}))["main"]


def prefetch_bounds(func: tirx.PrimFunc) -> list[tuple[int, int, int]]:
    """(lowest, highest, buffer size) of every prefetched element index of the flattened
    `func`, over all values of the loops around it."""
    found = []

    def walk(stmt, loops):
        if isinstance(stmt, tirx.For):
            walk(stmt.body, loops + [stmt])
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                walk(s, loops)
        elif isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call) and \
                stmt.value.op.name == "tirx.prefetch":
            load = stmt.value.args[0].args[0]
            analyzer = Analyzer()
            for loop in loops:
                analyzer.bind(loop.loop_var, tvm.ir.Range.from_min_extent(loop.min, loop.extent))
            bound = analyzer.const_int_bound(load.indices[0])
            found.append((bound.min_value, bound.max_value, int(load.source.shape[0])))
        else:
            for field in ("body", "then_case", "else_case"):
                child = getattr(stmt, field, None)
                if isinstance(child, tirx.Stmt):
                    walk(child, loops)

    walk(func.body, [])
    return found


def assert_prefetches_in_bounds(func: tirx.PrimFunc) -> None:
    bounds = prefetch_bounds(_flat(func))
    assert bounds, "the rule was expected to prefetch"
    for low, high, size in bounds:
        assert 0 <= low and high < size, (low, high, size)


def _matmul_func(a_shape, b_shape) -> tirx.PrimFunc:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(a_shape, "float32"))
    w = relax.Var("w", relax.TensorType(b_shape, "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.matmul(x, w)))
        bb.emit_func_output(y)
    mod = relax.transform.LegalizeOps()(bb.get())
    # B is a weight (packed into panels at compile time): a run-time B along its columns
    # would be read in place, without panels to prefetch (`gemm.b_in_place`).
    return next(f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)).with_attr(
        "layout_free_buffers", [1])


LANES = vector_isa(TARGET).lanes("float32")
WIDE = max(LANES, 8)  # B of at least 96 x 128 floats (48 KiB): beyond half of SMALL's L2
K = 96
# (A, B, register block rows, vectors, mc, columns outer, panels per tile). Which of the two
# modes of `prefetch_next_panel` a case takes depends on the vector width (lines per panel row
# against row blocks per tile); with 16 lanes rows_outer and two_panels walk rows, the others
# lines.
GEMM_CASES = {
    "rows_outer": ((37, K), (K, 16 * WIDE), 5, 2, 10, False, 1),
    "rows_outer_more_blocks": ((37, K), (K, 16 * WIDE), 5, 2, 20, False, 1),
    "columns_outer": ((41, K), (K, 12 * WIDE), 4, 2, 12, True, 1),
    "two_panels_per_tile": ((23, K), (K, 16 * WIDE), 5, 2, 5, False, 2),
    "batched_weights": ((3, 19, K), (3, K, 8 * WIDE), 4, 2, 8, False, 1),
    "batched_columns_outer": ((3, 19, K), (3, K, 8 * WIDE), 4, 2, 8, True, 1),
    # One column tile per batch: the tiles of a panel follow each other with rows outer too.
    "batched_one_panel_each": ((3, 19, 2 * K), (3, 2 * K, 2 * WIDE), 4, 2, 8, False, 1),
    # B without the batch: the batch joins the rows (I), one weight for all.
    "broadcast_weights": ((3, 19, K), (K, 12 * WIDE), 4, 2, 8, True, 1),
}


@pytest.mark.parametrize("name", sorted(GEMM_CASES))
def test_gemm_prefetch_against_numpy(name, small_caches):
    a_shape, b_shape, mr, vectors, mc, columns_outer, panels = GEMM_CASES[name]
    func = _matmul_func(a_shape, b_shape)
    tiling = gemm.Tiling(gemm.RegisterBlock(mr, vectors, LANES), mc, b_shape[-2],
                         columns_outer=columns_outer, panels=panels)
    sch = gemm.schedule_gemm(func, TARGET, tiling)
    assert_prefetches_in_bounds(sch.mod["main"])
    a = RNG.standard_normal(a_shape).astype("float32")
    b = RNG.standard_normal(b_shape).astype("float32")
    lib = tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}),
                         target=TARGET)
    assert "llvm.prefetch" in lib.inspect_source("ll")  # the hints reach LLVM
    out = tvm.runtime.tensor(np.zeros(np.broadcast_shapes(a_shape[:-1] + (1,),
                                                          b_shape[:-2] + (1, 1))[:-1]
                                      + (b_shape[-1],), "float32"))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)


# (input, weights, attrs): channel tiles outer with weights beyond half of the small L2 (the
# strided case beyond all of it: within L2 its copy would be made band by band,
# `conv.copy_band`, with no channel tiles outer to prefetch for).
CONV_CASES = {
    "3x3": ((1, 16, 7, 7), (96, 16, 3, 3), dict(padding=1)),
    "3x3_stride2_batch": ((2, 16, 13, 13), (128, 16, 3, 3), dict(padding=1, strides=2)),
    "dilated_odd_width": ((1, 40, 9, 11), (48, 40, 3, 3), dict(padding=2, dilation=2)),
    "15x1_flat_positions": ((1, 48, 12, 12), (21, 48, 15, 1), dict(padding=(7, 0))),
}


@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_conv_prefetch_against_numpy(name, small_caches):
    x_shape, w_shape, attrs = CONV_CASES[name]
    x = RNG.standard_normal(x_shape).astype("float32")
    w = RNG.standard_normal(w_shape).astype("float32")
    b = RNG.standard_normal(w_shape[0]).astype("float32")
    mod = conv_module(x_shape, w, bias=b, relu=True, **attrs)
    fused = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    func = next(f for g, f in fused.functions_items() if "conv" in g.name_hint)
    assert_prefetches_in_bounds(conv.schedule_conv(func, TARGET).mod["main"])
    # The whole pipeline, weights packed at compile time (the prefetch reads the packed copy).
    got = run_vm(mod, x, target=TARGET, relax_pipeline=cpu_gemm_pipeline(TARGET))
    want = numpy_conv2d(x, w, attrs.get("strides", 1), attrs.get("padding", 0),
                        attrs.get("dilation", 1))
    np.testing.assert_allclose(got, np.maximum(want + b.reshape(1, -1, 1, 1), 0),
                               rtol=1e-4, atol=1e-4)


def test_a_conv_whose_hints_would_be_ill_formed_keeps_its_schedule(small_caches):
    """Rows of 20 positions copied out with partial vectors at their ends (loop_partition's
    pieces define a block's variables twice): TVM 0.27 would schedule the hinted function no
    further, which had made the whole rule fail; the schedule is kept without the hints, and
    computes the convolution."""
    x_shape, w_shape, attrs = (1, 48, 12, 20), (21, 48, 15, 1), dict(padding=(7, 0))
    x = RNG.standard_normal(x_shape).astype("float32")
    w = RNG.standard_normal(w_shape).astype("float32")
    mod = conv_module(x_shape, w, **attrs)
    fused = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    func = next(f for g, f in fused.functions_items() if "conv" in g.name_hint)
    assert conv.schedule_conv(func, TARGET) is not None
    got = run_vm(mod, x, target=TARGET, relax_pipeline=cpu_gemm_pipeline(TARGET))
    np.testing.assert_allclose(got, numpy_conv2d(x, w, 1, (7, 0)), rtol=1e-4, atol=1e-4)


def test_no_prefetch_where_weights_stay_in_l2():
    """With this machine's caches a small GEMM's weights stay in L2: nothing is added."""
    func = _matmul_func((16, 32), (32, 2 * LANES))
    assert not prefetch_bounds(_flat(gemm.schedule_gemm(func, TARGET).mod["main"]))


def test_planted_out_of_range_panel_is_caught(small_caches, monkeypatch):
    """The bounds check is not vacuous: a `following` panel one past the last one (the fault
    the modulo in the rules prevents) is reported out of range."""
    func = _matmul_func((37, K), (K, 16 * WIDE))
    tiling = gemm.Tiling(gemm.RegisterBlock(5, 2, LANES), 10, K)
    right = gemm.schedule_gemm(func, TARGET, tiling).mod["main"]
    original = prefetch.prefetch_next_panel

    def planted(f, step, panels, following, share, shares):
        return original(f, step, panels, [following[0], following[1] + panels.shape[1]],
                        share, shares)

    monkeypatch.setattr(gemm, "prefetch_next_panel", planted)
    monkeypatch.setattr(cpu_rules, "_MEMO", OrderedDict())
    faulty = gemm.schedule_gemm(func, TARGET, tiling).mod["main"]
    assert all(high < size for _, high, size in prefetch_bounds(_flat(right)))
    assert any(high >= size for _, high, size in prefetch_bounds(_flat(faulty)))
