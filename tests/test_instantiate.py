"""Instantiation to Relax: matched operators, eOperators with the default schedule, layouts;
every module is built with tvm.compile and compared with the interpreter on random inputs."""
import re

import numpy as np
from tvm import relax

from conftest import run_vm
from tvm_einweld.expr import Expr, Iterator, Tensor, canonical, evaluate, random_inputs
from tvm_einweld.relay_passes import build, instantiate
from tvm_einweld.relay_passes.eoperator import eoperator_func, eoperator_target
from tvm_einweld.relay_passes.op_cost import EOP_MAX_INTENSITY, kernel_intensity
from tvm_einweld.tir_passes.rules.cpu import vector_isa


def run_and_compare(expr, **options):
    inst = instantiate(expr, **options)
    inputs = random_inputs(expr, seed=1)
    out = build(inst)(*[inputs[n] for n in inst.input_names])
    np.testing.assert_allclose(out, evaluate(expr, inputs), rtol=1e-4, atol=1e-4)
    return inst


def test_default_schedule_parallel_vectorised_and_correct():
    # An OffsetReduce-like sum over shifted reads of a padded tensor; inner extents 96 and 101
    # (vector chunks as wide as the target's registers, the chunks a padding condition cuts
    # left scalar) and 7 (every chunk holds a padding edge: scalar throughout). Tall enough
    # (512 rows) to be worth parallel tasks; run on 4 rows.
    lanes_wide = str(vector_isa(eoperator_target()).lanes("float32"))
    for width in (96, 7, 101):
        def offset_reduce(rows):
            t = Tensor("T", (3, 3, rows, width))
            f, y, x = Iterator("f", 0, 4), Iterator("y", 0, rows), Iterator("x", 0, width)
            r, s = Iterator("r", 0, 3), Iterator("s", 0, 3)
            body = t.with_pad(((0, 0), (0, 0), (1, 1), (1, 1)))[r.var, s.var, y.var + r.var - 1,
                                                               x.var + s.var - 1]
            return Expr((f, y, x), (r, s), body * 1.0 + 0.0)

        text = eoperator_func(offset_reduce(512), "OffsetReduce", ["T"]).script()
        assert "T.parallel" in text
        lanes = re.findall(r"T\.vectorized\((?:T\.int\d+\()?(\d+)", text)
        # Three pieces, each a vectorised reduction and the copy-out of its accumulator (at
        # 101 the last piece's copy-out is one element: no loop); at width 7 the reductions
        # stay scalar and only a whole-vector copy-out is vectorised.
        assert lanes == [lanes_wide] * {96: 6, 7: 1, 101: 5}[width]
        inst = run_and_compare(offset_reduce(4))
        assert inst.kernels == (("eOperator", "Kernel"),)


def test_conv2d_with_stride_dilation_asymmetric_padding_instantiates_as_conv2d():
    x, k = Tensor("X", (2, 3, 11, 10)), Tensor("K", (5, 3, 3, 2))
    attrs = dict(strides=(2, 1), dilation=(1, 2), padding=(1, 0, 2, 1))
    expr = canonical.conv2d(x, k, **attrs)
    inst = run_and_compare(expr)
    assert [kind for kind, _ in inst.kernels] == ["conv2d"]
    # Against TVM's own conv2d as well.
    bb = relax.BlockBuilder()
    xv, kv = relax.Var("X", relax.TensorType(x.shape)), relax.Var("K", relax.TensorType(k.shape))
    with bb.function("main", [xv, kv]):
        with bb.dataflow():
            o = bb.emit_output(relax.op.nn.conv2d(xv, kv, strides=[2, 1], dilation=[1, 2],
                                                  padding=[1, 0, 2, 1]))
        bb.emit_func_output(o)
    inputs = random_inputs(expr, seed=2)
    ref = run_vm(bb.get(), inputs["X"], inputs["K"])
    out = build(inst)(inputs["K"], inputs["X"])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_batch_matmul_with_transposed_operand():
    a, b = Tensor("A", (3, 8, 16)), Tensor("B", (3, 12, 16))
    inst = run_and_compare(canonical.matmul(a, b, transpose_b=True))
    assert [kind for kind, _ in inst.kernels] == ["matmul"]
    assert "permute_dims" in inst.mod["main"].script()


def test_memory_bound_expressions_become_named_eoperators():
    a = Tensor("A", (4, 6, 5))
    expr = canonical.permute_dims(a, (2, 0, 1))
    assert kernel_intensity(expr) < EOP_MAX_INTENSITY
    inst = run_and_compare(expr)
    assert inst.kernels == (("eOperator", "DLT"),)
    small = canonical.matmul(Tensor("P", (2, 3)), Tensor("Q", (3, 2)))  # memory-bound
    assert [k for k, _ in run_and_compare(small).kernels] == ["eOperator"]
    assert [k for k, _ in run_and_compare(small, threshold=0).kernels] == ["matmul"]


def test_split_expression_instantiates_as_two_matmuls_and_a_concat():
    from tvm_einweld.relay_passes import ExpressionSplitting, apply_at

    expr = canonical.matmul(Tensor("A", (8, 32)), Tensor("B", (32, 24)))
    split = apply_at(ExpressionSplitting(["n"], at=10), expr).result
    inst = run_and_compare(split, threshold=0)
    assert [k for k, _ in inst.kernels] == ["matmul", "matmul", "concat"]


def test_grouped_and_depthwise_conv_instantiate_as_grouped_conv2d():
    for c, f, groups in ((6, 9, 3), (5, 5, 5)):
        expr = canonical.conv2d(Tensor("X", (1, c, 9, 8)), Tensor("K", (f, c // groups, 3, 3)),
                                groups=groups, strides=(2, 1), padding=(1, 1, 1, 1))
        inst = run_and_compare(expr, threshold=0)
        assert inst.kernels == (("conv2d", f"{f}x{c // groups}x3x3 groups={groups}"),)


def test_package_instantiate_stays_the_function_after_its_submodule_is_imported():
    """`relay_passes.instantiate` is a function although a submodule has the same name: it
    must not turn into the module once something imports `relay_passes.instantiate`."""
    import importlib

    import tvm_einweld.relay_passes as rp

    importlib.import_module("tvm_einweld.relay_passes.instantiate")
    import tvm_einweld.relay_passes.derivation_transform  # noqa: F401  (imports it too)

    assert callable(rp.instantiate) and callable(rp.build)
    from tvm_einweld.relay_passes import instantiate as again

    assert again is rp.instantiate and callable(again)
