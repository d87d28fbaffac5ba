"""The EinNet §7 transformations, found by the search from the canonical expressions alone
(default budget, no shape-specific code): each discovery is checked by instantiating the found
expression and, on a reduced shape, by random testing against the original (the conv5x5 →
conv3x3 one by building the found program with tvm.compile and comparing it with TVM's own
conv2d)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_vm
from tvm_einweld.expr import Tensor, random_inputs
from tvm_einweld.expr import canonical as C
from tvm_einweld.relay_passes.instantiate import instantiate
from tvm_einweld.relay_passes.mapping_table import match_conv2d, match_g2bmm
from tvm_einweld.relay_passes.op_cost import is_memory_bound, levels
from tvm_einweld.relay_passes.search import (
    Budget, State, default_rules, default_targets, distance_guided_search,
)
from tvm_einweld.verify import compare_expressions


def kernels(expr):
    return instantiate(expr).kernels


def matmul_plus_offset_reduce(state: State) -> bool:
    ks = kernels(state.expr)
    return any(k == "matmul" for k, _ in ks) and any(n.startswith("OffsetReduce") for _, n in ks)


def undilated_g2bmm(state: State) -> bool:
    """A compute-bound level that is a G2BMM of dilation 1 (the rest are layout eOperators)."""
    heavy = [lv for lv in levels(state.expr) if not is_memory_bound(lv)]
    return len(heavy) == 1 and any(m.attr("dilation") == 1 for m in match_g2bmm(heavy[0]))


def search(expr, goal):
    result = distance_guided_search(expr, default_rules(), default_targets(), Budget(),
                                    stop_when=goal)
    found = [s for s in result.states if goal(s)]
    print(f"\n{result.stats.seconds:.2f} s, {result.stats.states} states, "
          f"{result.stats.pruned} pruned; found by {found[0].rules if found else None}")
    return result, found


def conv3x3(n, c, hw, f):
    return C.conv2d(Tensor("A", (n, c, hw, hw)), Tensor("K", (f, c, 3, 3)), padding=(1, 1, 1, 1))


def conv_transpose(n, c, hw, f):
    return C.conv2d_transpose(Tensor("A", (n, c, hw, hw)), Tensor("K", (c, f, 4, 4)),
                              strides=(2, 2), padding=(1, 1, 1, 1))


def dilated_g2bmm(b, n, k, width, dilation):
    return C.g2bmm(Tensor("A", (b, n, k)), Tensor("B", (b, n, k)), width=width,
                   dilation=dilation)


@pytest.mark.parametrize("make,shape,small", [
    (conv3x3, (1, 512, 7, 512), (1, 8, 7, 8)),
    (conv3x3, (1, 64, 56, 64), (1, 4, 9, 4)),
    (conv_transpose, (16, 256, 2, 448), (2, 8, 2, 8)),
], ids=["conv3x3-512@7x7", "conv3x3-64@56x56", "convtranspose-s2-16x256x2x2-448"])
def test_conv_to_matmul_plus_offset_reduce(make, shape, small):
    result, found = search(make(*shape), matmul_plus_offset_reduce)
    assert found, "the search did not find Matmul + OffsetReduce"
    assert result.stats.stopped_by == "goal"
    # The same rule sequence is found for a small shape, where the interpreter can check it.
    small_expr = make(*small)
    _, small_found = search(small_expr, matmul_plus_offset_reduce)
    assert small_found
    assert compare_expressions(small_expr, small_found[0].expr, trials=2).equal


def test_dilated_g2bmm_to_g2bmm_plus_layout_eoperators():
    result, found = search(dilated_g2bmm(8, 10000, 64, 1000, 4), undilated_g2bmm)
    assert found
    ks = kernels(found[0].expr)
    assert [k for k, _ in ks].count("g2bmm") == 1
    assert all(k in ("g2bmm", "eOperator") for k, _ in ks)
    small = dilated_g2bmm(2, 24, 4, 3, 2)
    _, small_found = search(small, undilated_g2bmm)
    assert small_found and compare_expressions(small, small_found[0].expr, trials=2).equal


def conv_window_plus_offset_reduce(window: int):
    """Goal: the one compute-bound level is a conv with a window×window kernel, the rest
    eOperators, one of them an OffsetReduce (EinNet Fig. 6)."""
    def goal(state: State) -> bool:
        heavy = [lv for lv in levels(state.expr) if not is_memory_bound(lv)]
        if state.depth == 0 or len(heavy) != 1:
            return False
        extents = {it.name: it.extent for it in heavy[0].iterators}
        if not any(all(extents[r] == window for _, r, _ in m.attr("spatial"))
                   for m in match_conv2d(heavy[0])):
            return False
        return any(n.startswith("OffsetReduce") for _, n in kernels(state.expr))

    return goal


def conv_k(shape, filters, k):
    return C.conv2d(Tensor("A", shape), Tensor("K", (filters, shape[1], k, k)),
                    padding=(k // 2,) * 4)


def tvm_conv2d(data, weight, padding):
    """TVM's own conv2d (relax.op.nn.conv2d through tvm.compile) on numpy arrays."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(data.shape, "float32"))
    w = relax.Var("w", relax.TensorType(weight.shape, "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv2d(x, w, padding=padding))
        bb.emit_func_output(out)
    return run_vm(bb.get(), data, weight)


@pytest.mark.parametrize("shape,filters,k,window,compile_check", [
    ((16, 32, 224, 224), 1, 5, 3, False),  # the benchmark's case: found, instantiated
    ((1, 8, 13, 11), 4, 5, 3, True),
    ((1, 3, 9, 10), 2, 7, 3, True),
], ids=["conv5x5-16x32x224-1", "conv5x5-1x8x13x11-4", "conv7x7-1x3x9x10-2"])
def test_conv_to_smaller_window_conv_plus_offset_reduce(shape, filters, k, window,
                                                        compile_check):
    """EinNet Fig. 6 from the canonical expression: the k×k conv becomes a 3×3 conv with
    ⌈k/3⌉² times the output channels and an OffsetReduce, found by window splitting and
    converging derivation within the first expansion."""
    from tvm_einweld.relay_passes import build

    expr = conv_k(shape, filters, k)
    goal = conv_window_plus_offset_reduce(window)
    result, found = search(expr, goal)
    assert found and result.stats.stopped_by == "goal"
    assert found[0].rules[0] == "window_splitting"
    assert result.stats.seconds < 20
    inst = instantiate(found[0].expr)
    offsets = (-(-k // window)) ** 2
    assert ("conv2d", f"{offsets * filters}x{shape[1]}x{window}x{window}") in inst.kernels
    if not compile_check:
        return
    inputs = random_inputs(expr, seed=4)
    got = build(inst)(*[inputs[n] for n in inst.input_names])
    want = tvm_conv2d(inputs["A"], inputs["K"], (k // 2,) * 4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
