"""Algorithm 1's split of Relax functions into subprograms, and rebuilding with replacements."""
from __future__ import annotations

import numpy as np
import pytest
from tvm import relax, tirx
from tvm_ffi import structural_equal

from tvm_einweld.expr.fingerprint import structurally_equal
from tvm_einweld.relay_passes.subprograms import rebuild_function, split_function, split_module
from tvm_einweld.verify import compare_relax


def model():
    """conv → add → relu → conv, conv (same input) → max_pool → matmul."""
    rng = np.random.default_rng(0)
    const = lambda *s: relax.const(rng.uniform(-1, 1, s).astype("float32"))
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c1 = bb.emit(relax.op.nn.conv2d(x, const(4, 4, 3, 3), padding=1))
            b1 = bb.emit(relax.op.add(c1, const(1, 4, 1, 1)))
            r1 = bb.emit(relax.op.nn.relu(b1))
            w = const(4, 4, 1, 1)
            c2 = bb.emit(relax.op.nn.conv2d(r1, w))
            c3 = bb.emit(relax.op.nn.conv2d(r1, w))
            s = bb.emit(relax.op.add(c2, c3))
            p = bb.emit(relax.op.nn.max_pool2d(s, pool_size=(2, 2), strides=(2, 2)))
            flat = bb.emit(relax.op.reshape(p, (4, 16)))
            m = bb.emit(relax.op.matmul(flat, const(16, 5)))
            out = bb.emit_output(m)
        bb.emit_func_output(out)
    return bb.get()


def test_split_at_activations_and_unsupported_ops():
    mod = model()
    split = split_function(mod["main"])
    kinds = [s.kinds for s in split.subprograms]
    assert kinds == [("relax.nn.conv2d", "relax.add"),
                     ("relax.nn.conv2d", "relax.nn.conv2d", "relax.add"),
                     ("relax.reshape", "relax.matmul")]
    reasons = dict(split.left_alone)
    assert "activation" in reasons["lv2"]
    assert "max_pool2d" in reasons["lv6"]
    assert [s.index for s in split.subprograms] == [0, 1, 2]


def test_expressions_and_shared_names():
    split = split_function(model()["main"])
    conv_a, conv_b, _ = split.subprograms[1].ops
    # Both 1x1 convolutions read the same activation and the same weight constant.
    assert conv_a.names == conv_b.names
    assert structurally_equal(conv_a.expr, conv_b.expr)
    first = split.subprograms[0].ops[0]
    assert first.expr.shape == (1, 4, 8, 8) and len(first.expr.sums) == 3
    # add reads the convolution's result by its variable's name.
    add = split.subprograms[0].ops[1]
    assert add.names[0].startswith(first.var.name)


def test_rebuild_identity_is_structurally_equal():
    mod = model()
    split = split_module(mod)["main"]
    reps = {op.var: (lambda bb, op=op: op.call) for s in split.subprograms for op in s.ops}
    assert structural_equal(rebuild_function(mod, "main", reps), mod)
    assert structural_equal(rebuild_function(mod, "main", {}), mod)


def test_rebuild_with_replacement_computes_the_same():
    mod = model()
    op = split_function(mod["main"]).subprograms[2].ops[1]  # the matmul
    a, b = op.args
    # matmul(a, b) = transpose(matmul(transpose(b), transpose(a))), emitted as helper bindings.
    def emit(bb):
        bt = bb.emit(relax.op.permute_dims(b))
        at = bb.emit(relax.op.permute_dims(a))
        return relax.op.permute_dims(bb.emit(relax.op.matmul(bt, at)))

    new = rebuild_function(mod, "main", {op.var: emit})
    assert not structural_equal(new, mod)
    assert compare_relax(new, mod).equal


def test_rebuild_rejects_a_wrong_type():
    mod = model()
    op = split_function(mod["main"]).subprograms[2].ops[1]
    with pytest.raises(ValueError, match="type"):
        rebuild_function(mod, "main", {op.var: lambda bb: relax.op.permute_dims(op.args[0])})


def test_rebuild_leaves_new_kernels_without_symbols():
    """Two replacements adding a TIR kernel with the same symbol still build (the builder
    renames the second GlobalVar; the symbols are dropped, as Relax's own kernels have none
    before the build)."""
    from tvm import te

    mod = model()
    split = split_function(mod["main"])
    ops = [split.subprograms[1].ops[0], split.subprograms[1].ops[1]]  # the two 1x1 convs

    def emitter(op):
        def emit(bb):
            x, w = op.args
            a = te.placeholder((1, 4, 8, 8), "float32", name="a")
            k = te.placeholder((4, 4, 1, 1), "float32", name="k")
            c = te.reduce_axis((0, 4), name="c")
            out = te.compute((1, 4, 8, 8), lambda n, f, y, xx: te.sum(
                a[n, c, y, xx] * k[f, c, 0, 0], axis=c), name="conv1x1")
            func = te.create_prim_func([a, k, out]).with_attr("global_symbol", "dup")
            gvar = bb.add_func(func, "dup")
            return relax.call_tir(gvar, [x, w], relax.TensorType((1, 4, 8, 8), "float32"))
        return emit

    new = rebuild_function(mod, "main", {op.var: emitter(op) for op in ops})
    assert not [gv for gv, f in new.functions_items() if isinstance(f, tirx.PrimFunc)
                and f.attrs is not None and "global_symbol" in f.attrs]
    assert compare_relax(new, mod).equal
