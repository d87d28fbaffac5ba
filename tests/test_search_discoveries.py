"""The EinNet §7 transformations, found by the search from the canonical expressions alone
(default budget, no shape-specific code): each discovery is checked by instantiating the found
expression and, on a reduced shape, by random testing against the original."""
from __future__ import annotations

import pytest

from tvm_einweld.expr import Tensor
from tvm_einweld.expr import canonical as C
from tvm_einweld.relay_passes.instantiate import instantiate
from tvm_einweld.relay_passes.mapping_table import match_g2bmm
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
