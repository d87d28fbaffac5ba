"""Interleaves (a transposed convolution's phases put back together, depth-to-space) scheduled
by the injective rule as unrolled phases around contiguous vectors (`interleave_factor`), and
their strided stores merged into one contiguous store of a shuffle (tir_passes/
interleave_stores.py): the pattern found for strides 2-4 and not elsewhere, kernels against
numpy (odd widths, f64 and int8, a residual read every s-th element, a partial last vector),
the merge refused where it would change what memory holds, and a planted wrong lane order
that the numeric check catches."""
import numpy as np
import pytest
import tvm
import tvm_einweld  # noqa: F401  (registers the pipelines)
from tvm import te, tirx
from tvm_ffi import structural_map

from tvm_einweld.tir_passes import deinterleave, interleave_stores
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu import injective

TARGET = host_target()


def interleave(stride: int, channels: int, rows: int, width: int, dtype: str = "float32",
               residual: bool = False) -> tirx.PrimFunc:
    """out[c, s*y + ry, s*x + rx] = P[ry][rx][c, y, x] + bias[c] (+ res[c, s*y + ry, s*x + rx]),
    written as stack + reshape leaves it: conditions on the output column mod s, sources read
    at column // s."""
    phases = [[te.placeholder((channels, rows, width), dtype, name=f"p{ry}{rx}")
               for rx in range(stride)] for ry in range(stride)]
    bias = te.placeholder((channels,), dtype, name="bias")
    shape = (channels, stride * rows, stride * width)
    res = te.placeholder(shape, dtype, name="res")

    def pick(c, y, x):
        def column(ry, rx):
            source = phases[ry][rx][c, y // stride, x // stride]
            if rx == stride - 1:
                return source
            return tvm.tirx.if_then_else(x % stride == rx, source, column(ry, rx + 1))

        def row(ry):
            if ry == stride - 1:
                return column(ry, 0)
            return tvm.tirx.if_then_else(y % stride == ry, column(ry, 0), row(ry + 1))

        value = row(0) + bias[c]
        return value + res[c, y, x] if residual else value

    out = te.compute(shape, pick, name="out")
    args = [p for row in phases for p in row] + [bias] + ([res] if residual else []) + [out]
    return te.create_prim_func(args).with_attr("global_symbol", "main")


def _lowered(func) -> tvm.IRModule:
    sch = injective.schedule_injective(func, TARGET)
    assert sch is not None
    bound = tvm.tirx.transform.BindTarget(TARGET.with_host(TARGET))(
        tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}))
    return tvm.tirx.get_tir_pipeline(deinterleave.TIR_PIPELINE)[0](bound)


def _strided_stores(mod) -> int:
    count = []

    def store(node):
        index = node.indices[0] if len(node.indices) == 1 else None
        if isinstance(index, tirx.Ramp) and int(index.stride) != 1:
            count.append(node)

    structural_map(mod, [(tirx.BufferStore, store)])
    return len(count)


def _run_against_numpy(func, stride, channels, rows, width, dtype, residual):
    sch = injective.schedule_injective(func, TARGET)
    lib = tvm.tirx.build(sch.mod, target=TARGET, pipeline=deinterleave.TIR_PIPELINE)
    rng = np.random.default_rng(stride * 1000 + width)

    def rand(*shape):
        if dtype == "int8":
            return rng.integers(-50, 50, shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)

    phases = [[rand(channels, rows, width) for _ in range(stride)] for _ in range(stride)]
    bias = rand(channels)
    shape = (channels, stride * rows, stride * width)
    res = rand(*shape)
    expected = np.empty(shape, dtype)
    for ry in range(stride):
        for rx in range(stride):
            expected[:, ry::stride, rx::stride] = phases[ry][rx] + bias[:, None, None]
    if residual:
        expected += res
    out = tvm.runtime.tensor(np.zeros(shape, dtype))
    args = [tvm.runtime.tensor(p) for row in phases for p in row] + [tvm.runtime.tensor(bias)]
    lib["main"](*args, *([tvm.runtime.tensor(res)] if residual else []), out)
    return out.numpy(), expected


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_interleave_factor_finds_the_phases(stride):
    func = interleave(stride, 3, 4, 16)
    sch = tvm.s_tir.Schedule(func)
    block = sch.get(sch.get_sblock("out"))
    x = block.iter_vars[-1]
    assert injective.interleave_factor(block, x.var, int(x.dom.extent)) == stride


def test_no_interleave_in_plain_element_wise_or_transposed_kernels():
    a = te.placeholder((8, 32), "float32", name="a")
    for compute in (lambda i, j: a[i, j] * 2.0, lambda i, j: a[j // 4, i * 4 + j % 4]):
        out = te.compute((8, 32), compute, name="out")
        sch = tvm.s_tir.Schedule(te.create_prim_func([a, out]))
        block = sch.get(sch.get_sblock("out"))
        x = block.iter_vars[-1]
        assert injective.interleave_factor(block, x.var, int(x.dom.extent)) == 1


@pytest.mark.parametrize("stride,width", [(2, 16), (2, 7), (2, 56), (3, 13), (4, 8), (4, 5)])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8"])
def test_interleave_kernels_against_numpy(stride, width, dtype):
    got, expected = _run_against_numpy(interleave(stride, 3, 5, width, dtype), stride, 3, 5,
                                       width, dtype, residual=False)
    np.testing.assert_array_equal(got, expected)


def test_a_residual_read_every_sth_element_is_interleaved_too():
    """A residual add reads the output's own columns: with r outside the vector it reads every
    s-th element (`deinterleave` makes that contiguous loads); no strided store is left."""
    func = interleave(2, 4, 6, 32, residual=True)
    got, expected = _run_against_numpy(func, 2, 4, 6, 32, "float32", residual=True)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert _strided_stores(_lowered(func)) == 0


@pytest.mark.parametrize("stride,width", [(2, 16), (2, 56), (4, 8)])
def test_whole_vectors_leave_no_strided_store(stride, width):
    assert _strided_stores(_lowered(interleave(stride, 3, 4, width))) == 0


def _stores(buffer, value_of, offsets, stride=2, lanes=8):
    base = tirx.Var("b", "int32")
    return [tirx.BufferStore(buffer, value_of(k), [tirx.Ramp(base + k, stride, lanes)])
            for k in offsets]


def test_merge_run_takes_phases_in_any_order():
    out = tirx.decl_buffer((64,), "float32", name="out")
    src = tirx.decl_buffer((64,), "float32", name="src")

    def load(k):
        return tirx.BufferLoad(src, [tirx.Ramp(tirx.IntImm("int32", 8 * k), 1, 8)])

    for offsets in ([0, 1], [1, 0]):
        merged = interleave_stores.merge_run(_stores(out, load, offsets))
        assert merged is not None
        assert int(merged.indices[0].stride) == 1 and int(merged.indices[0].lanes) == 16
        indices = [int(i) for i in merged.value.indices]
        assert indices == [r * 8 + j for j in range(8) for r in range(2)]
        first = merged.value.vectors[0]  # phase 0 reads src at 0
        assert int(first.indices[0].base) == 0


def test_merge_refused_where_memory_could_differ():
    out = tirx.decl_buffer((64,), "float32", name="out")
    src = tirx.decl_buffer((64,), "float32", name="src")

    def load_from(buffer, lanes=8):
        return lambda k: tirx.BufferLoad(buffer, [tirx.Ramp(tirx.IntImm("int32", 8 * k), 1,
                                                            lanes)])

    # A value reading the buffer being stored (the second store could see the first's lanes).
    assert interleave_stores.merge_run(_stores(out, load_from(out), [0, 1])) is None
    # A gap: offsets 0 and 2 of stride 2 are not one contiguous range.
    assert interleave_stores.merge_run(_stores(out, load_from(src), [0, 2])) is None
    # A statement between the stores: nothing is merged.
    stores = _stores(out, load_from(src), [0, 1])
    between = tirx.Evaluate(tirx.IntImm("int32", 0))
    assert interleave_stores.merge_sequence([stores[0], between, stores[1]]) == \
        [stores[0], between, stores[1]]
    # Stride 2 stores of different widths.
    wide = _stores(out, load_from(src, 4), [1], lanes=4)
    assert interleave_stores.merge_run([stores[0], wide[0]]) is None


def test_planted_wrong_lane_order_is_caught(monkeypatch):
    """Phases swapped in the shuffle: the kernel still builds and runs, and the numeric
    comparison above fails on it."""
    right = interleave_stores.merge_run

    def swapped(stmts, binds=()):
        merged = right(stmts, binds)
        if merged is None:
            return None
        shuffle = merged.value
        return tirx.BufferStore(merged.buffer,
                                tirx.Shuffle(list(reversed(list(shuffle.vectors))),
                                             list(shuffle.indices)), merged.indices)

    monkeypatch.setattr(interleave_stores, "merge_run", swapped)
    got, expected = _run_against_numpy(interleave(2, 3, 4, 16), 2, 3, 4, 16, "float32", False)
    assert not np.array_equal(got, expected)


def _loads(buffer, lanes=8):
    return lambda k: tirx.BufferLoad(buffer, [tirx.Ramp(tirx.IntImm("int32", 8 * k), 1, lanes)])


def _store(buffer, base, value, stride=2, lanes=8):
    return tirx.BufferStore(buffer, value, [tirx.Ramp(base, stride, lanes)])


def test_bindings_between_the_stores_move_ahead_of_the_merged_store():
    """TVM names common subexpressions between the stores (`cse_v5 = cse_v3 + 1`): such a
    binding moves ahead; a variable bound twice, or one an earlier store uses, stops the
    merge."""
    out = tirx.decl_buffer((64,), "float32", name="out")
    src = tirx.decl_buffer((64,), "float32", name="src")
    base = tirx.Var("b", "int32")
    second = tirx.Var("b1", "int32")
    load = _loads(src)
    seq = [_store(out, base, load(0)), tirx.Bind(second, base + 1),
           _store(out, second, load(1))]
    merged = interleave_stores.merge_sequence(seq)
    assert len(merged) == 2 and isinstance(merged[0], tirx.Bind)
    assert int(merged[1].indices[0].lanes) == 16

    value = tirx.Var("t", load(0).ty)
    rebound = [tirx.Bind(value, load(0)), _store(out, base, value),
               tirx.Bind(value, load(1)), _store(out, base + 1, value)]
    assert len(interleave_stores.merge_sequence(rebound)) == 4
    peek = tirx.Var("p", "float32")
    reads_out = [_store(out, base, load(0)), tirx.Bind(peek, tirx.BufferLoad(out, [base])),
                 _store(out, base + 1, load(1))]
    assert len(interleave_stores.merge_sequence(reads_out)) == 3


def test_stores_whose_address_reads_the_buffer_or_to_other_buffers_stay():
    out = tirx.decl_buffer((64,), "int32", name="out")
    other = tirx.decl_buffer((64,), "int32", name="other")
    src = tirx.decl_buffer((64,), "int32", name="src")
    load = _loads(src)
    first = tirx.BufferLoad(out, [tirx.IntImm("int32", 0)])
    assert interleave_stores.merge_run([_store(out, first, load(0)),
                                        _store(out, first + 1, load(1))]) is None
    base = tirx.Var("b", "int32")
    assert interleave_stores.merge_run([_store(out, base, load(0)),
                                        _store(other, base + 1, load(1))]) is None
