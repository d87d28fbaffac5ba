"""Partial vector loads read as whole-register loads plus a shuffle (tir_passes/widen_loads.py):
which widths widen, kernels built with the einweld TIR pipeline against numpy (odd widths,
loads that end at the buffer's last element and so must not widen), and a planted bound
check that widens everything, which the structural assertion catches."""
import numpy as np
import pytest
import tvm
import tvm_einweld  # noqa: F401  (registers the pipelines)
from tvm import ir, tirx
from tvm.script import tirx as T
from tvm_ffi import structural_map

from tvm_einweld.tir_passes import deinterleave, widen_loads
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu.isa import vector_isa

TARGET = host_target()
LANES = vector_isa(TARGET).lanes("float32")
MASKED = vector_isa(TARGET).masked  # AVX-512: partial loads and stores under a lane mask


@pytest.mark.parametrize("lanes,register,expect", [(14, 16, 16), (12, 16, 16), (7, 16, 8),
                                                   (3, 8, 4), (5, 8, 8), (16, 16, None),
                                                   (8, 16, None), (20, 16, None), (1, 16, None),
                                                   (7, 4, None)])
def test_widened_lanes(lanes, register, expect):
    assert widen_loads.widened_lanes(lanes, register) == expect


def row_copy(width: int, rows: int, pitch: int, tail: int = 0, dtype: str = "float32"
             ) -> tirx.PrimFunc:
    """B[r, x] = A[r * pitch + x] + 1 for x < width, the x loop vectorised: each row one load
    of `width` lanes; A has `tail` elements after the last row's last element read."""
    size = (rows - 1) * pitch + width + tail

    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((size,), dtype), B: T.Buffer((rows, width), dtype)):
        for r in range(rows):
            for x in T.vectorized(width):
                with T.sblock("copy"):
                    vr, vx = T.axis.remap("SS", [r, x])
                    B[vr, vx] = A[vr * pitch + vx] + T.Cast(dtype, 1)

    return func.with_attr("global_symbol", "main")


def _accesses(mod) -> dict:
    """Counts in a lowered module: "wide" loads (a prefix shuffle of one whole-register
    load), "masked" loads and "stores" (tirx.masked_*), "partial" loads and stores left."""
    counts = dict(wide=0, masked=0, stores=0, partial=0, partial_stores=0)

    def partial(indices) -> bool:
        index = indices[0] if len(indices) == 1 else None
        return isinstance(index, tirx.Ramp) and bool(int(index.lanes) & (int(index.lanes) - 1))

    def shuffle(node):
        inner = node.vectors[0]
        if len(node.vectors) == 1 and isinstance(inner, ir.TensorLoad):
            counts["wide"] += 1
        return node

    def call(node):
        if isinstance(node.op, ir.Op) and node.op.name == "tirx.masked_load":
            counts["masked"] += 1
        if isinstance(node.op, ir.Op) and node.op.name == "tirx.masked_store":
            counts["stores"] += 1
        return node

    def load(node):
        counts["partial"] += partial(node.indices)
        return node

    def store(node):
        counts["partial_stores"] += partial(node.indices)
        return node

    structural_map(mod, [(tirx.Shuffle, shuffle), (ir.Call, call), (ir.TensorLoad, load),
                         (tirx.BufferStore, store)])
    return counts


def _loads(mod) -> tuple[int, int]:
    """(loads widened, by a whole-register or a masked load; partial loads left)."""
    counts = _accesses(mod)
    return counts["wide"] + counts["masked"], counts["partial"]


def _lowered(func, target=TARGET):
    bound = tvm.tirx.transform.BindTarget(target.with_host(target))(
        tvm.IRModule({"main": func}))
    return tvm.tirx.get_tir_pipeline(deinterleave.TIR_PIPELINE)[0](bound)


@pytest.mark.parametrize("width,tail", [(LANES - 2, 2), (LANES - 2, 1), (LANES - 2, 0),
                                        (LANES // 2 - 1, 1), (3, 1), (3, 0)])
@pytest.mark.parametrize("dtype", ["float32", "int8", "float64"])
def test_rows_against_numpy(width, tail, dtype):
    """Rows of a partial vector, one load expression in the row loop: it widens only if the
    wider load of every row stays inside A, i.e. the last row's too, which needs `tail`
    elements after it; a load that would end past A stays as it was. Numerics exact."""
    rows, pitch = 5, 2 * LANES
    func = row_copy(width, rows, pitch, tail, dtype)
    size = (rows - 1) * pitch + width + tail
    lib = tvm.tirx.build(tvm.IRModule({"main": func}), target=TARGET,
                         pipeline=deinterleave.TIR_PIPELINE)
    rng = np.random.default_rng(width)
    a = (rng.random(size) * 100).astype(dtype)
    b = tvm.runtime.tensor(np.zeros((rows, width), dtype))
    lib["main"](tvm.runtime.tensor(a), b)
    expect = np.stack([a[r * pitch:r * pitch + width] for r in range(rows)]) + 1
    np.testing.assert_array_equal(b.numpy(), expect.astype(dtype))
    wide = widen_loads.widened_lanes(width, vector_isa(TARGET).lanes(dtype))
    counts = _accesses(_lowered(func))
    if wide is None:
        assert counts["wide"] == counts["masked"] == counts["stores"] == 0
    elif wide - width <= tail:  # room after every row: a whole-register load
        assert (counts["wide"], counts["masked"], counts["partial"]) == (1, 0, 0)
    elif MASKED:  # else under a mask, where the target has masked loads
        assert (counts["wide"], counts["masked"], counts["partial"]) == (0, 1, 0)
    else:
        assert (counts["wide"], counts["masked"], counts["partial"]) == (0, 0, 1)
    if wide is not None:  # B's partial rows: stored under a mask where there are masks
        assert (counts["stores"], counts["partial_stores"]) == ((1, 0) if MASKED else (0, 1))


def test_loads_widen_row_by_row_where_each_fits():
    """Loads of the same buffer at several row offsets (a conv block's rows, the row loop
    unrolled): those whose wider load fits widen, the one reaching the end does not."""
    width, rows, pitch = LANES - 2, 4, LANES

    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((rows * pitch - (pitch - width),), "float32"),
             B: T.Buffer((rows, width), "float32")):
        for r in T.unroll(rows):
            for x in T.vectorized(width):
                with T.sblock("copy"):
                    vr, vx = T.axis.remap("SS", [r, x])
                    B[vr, vx] = A[vr * pitch + vx]

    func = func.with_attr("global_symbol", "main")
    counts = _accesses(_lowered(func))
    assert counts["wide"] == rows - 1  # the last row's reaches past A: masked, or left
    assert (counts["masked"], counts["partial"]) == ((1, 0) if MASKED else (0, 1))
    lib = tvm.tirx.build(tvm.IRModule({"main": func}), target=TARGET,
                         pipeline=deinterleave.TIR_PIPELINE)
    a = np.arange(rows * pitch - (pitch - width), dtype="float32")
    b = tvm.runtime.tensor(np.zeros((rows, width), "float32"))
    lib["main"](tvm.runtime.tensor(a), b)
    np.testing.assert_array_equal(b.numpy(), np.stack([a[r * pitch:r * pitch + width]
                                                       for r in range(rows)]))


def test_the_generic_target_and_address_of():
    """On plain `llvm` (SSE2, 4 float lanes) a 3-lane load widens to 4; a load under
    `address_of` is left alone."""
    generic = tvm.target.Target({"kind": "llvm"})
    assert _loads(_lowered(row_copy(3, 4, 4, tail=1), generic)) == (1, 0)
    assert _loads(_lowered(row_copy(3, 4, 4, tail=0), generic)) == (0, 1)
    load = tirx.BufferLoad(tirx.decl_buffer((64,), "float32", name="A"),
                           [tirx.Ramp(tirx.IntImm("int32", 0), 1, 14)])
    func = tirx.PrimFunc([], tirx.Evaluate(tirx.address_of(load))).with_attr("target", TARGET)
    assert _loads(widen_loads.WidenPartialLoads()(tvm.IRModule({"main": func}))) == (0, 1)


def test_planted_unchecked_bound_is_caught(monkeypatch):
    """A bound check that proves everything reads the last row's load as a whole register past
    A's end (instead of under a mask, or not at all): the structural assertion of
    test_rows_against_numpy (no whole-register load where the last row has no room) fails."""
    func = row_copy(LANES - 2, 5, 2 * LANES, tail=0)
    assert _accesses(_lowered(func))["wide"] == 0  # as test_rows_against_numpy asserts
    monkeypatch.setattr(widen_loads.Analyzer, "can_prove", lambda self, expr, *a: True)
    assert _accesses(_lowered(func))["wide"] == 1


@pytest.mark.parametrize("channels,size,stride", [(24, 28, 1), (8, 14, 1), (5, 13, 2)])
def test_a_depthwise_conv_with_partial_rows_against_numpy(channels, size, stride):
    """The conv rule's depthwise 3x3 conv whose rows are partial vectors (28 columns in blocks
    of 14 on AVX-512), built with the einweld TIR pipeline: its block loads widened (where the
    register is wider than the rows) and its output equal to numpy's."""
    from tvm import relax
    from tvm_einweld.tir_passes.rules.cpu import conv

    rng = np.random.default_rng(size)
    x = rng.standard_normal((1, channels, size, size)).astype("float32")
    w = rng.standard_normal((channels, 1, 3, 3)).astype("float32")
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType(x.shape, "float32"))
    with bb.function("main", [xv]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(
                xv, relax.const(w), strides=stride, padding=1, groups=channels)))
        bb.emit_func_output(out)
    legal = relax.transform.LegalizeOps()(bb.get())
    (func,) = [f for f in legal.functions.values() if isinstance(f, tirx.PrimFunc)]
    sch = conv.schedule_conv(func, TARGET)
    assert sch is not None
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    lib = tvm.tirx.build(tvm.IRModule({"main": scheduled}), target=TARGET,
                         pipeline=deinterleave.TIR_PIPELINE)
    out_size = (size - 1) // stride + 1
    got = tvm.runtime.tensor(np.zeros((1, channels, out_size, out_size), "float32"))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), got)
    pad = np.pad(x, [(0, 0), (0, 0), (1, 1), (1, 1)])
    expect = sum(pad[:, :, i:i + stride * out_size:stride, j:j + stride * out_size:stride]
                 * w[None, :, 0, i, j, None, None] for i in range(3) for j in range(3))
    np.testing.assert_allclose(got.numpy(), expect, rtol=1e-5, atol=1e-5)
    if size == 28 and LANES == 16:
        assert _loads(_lowered(scheduled))[0] > 0


def test_a_strided_view_is_not_widened_past_its_rows():
    """A parameter declared with strides (a column slice of a wider array): its flattened
    extent runs past the memory it views (the last row's padding), so its partial rows are not
    read as whole registers, though the analyzer would prove them inside that extent."""

    @T.prim_func(s_tir=True)
    def func(a: T.handle, b: T.handle):
        A = T.match_buffer(a, (4, 3), "float32", strides=[8, 1])
        B = T.match_buffer(b, (4, 3), "float32")
        for i in range(4):
            for j in T.vectorized(3):
                with T.sblock("copy"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = A[vi, vj]

    generic = tvm.target.Target({"kind": "llvm"})  # 4 float lanes: a 3-lane row is partial
    counts = _accesses(_lowered(func.with_attr("global_symbol", "main"), generic))
    assert counts["wide"] == 0 and counts["partial"] >= 1, counts
