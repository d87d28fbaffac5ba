"""Strided vector loads read as contiguous vectors plus a shuffle (tir_passes/deinterleave.py):
the lane map for every stride and width, kernels built with the einweld TIR pipeline against
numpy (odd widths, a load ending at the buffer's last element), and a planted wrong lane map
that the numeric check catches."""
import numpy as np
import pytest
import tvm
import tvm_einweld  # noqa: F401  (registers the pipelines)
from tvm import ir, tirx
from tvm.script import tirx as T
from tvm_ffi import structural_map

from tvm_einweld.tir_passes import deinterleave
from tvm_einweld.tir_passes.device import host_target

TARGET = host_target()


@pytest.mark.parametrize("stride", [2, 3, 4])
@pytest.mark.parametrize("lanes", [4, 5, 8, 11, 14, 16, 32])
def test_chunk_plan_reads_element_stride_k_in_lane_k(stride, lanes):
    starts, indices = deinterleave.chunk_plan(stride, lanes)
    span = stride * (lanes - 1) + 1
    assert len(starts) == -(-span // lanes)  # as few chunks as cover the span
    assert all(0 <= s and s + lanes <= span for s in starts)  # never past the last lane
    for k, index in enumerate(indices):
        chunk, offset = divmod(index, lanes)
        assert starts[chunk] + offset == stride * k


def strided_copy(stride: int, lanes: int, rows: int, offset: int) -> tirx.PrimFunc:
    """B[r, l] = A[(r * lanes + l) * stride + offset], the l loop vectorised; A ends exactly
    at the last element read."""
    n = rows * lanes
    size = (n - 1) * stride + offset + 1

    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((size,), "float32"), B: T.Buffer((n,), "float32")):
        for r in range(rows):
            for lane in T.vectorized(lanes):
                with T.sblock("copy"):
                    v = T.axis.spatial(n, r * lanes + lane)
                    B[v] = A[v * stride + offset]

    return func.with_attr("global_symbol", "main")


def _strided_vector_loads(mod) -> tuple[int, int]:
    """(strided vector loads, deinterleaving shuffles) in a lowered module."""
    counts = [0, 0]

    def load(node):
        index = node.indices[0] if len(node.indices) == 1 else None
        if isinstance(index, tirx.Ramp) and int(index.stride) != 1:
            counts[0] += 1
        return node

    def shuffle(node):  # of several chunks (widen_loads' take one vector, or one and zeros)
        chunks = [v for v in node.vectors
                  if not isinstance(v, (tirx.Broadcast, tirx.IntImm, tirx.FloatImm))]
        counts[1] += len(chunks) > 1
        return node

    structural_map(mod, [(ir.TensorLoad, load), (tirx.Shuffle, shuffle)])
    return counts[0], counts[1]


def _run(func, stride, size, n, pipeline=deinterleave.TIR_PIPELINE):
    lib = tvm.tirx.build(tvm.IRModule({"main": func}), target=TARGET, pipeline=pipeline)
    a = np.random.default_rng(stride).standard_normal(size).astype("float32")
    b = tvm.runtime.tensor(np.zeros(n, "float32"))
    lib["main"](tvm.runtime.tensor(a), b)
    return a, b.numpy()


@pytest.mark.parametrize("stride,lanes,offset", [(2, 16, 0), (2, 11, 1), (3, 16, 2), (4, 5, 3),
                                                 (2, 14, 7), (5, 8, 0)])
def test_strided_loads_against_numpy(stride, lanes, offset):
    rows = 7
    func = strided_copy(stride, lanes, rows, offset)
    n = rows * lanes
    size = (n - 1) * stride + offset + 1
    a, got = _run(func, stride, size, n)
    np.testing.assert_array_equal(got, a[offset::stride][:n])
    lower = tvm.tirx.get_tir_pipeline(deinterleave.TIR_PIPELINE)[0]
    bound = tvm.tirx.transform.BindTarget(TARGET.with_host(TARGET))(tvm.IRModule({"main": func}))
    strided, shuffles = _strided_vector_loads(lower(bound))
    if stride <= deinterleave.MAX_STRIDE:
        assert (strided, shuffles) == (0, 1)
    else:  # left to TVM's lane-by-lane load
        assert (strided, shuffles) == (1, 0)


@pytest.mark.parametrize("dtype,lanes", [("int8", 32), ("float16", 16), ("float64", 8),
                                         ("bool", 16)])
@pytest.mark.parametrize("generic", [False, True])
def test_other_dtypes_and_the_generic_target(dtype, lanes, generic):
    """Integer, half, double and boolean lanes; on plain `llvm` (SSE2) too."""
    n = 3 * lanes
    size = (n - 1) * 2 + 1

    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((size,), dtype), B: T.Buffer((n,), dtype)):
        for r in range(3):
            for lane in T.vectorized(lanes):
                with T.sblock("copy"):
                    v = T.axis.spatial(n, r * lanes + lane)
                    B[v] = A[v * 2]

    target = tvm.target.Target({"kind": "llvm"}) if generic else TARGET
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target=target, pipeline=deinterleave.TIR_PIPELINE)
    rng = np.random.default_rng(lanes)
    a = rng.random(size) > 0.5 if dtype == "bool" else (rng.random(size) * 100).astype(dtype)
    b = tvm.runtime.tensor(np.zeros(n, dtype))
    lib["main"](tvm.runtime.tensor(a), b)
    np.testing.assert_array_equal(b.numpy(), a[::2][:n])
    lower = tvm.tirx.get_tir_pipeline(deinterleave.TIR_PIPELINE)[0]
    bound = tvm.tirx.transform.BindTarget(target.with_host(target))(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    assert _strided_vector_loads(lower(bound)) == (0, 1)


@pytest.mark.parametrize("dtype", ["int4", "float32x4"])
def test_packed_and_vector_elements_are_left_alone(dtype):
    """int4 (two to a byte) and vector-typed buffers are addressed otherwise than one element
    per index: such loads are not rewritten."""
    load = tirx.BufferLoad(tirx.decl_buffer((64,), dtype, name="A"),
                           [tirx.Ramp(tirx.IntImm("int32", 0), 2, 8)])
    assert deinterleave.deinterleave_load(load).same_as(load)


def test_a_load_under_address_of_is_left_alone():
    load = tirx.BufferLoad(tirx.decl_buffer((64,), "float32", name="A"),
                           [tirx.Ramp(tirx.IntImm("int32", 0), 2, 8)])
    body = tirx.Evaluate(tirx.address_of(load))
    mod = tvm.IRModule({"main": tirx.PrimFunc([], body)})
    assert _strided_vector_loads(deinterleave.DeinterleaveStridedLoads()(mod)) == (1, 0)


def test_a_strided_depthwise_conv_reads_no_strided_vectors():
    """The stride-2 depthwise conv of the conv rule (its column-phase copy, vectorised at
    element granularity) lowered with the einweld TIR pipeline: its strided loads became
    shuffles (numerics: test_cpu_rules_conv)."""
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm_einweld.tir_passes.rules.cpu import conv

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 24, 24), "float32"))
    w = relax.const(np.ones((16, 1, 3, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(x, w, strides=2, padding=1,
                                                            groups=16)))
        bb.emit_func_output(out)
    with TARGET:
        legal = tvm.transform.Sequential(cpu.legalize_passes(TARGET))(bb.get())
    (func,) = [f for f in legal.functions.values() if isinstance(f, tirx.PrimFunc)]
    sch = conv.schedule_conv(func, TARGET)
    bound = tvm.tirx.transform.BindTarget(TARGET.with_host(TARGET))(
        tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}))
    before = _strided_vector_loads(tvm.tirx.get_tir_pipeline("default")[0](bound))
    after = _strided_vector_loads(
        tvm.tirx.get_tir_pipeline(deinterleave.TIR_PIPELINE)[0](bound))
    assert before[0] > 0 and after == (0, before[0])


def test_planted_wrong_lane_map_is_caught(monkeypatch):
    """A plan that takes each lane's neighbour: the kernel still builds and runs, and the
    numeric comparison above fails on it."""
    right = deinterleave.chunk_plan

    def off_by_one(stride, lanes):
        starts, indices = right(stride, lanes)
        return starts, tuple(min(i + 1, len(starts) * lanes - 1) for i in indices)

    monkeypatch.setattr(deinterleave, "chunk_plan", off_by_one)
    func = strided_copy(2, 16, 3, 0)
    a, got = _run(func, 2, 95, 48)
    assert not np.array_equal(got, a[::2][:48])
