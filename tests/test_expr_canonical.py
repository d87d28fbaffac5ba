"""Every canonical expression against TVM's own build of the op (numpy for G2BMM/GBMM),
through both the numpy interpreter and the TE lowering."""
import numpy as np
import pytest
from tvm import relax

from conftest import run_vm
from tvm_einweld.expr import Tensor, evaluate
from tvm_einweld.expr import canonical as C
from tvm_einweld.expr.from_relax import UnsupportedOperator, expr_of_call, single_op_module
from tvm_einweld.expr.lowering import build

rng = np.random.default_rng(0)


def run_relax_op(make_call, shapes):
    """Build a one-op Relax function, compile it with TVM, run it; return (call, inputs, out)."""
    mod, call = single_op_module(make_call, shapes)
    inputs = [rng.uniform(-1, 1, s).astype("float32") for s in shapes]
    result = run_vm(mod, *inputs)
    return call, inputs, result


def check_against_tvm(make_call, shapes, rtol=1e-4, atol=1e-4):
    call, inputs, expected = run_relax_op(make_call, shapes)
    names = [f"x{k}" for k in range(len(shapes))]
    expr = expr_of_call(call, names)
    env = dict(zip(names, inputs))
    np.testing.assert_allclose(evaluate(expr, env), expected, rtol=rtol, atol=atol)
    run, order = build(expr)
    np.testing.assert_allclose(run(*[env[n] for n in order]), expected, rtol=rtol, atol=atol)
    return expr


CONV_CASES = [
    # (data shape, weight shape, kwargs)
    ((1, 8, 9, 9), (16, 8, 3, 3), dict(padding=1)),
    ((2, 6, 11, 10), (4, 6, 3, 3), dict(strides=2, padding=(1, 0, 2, 1))),
    ((1, 5, 13, 13), (7, 5, 3, 3), dict(dilation=2, padding=2)),
    ((1, 8, 10, 10), (6, 4, 3, 3), dict(groups=2, padding=1)),
    ((1, 4, 12, 12), (3, 4, 5, 5), dict(strides=(2, 1), padding=2)),
    ((1, 9, 9, 8), (3, 3, 8, 12), dict(padding=1, data_layout="NHWC", kernel_layout="HWIO")),
    ((1, 9, 9, 8), (12, 3, 3, 8), dict(strides=2, data_layout="NHWC", kernel_layout="OHWI")),
]


@pytest.mark.parametrize("data,weight,kw", CONV_CASES)
def test_conv2d(data, weight, kw):
    check_against_tvm(lambda x, w: relax.op.nn.conv2d(x, w, **kw), [data, weight])


@pytest.mark.parametrize("data,weight,kw", [
    ((1, 4, 5, 5), (4, 3, 4, 4), dict(strides=2, padding=1)),
    ((2, 3, 4, 6), (3, 5, 3, 3), dict(strides=2, padding=1, output_padding=1)),
    ((1, 6, 2, 2), (6, 7, 2, 2), dict(strides=1)),
    ((1, 2, 7, 5), (2, 2, 9, 9), dict(strides=4, padding=(3, 4, 2, 1))),
])
def test_conv2d_transpose(data, weight, kw):
    check_against_tvm(lambda x, w: relax.op.nn.conv2d_transpose(x, w, **kw), [data, weight])


@pytest.mark.parametrize("a,b", [
    ((5, 7), (7, 3)),
    ((2, 5, 7), (7, 3)),
    ((3, 1, 4, 6), (2, 6, 5)),
    ((1, 4, 6), (3, 6, 5)),
])
def test_matmul(a, b):
    check_against_tvm(relax.op.matmul, [a, b])


def test_dense_style_matmul_with_transposed_weight():
    a = rng.uniform(-1, 1, (6, 10)).astype("float32")
    w = rng.uniform(-1, 1, (4, 10)).astype("float32")
    expr = C.matmul(Tensor("A", a.shape), Tensor("W", w.shape), transpose_b=True)
    np.testing.assert_allclose(evaluate(expr, {"A": a, "W": w}), a @ w.T, rtol=1e-5, atol=1e-5)
    run, order = build(expr)
    np.testing.assert_allclose(run(a, w), a @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,axes", [((2, 3, 4), (2, 0, 1)), ((3, 5), None), ((2, 3, 4, 5), (0, 2, 3, 1))])
def test_permute_dims(shape, axes):
    check_against_tvm(lambda x: relax.op.permute_dims(x, axes), [shape])


@pytest.mark.parametrize("shape,new", [((2, 3, 4), (6, 4)), ((6, 10), (3, 4, 5)), ((2, 3, 5), (5, 6))])
def test_reshape(shape, new):
    check_against_tvm(lambda x: relax.op.reshape(x, new), [shape])


@pytest.mark.parametrize("op", [relax.op.add, relax.op.subtract, relax.op.multiply])
@pytest.mark.parametrize("a,b", [((2, 3, 4), (2, 3, 4)), ((1, 4, 5, 5), (1, 4, 1, 1)), ((3, 1), (1, 5))])
def test_elementwise(op, a, b):
    check_against_tvm(op, [a, b])


@pytest.mark.parametrize("op", [relax.op.nn.relu, relax.op.tanh, relax.op.sigmoid, relax.op.exp])
def test_unary(op):
    check_against_tvm(op, [(2, 3, 7)])


def test_bias_add():
    x = rng.uniform(-1, 1, (1, 4, 3, 3)).astype("float32")
    b = rng.uniform(-1, 1, (4,)).astype("float32")
    expr = C.bias_add(Tensor("X", x.shape), Tensor("B", b.shape), axis=1)
    np.testing.assert_allclose(evaluate(expr, {"X": x, "B": b}), x + b[None, :, None, None], rtol=1e-6)


@pytest.mark.parametrize("batch,n,k,width,dilation", [(2, 16, 8, 3, 1), (1, 23, 5, 2, 4)])
def test_g2bmm_and_gbmm_match_numpy(batch, n, k, width, dilation):
    a = rng.uniform(-1, 1, (batch, n, k)).astype("float32")
    b = rng.uniform(-1, 1, (batch, n, k)).astype("float32")
    band = rng.uniform(-1, 1, (batch, n, 2 * width + 1)).astype("float32")
    g2 = C.g2bmm(Tensor("A", a.shape), Tensor("B", b.shape), width, dilation)
    ref = C.g2bmm_reference(a, b, width, dilation)
    np.testing.assert_allclose(evaluate(g2, {"A": a, "B": b}), ref, rtol=1e-5, atol=1e-6)
    run, order = build(g2)
    np.testing.assert_allclose(run(a, b), ref, rtol=1e-5, atol=1e-5)
    gb = C.gbmm(Tensor("A", band.shape), Tensor("B", b.shape), width, dilation)
    ref = C.gbmm_reference(band, b, width, dilation)
    np.testing.assert_allclose(evaluate(gb, {"A": band, "B": b}), ref, rtol=1e-5, atol=1e-6)
    run, order = build(gb)
    np.testing.assert_allclose(run(band, b), ref, rtol=1e-5, atol=1e-5)


def test_band_references_agree_with_dense_formulation():
    """G2BMM/GBMM references checked against a dense masked formulation (independent)."""
    n, w, d = 11, 2, 3
    a, b = rng.uniform(-1, 1, (1, n, 4)), rng.uniform(-1, 1, (1, n, 4))
    full = a[0] @ b[0].T
    ref = C.g2bmm_reference(a, b, w, d)[0]
    for i in range(n):
        for jj, j in enumerate(range(-w, w + 1)):
            col = i + d * j
            assert ref[i, jj] == pytest.approx(full[i, col] if 0 <= col < n else 0.0)


def test_unsupported_ops_raise_clearly():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    with bb.function("main", [x]):
        out = bb.emit(relax.op.nn.softmax(x))
        bb.emit_func_output(out)
    call = bb.get()["main"].body.blocks[0].bindings[0].value
    with pytest.raises(UnsupportedOperator, match="softmax"):
        expr_of_call(call, ["x"])
    xi = relax.Var("xi", relax.TensorType((2, 3), "int32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xi]):
        out = bb.emit(relax.op.add(xi, xi))
        bb.emit_func_output(out)
    call = bb.get()["main"].body.blocks[0].bindings[0].value
    with pytest.raises(UnsupportedOperator, match="dtype int32"):
        expr_of_call(call, ["a", "b"])
