"""The paper's motivating derivations (Figs. 5, 6, 14, §4.2), applied by hand, instantiated to
Relax, built with tvm.compile and compared with the original operator built by TVM itself,
on random inputs, for two shapes per case (one not a power of two)."""
import numpy as np
import pytest

from conftest import run_vm
from tvm_einweld.expr import Tensor, canonical, evaluate, random_inputs
from tvm_einweld.relay_passes import build, instantiate
from tvm_einweld.relay_passes.cases import (
    conv3x3_to_matmul, conv5x5_to_conv3x3, conv_transpose_to_matmul, dilated_g2bmm,
    merged_matmuls, original_module,
)
from tvm_einweld.verify import compare_expressions


def run_module(mod, arrays):
    out = run_vm(mod, *arrays)
    return out if isinstance(out, tuple) else (out,)


def check_case(case, expected_kernels, **options):
    for before, after in zip(case.original, case.derived):
        assert compare_expressions(before, after).equal
    inst = instantiate(case.derived[0] if len(case.derived) == 1 else case.derived, **options)
    kinds = sorted(k if k != "eOperator" else n.split("_")[0] for k, n in inst.kernels)
    assert kinds == sorted(expected_kernels), inst.kernels
    inputs = {}
    for i, e in enumerate(case.original):
        inputs.update(random_inputs(e, seed=3 + i))
    arrays = [inputs[n] for n in inst.input_names]
    derived = build(inst)(*arrays)
    derived = derived if isinstance(derived, tuple) else (derived,)
    original = run_module(original_module(case), arrays)
    assert len(derived) == len(original)
    for d, o, e in zip(derived, original, case.original):
        np.testing.assert_allclose(d, o, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(d, evaluate(e, inputs), rtol=1e-4, atol=1e-4)
    return inst


@pytest.mark.parametrize("shape", [(1, 16, 8, 8), (2, 12, 7, 9)])
def test_conv3x3_becomes_matmul_plus_offset_reduce(shape):
    n, c, h, w = shape
    case = conv3x3_to_matmul(Tensor("A", shape), Tensor("K", (2 * c - 4, c, 3, 3)), verify=True)
    assert [d.rule for d in case.steps] == ["summation_splitting", "variable_substitution",
                                            "traversal_merging", "boundary_tightening",
                                            "boundary_tightening"]
    check_case(case, ["matmul", "OffsetReduce"])


@pytest.mark.parametrize("shape", [(1, 16, 4, 4), (2, 12, 3, 5)])
def test_strided_conv_transpose_becomes_matmul_plus_eoperator(shape):
    n, c, h, w = shape
    case = conv_transpose_to_matmul(Tensor("A", shape), Tensor("W", (c, 10, 4, 4)), verify=True)
    check_case(case, ["matmul", "OffsetReduce"])


@pytest.mark.parametrize("shape,f", [((1, 8, 8, 8), 4), ((1, 6, 9, 7), 3)])
def test_conv5x5_becomes_conv3x3_with_four_times_the_channels(shape, f):
    case = conv5x5_to_conv3x3(Tensor("A", shape), Tensor("K", (f, shape[1], 5, 5)),
                              verify=True)
    inst = check_case(case, ["DLT", "conv2d", "OffsetReduce"])
    assert ("conv2d", f"{4 * f}x{shape[1]}x3x3") in inst.kernels


@pytest.mark.parametrize("n", [16, 13])
def test_dilated_g2bmm_becomes_dense_g2bmm_with_layout_eoperators(n):
    a, b = Tensor("A", (2, n, 16)), Tensor("B", (2, n, 16))
    case = dilated_g2bmm(a, b, width=3, dilation=2, verify=True)
    check_case(case, ["DLT", "DLT", "g2bmm", "DLT"])
    inputs = random_inputs(case.original[0], seed=5)
    inst = instantiate(case.derived[0])
    out = build(inst)(inputs["A"], inputs["B"])
    np.testing.assert_allclose(out, canonical.g2bmm_reference(inputs["A"], inputs["B"], 3, 2),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n1,n2", [(8, 16, 16), (7, 10, 5)])
def test_two_matmuls_sharing_an_input_become_one(m, n1, n2):
    case = merged_matmuls(Tensor("A", (m, 12)), Tensor("B1", (12, n1)), Tensor("B2", (12, n2)))
    check_case(case, ["concat", "matmul"], threshold=0)


def test_offset_reduce_and_relu_fuse_into_one_eoperator():
    """Fig. 3(a): after the conv3x3 derivation, the Relu that consumed the conv is fused with
    the OffsetReduce (expression fusion), giving one Matmul and one eOperator."""
    from tvm_einweld.relay_passes import fuse

    shape, weight = (1, 16, 9, 7), (24, 16, 3, 3)
    case = conv3x3_to_matmul(Tensor("A", shape), Tensor("K", weight))
    relu = canonical.relu(Tensor("T", case.original[0].shape))
    fused = fuse(relu, "T", case.derived[0]).result
    inst = instantiate(fused)
    assert [k for k, _ in inst.kernels] == ["matmul", "eOperator"]
    assert inst.kernels[1][1] == "OffsetReduce_Relu"
    inputs = random_inputs(case.original[0], seed=9)
    out = build(inst)(*[inputs[n] for n in inst.input_names])
    np.testing.assert_allclose(out, np.maximum(evaluate(case.original[0], inputs), 0),
                               rtol=1e-4, atol=1e-4)
