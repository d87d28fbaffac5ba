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


def _loads(mod) -> tuple[int, int]:
    """(widened loads, partial loads left) in a lowered module: a widened load is a shuffle
    taking a prefix of one wider load."""
    counts = [0, 0]

    def shuffle(node):
        if len(node.vectors) == 1 and \
                [int(i) for i in node.indices] == list(range(len(node.indices))):
            counts[0] += 1
        return node

    def load(node):
        index = node.indices[0] if len(node.indices) == 1 else None
        if isinstance(index, tirx.Ramp) and int(index.lanes) & (int(index.lanes) - 1):
            counts[1] += 1
        return node

    structural_map(mod, [(tirx.Shuffle, shuffle), (ir.TensorLoad, load)])
    return counts[0], counts[1]


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
    widened, partial = _loads(_lowered(func))
    if wide is None:
        assert widened == 0
    else:
        assert (widened, partial) == ((1, 0) if wide - width <= tail else (0, 1))


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
    assert _loads(_lowered(func)) == (rows - 1, 1)
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
    """A bound check that proves everything widens the last row's load past A's end: the
    structural assertion of test_rows_against_numpy (0 widened where the last row cannot
    widen) fails on it."""
    monkeypatch.setattr(widen_loads.Analyzer, "can_prove", lambda self, expr, *a: True)
    assert _loads(_lowered(row_copy(LANES - 2, 5, 2 * LANES, tail=0))) != (0, 1)


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
