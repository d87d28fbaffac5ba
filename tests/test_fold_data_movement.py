"""FoldDataMovement: data-movement calls and copy kernels on constants folded with numpy, bit
for bit what TVM's FoldConstant computes; kernels that compute, cast, or do not write every
output element exactly once are left to FoldConstant (planted)."""
import numpy as np
import pytest
import tvm
from tvm import relax, te
from tvm.ir.expr import Constant
from tvm.script import tirx as T

from tvm_einweld.relay_passes.fold_data_movement import (FoldDataMovement, evaluate_copy_kernel,
                                                         fold_copy_kernel)
from tvm_einweld.tir_passes import prepare
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu import ApplyCPURules
from tvm_einweld.tir_passes.rules.cpu.apply import _kernels_without_symbols, prepack_weights


def _calls(mod, name=None):
    return [b.value for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
            and (name is None or b.value.op.name == name)]


def _run(mod, inputs, pipeline=None):
    ex = tvm.compile(mod, host_target(), relax_pipeline=pipeline) if pipeline else \
        tvm.compile(mod, host_target())
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in inputs])
    return [o.numpy() for o in out] if not hasattr(out, "numpy") else [out.numpy()]


def test_data_movement_of_constants_is_folded_bit_for_bit(rng):
    c = relax.const(rng.standard_normal((7, 5)).astype("float32"))
    ints = relax.const(rng.integers(-9, 9, (3, 1, 5)).astype("int32"))
    idx = relax.const(np.array([4, 0, 2, 4], "int64"))
    x = relax.Var("x", relax.TensorType((2, 7, 5), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            r = bb.emit(relax.op.reshape(c, (1, 7, 5)))
            p = bb.emit(relax.op.permute_dims(r, [2, 0, 1]))
            t = bb.emit(relax.op.take(p, idx, axis=0))
            cat = bb.emit(relax.op.concat([t, t], axis=2))
            st = bb.emit(relax.op.stack([r, r, r], axis=1))
            sq = bb.emit(relax.op.squeeze(bb.emit(relax.op.expand_dims(c, 0)), [0]))
            bc = bb.emit(relax.op.broadcast_to(sq, (2, 7, 5)))
            fl = bb.emit(relax.op.flatten(ints))
            out = bb.emit_output(relax.Tuple([relax.op.add(x, bc), cat, st, fl]))
        bb.emit_func_output(out)
    mod = bb.get()
    folded = FoldDataMovement(mod)
    assert not [c for c in _calls(folded) if c.op.name != "relax.add"], folded
    arg = rng.standard_normal((2, 7, 5)).astype("float32")
    for got, want in zip(_run(folded, [arg]), _run(mod, [arg])):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_calls_on_inputs_and_out_of_range_gathers_stay(rng):
    x = relax.Var("x", relax.TensorType((4, 3), "float32"))
    c = relax.const(rng.standard_normal((4, 3)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.permute_dims(x))  # not a constant
            b = bb.emit(relax.op.take(c, relax.const(np.array([0, 9], "int64")), axis=0,
                                      mode="clip"))  # out of range: TVM's mode decides
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    mod = bb.get()
    folded = FoldDataMovement(mod)
    assert {c.op.name for c in _calls(folded)} == {"relax.permute_dims", "relax.take"}


@pytest.mark.parametrize("shapes", [((1, 13, 9, 9), (7, 13, 3, 3)),   # conv, odd channels
                                    ((1, 5, 6, 6), (16, 5, 1, 1))])
def test_weight_packing_kernels_fold_to_what_fold_constant_computes(rng, shapes):
    """The `*_weight_prepack` kernels of compile-time weight packing (conv and matmul weights
    whose panels need zero padding) fold in numpy to FoldConstant's constants, and the packed
    module computes what the unpacked one does."""
    (xs, ws) = shapes
    x = relax.Var("x", relax.TensorType(xs, "float32"))
    m = relax.Var("m", relax.TensorType((37, 29), "float32"))
    w = relax.const(rng.standard_normal(ws).astype("float32"))
    w2 = relax.const(rng.standard_normal((29, 43)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, m]):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple([relax.op.nn.conv2d(x, w, padding=1),
                                              relax.op.matmul(m, w2)]))
        bb.emit_func_output(out)
    mod = prepare()(bb.get())
    target = host_target()
    with target:
        split = tvm.transform.Sequential([
            relax.transform.AttachAttrLayoutFreeBuffers(), ApplyCPURules(target),
            _kernels_without_symbols, relax.transform.SplitLayoutRewritePreproc()])(mod)
        reference = relax.transform.FoldConstant()(split)
    prepacks = [c for c in _calls(split, "relax.call_tir") if "weight_prepack" in
                c.args[0].name_hint]
    assert prepacks  # the matmul's at least (43 columns: a zero-padded last panel)
    for call in prepacks:
        folded = fold_copy_kernel(call, split, lambda a: a if isinstance(a, Constant) else None)
        assert folded is not None
        want = FoldConstantValue(reference, call)
        assert np.array_equal(folded.value.numpy(), want)
    inputs = [rng.standard_normal(xs).astype("float32"),
              rng.standard_normal((37, 29)).astype("float32")]
    pipeline = tvm.transform.Sequential([prepare(), prepack_weights(target),
                                         relax.pipeline.default_build_pipeline()])
    for got, want in zip(_run(bb.get(), inputs, pipeline), _run(bb.get(), inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def FoldConstantValue(folded_mod, call):  # pylint: disable=invalid-name
    """The constant FoldConstant put where `call`'s result is used: the packed kernel's
    argument of the same shape."""
    shape = tuple(int(v) for v in call.ty.shape.values)
    for c in _calls(folded_mod, "relax.call_tir"):
        for a in c.args[1].fields:
            if isinstance(a, Constant) and a.value.numpy().shape == shape:
                return a.value.numpy()
    raise AssertionError("no folded constant of the packed shape")


def test_padding_copy_kernel_from_te(rng):
    a = te.placeholder((5, 3), name="A")
    b = te.compute((4, 8), lambda i, j: tvm.tirx.if_then_else(
        tvm.tirx.all(i < 3, j < 5), a[j % 5, i % 3], tvm.tirx.const(0.0, "float32")), name="B")
    value = rng.standard_normal((5, 3)).astype("float32")
    got = evaluate_copy_kernel(te.create_prim_func([a, b]), [value])
    want = np.zeros((4, 8), "float32")
    want[:3, :5] = value.T
    assert np.array_equal(got, want)


@T.prim_func(s_tir=True)
def _half_written(A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
    for i in range(4):
        with T.sblock("copy"):
            vi = T.axis.spatial(8, i)
            B[vi] = A[vi]


@T.prim_func(s_tir=True)
def _written_twice(A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("copy"):
            vi = T.axis.spatial(8, i)
            B[vi // 2] = A[vi]


@T.prim_func(s_tir=True)
def _scaled(A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("copy"):
            vi = T.axis.spatial(8, i)
            B[vi] = A[vi] * T.float32(2)


@T.prim_func(s_tir=True)
def _cast(A: T.Buffer((8,), "int32"), B: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("copy"):
            vi = T.axis.spatial(8, i)
            B[vi] = T.Cast("float32", A[vi])


@T.prim_func(s_tir=True)
def _reversed(A: T.Buffer((8,), "float32"), B: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("copy"):
            vi = T.axis.spatial(8, i)
            B[7 - vi] = A[vi]


@pytest.mark.parametrize("func,dtype", [(_half_written, "float32"), (_written_twice, "float32"),
                                        (_scaled, "float32"), (_cast, "int32")])
def test_kernels_that_are_not_copies_are_left_to_fold_constant(func, dtype):
    with pytest.raises(ValueError):
        evaluate_copy_kernel(func, [np.arange(8).astype(dtype)])


def test_a_planted_copy_kernel_is_evaluated():
    assert np.array_equal(evaluate_copy_kernel(_reversed, [np.arange(8).astype("float32")]),
                          np.arange(8)[::-1].astype("float32"))
