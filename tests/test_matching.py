"""Iterator-mapping table: expression distance and attribute matching from coefficients."""
from tvm_einweld.expr import Tensor, canonical
from tvm_einweld.relay_passes import TABLE, expression_distance, match
from tvm_einweld.relay_passes.cases import conv3x3_to_matmul
from tvm_einweld.relay_passes.derivation import locations
from tvm_einweld.relay_passes.mapping_table import match_conv2d, match_g2bmm, match_matmul


def test_canonical_operators_have_distance_zero_to_their_row():
    a, b = Tensor("A", (2, 5, 6)), Tensor("B", (2, 6, 7))
    cases = {
        "matmul": canonical.matmul(Tensor("P", (5, 6)), Tensor("Q", (6, 7))),
        "batch_matmul": canonical.matmul(a, b),
        "conv2d": canonical.conv2d(Tensor("X", (1, 3, 8, 8)), Tensor("K", (4, 3, 3, 3)),
                                   strides=(2, 2), padding=(1, 1, 1, 1)),
        "conv2d_transpose": canonical.conv2d_transpose(
            Tensor("X", (1, 3, 4, 4)), Tensor("W", (3, 5, 4, 4)), strides=(2, 2),
            padding=(1, 1, 1, 1)),
        "g2bmm": canonical.g2bmm(Tensor("G", (2, 9, 4)), Tensor("H", (2, 9, 4)), 2, 3),
        "gbmm": canonical.gbmm(Tensor("G", (2, 9, 5)), Tensor("H", (2, 9, 4)), 2, 1),
        "elementwise": canonical.multiply(Tensor("U", (3, 4)), Tensor("V", (3, 4))),
    }
    for op, expr in cases.items():
        assert expression_distance(expr, op) == 0, op
        others = [o for o in TABLE if o != op and expression_distance(expr, o) == 0]
        assert not others, (op, others)


def test_distance_of_the_conv3x3_scope_to_matmul_counts_unmerged_iterators():
    c = conv3x3_to_matmul(Tensor("A", (1, 4, 6, 6)), Tensor("K", (5, 4, 3, 3)))
    scope = [loc.expr for loc in locations(c.derived[0])][-1]
    # m: n, t1, t2 (three for one), n: f, r, s (three for one), k: c -> 2 + 2 (§6.1's example).
    assert expression_distance(scope, "matmul") == 4
    assert expression_distance(scope, "batch_matmul") == 5
    # The conv itself: y, x, r, s fit no matmul group.
    assert expression_distance(c.original[0], "matmul") == 4
    assert expression_distance(c.original[0], "conv2d") == 0


def test_matmul_attributes_from_flattened_coefficients():
    a, b = Tensor("A", (5, 6)), Tensor("B", (7, 6))
    m = next(match_matmul(canonical.matmul(a, b, transpose_b=True)))
    assert m.op == "matmul" and m.group("k") == ("k",)
    assert m.attr("transpose_a") is False and m.attr("lda") == 6
    assert m.attr("transpose_b") is True and m.attr("ldb") == 6
    m2 = next(match_matmul(canonical.matmul(a, Tensor("C", (6, 7)))))
    assert m2.attr("transpose_b") is False and m2.attr("ldb") == 7


def test_conv_attributes_from_coefficients():
    e = canonical.conv2d(Tensor("X", (1, 3, 11, 9)), Tensor("K", (4, 3, 3, 2)),
                         strides=(2, 3), dilation=(2, 1), padding=(1, 0, 2, 1))
    m = next(match_conv2d(e))
    assert m.attr("strides") == (2, 3) and m.attr("dilation") == (2, 1)
    assert m.attr("offsets") == (-1, 0)  # padding = −offset
    assert m.group("n") == ("n",) and m.group("f") == ("f",) and m.group("c") == ("c",)
    assert match(e).op == "conv2d"


def test_g2bmm_dilation_and_no_false_match():
    e = canonical.g2bmm(Tensor("G", (2, 20, 4)), Tensor("H", (2, 20, 4)), 3, 4)
    m = next(match_g2bmm(e))
    assert m.attr("dilation") == 4 and m.group("i") == ("i",) and m.group("j") == ("j",)
    assert match(canonical.add(Tensor("U", (3, 4)), Tensor("V", (3, 4)))) is None


def test_grouped_conv_matches_with_groups_attribute():
    e = canonical.conv2d(Tensor("X", (1, 8, 6, 6)), Tensor("K", (12, 2, 3, 3)), groups=4)
    m = next(match_conv2d(e))
    assert m.attr("groups") == 4 and m.attr("channel_dim") == 1
    assert expression_distance(canonical.conv2d(Tensor("X", (1, 8, 6, 6)),
                                                Tensor("K", (12, 8, 3, 3))), "conv2d") == 0


def test_gbmm_and_conv_transpose_attributes():
    from tvm_einweld.relay_passes.mapping_table import match_conv2d_transpose, match_gbmm

    g = canonical.gbmm(Tensor("G", (2, 9, 7)), Tensor("H", (2, 9, 4)), 3, 2)
    m = next(match_gbmm(g))
    assert m.attr("dilation") == 2 and m.group("j") == ("j",) and m.group("k") == ("k",)
    t = canonical.conv2d_transpose(Tensor("X", (1, 3, 4, 5)), Tensor("W", (3, 2, 4, 3)),
                                   strides=(2, 3), padding=(1, 0, 1, 0))
    m = next(match_conv2d_transpose(t))
    assert m.attr("strides") == (2, 3) and m.attr("padding") == (1, 0)
    assert not list(match_conv2d_transpose(canonical.conv2d(Tensor("X", (1, 3, 6, 6)),
                                                            Tensor("K", (2, 3, 3, 3)))))
