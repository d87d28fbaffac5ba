"""Derivation rules: every proven instance preserves the value (interpreter, random inputs),
and planted wrong instances (wrong Φ, wrong bounds) are rejected by the side conditions."""
import numpy as np
import pytest

from tvm_einweld.expr import Expr, Iterator, Scope, Tensor, canonical, evaluate, random_inputs
from tvm_einweld.expr.expression import accesses
from tvm_einweld.expr import index as ix
from tvm_einweld.expr.index import IVar
from tvm_einweld.relay_passes import (
    BoundaryRelaxing, BoundaryTightening, ExpressionFusion, ExpressionMerging,
    ExpressionSplitting, RuleNotApplicable,
    SummationIteratorSplitting, SummationSplitting, TraversalMerging, VariableSubstitution,
    apply_at, check, fuse, merge_expressions, substitute,
)
from tvm_einweld.relay_passes.boundary import relax, tighten
from tvm_einweld.relay_passes.derivation import locations
from tvm_einweld.relay_passes.traversal_merging import inline_scope
from tvm_einweld.relay_passes.variable_substitution import split_sum_iterator
from tvm_einweld.relay_passes.window_splitting import WindowSplitting, window_iterators


def conv(shape=(1, 3, 5, 6), out=4, k=3, pad=1, **kw):
    return canonical.conv2d(Tensor("A", shape), Tensor("K", (out, shape[1], k, k)),
                            padding=(pad,) * 4, **kw)


def same_value(a: Expr, b: Expr, seed=0):
    inputs = random_inputs(a, seed=seed)
    np.testing.assert_allclose(evaluate(b, inputs), evaluate(a, inputs), rtol=1e-9, atol=1e-9)


def all_instances(rule, expr):
    found = list(rule.apply(expr))
    assert found, f"{rule.name} produced nothing for {expr}"
    for d in found:
        assert all(p.proven for p in d.proofs)
        same_value(expr, d.result)
    return found


def test_summation_splitting_every_split_is_equal():
    e = conv()
    found = all_instances(SummationSplitting(), e)
    assert len(found) == 6  # non-empty proper subsets of {c, r, s}
    d = apply_at(SummationSplitting(inner={"c"}), e)
    assert [it.name for it in d.result.sums] == ["r", "s"]


def test_variable_substitution_infers_offsets_and_is_equal():
    e2 = apply_at(SummationSplitting(inner={"c"}), conv()).result
    found = all_instances(VariableSubstitution(("offset",)), e2)
    texts = [d.description for d in found]
    assert any("t1 = r + y - 1" in t and "t2 = s + x - 1" in t for t in texts), texts
    scope = found[0].result
    # The new scope ranges over the bounding box of Φ(X): [-1, H + 1).
    inner = [loc.expr for loc in locations(scope)][-1]
    assert (inner.iterator("t1").lo, inner.iterator("t1").hi) == (-1, 6)


def test_variable_substitution_merge_and_split():
    a = Tensor("A", (4, 6))
    e = canonical.permute_dims(a, (0, 1))  # L{i0, i1} A[i0, i1]
    merged = all_instances(VariableSubstitution(("merge",)), e)
    assert any("m1 = i0 * 6 + i1" in d.description for d in merged)
    g = canonical.g2bmm(Tensor("A", (2, 9, 3)), Tensor("B", (2, 9, 3)), width=2, dilation=3)
    split = all_instances(VariableSubstitution(("split",)), g)
    assert any("i % 3" in d.description and "i // 3" in d.description for d in split)


def test_variable_substitution_coupled_pairs_of_conv_transpose():
    e = canonical.conv2d_transpose(Tensor("A", (1, 2, 3, 4)), Tensor("W", (2, 3, 4, 4)),
                                   strides=(2, 2), padding=(1, 1, 1, 1))
    e2 = apply_at(SummationSplitting(inner={"c"}), e).result
    d = apply_at(VariableSubstitution(("coupled",)), e2, "top/scope0")
    same_value(e, d.result)
    inner = [loc.expr for loc in locations(d.result)][-1]
    # ψ was fitted and proven: the inner scope reads A and W with plain iterators.
    assert all(isinstance(i, IVar) for a in (inner.body.lhs, inner.body.rhs) for i in a.indices)


def test_summation_iterator_splitting():
    e = apply_at(BoundaryRelaxing({"r": (0, 6)}), conv(k=5, pad=2)).result
    found = all_instances(SummationIteratorSplitting(["r"]), e)
    assert sorted(d.description.split(" (")[0] for d in found) == \
        ["split Σ r = r1 * 2 + r2", "split Σ r = r1 * 3 + r2"]


def test_window_splitting_relaxes_splits_and_scopes_the_smaller_window():
    e = conv(shape=(1, 2, 7, 6), out=3, k=5, pad=2)
    assert window_iterators(e) == ["r", "s"]
    found = all_instances(WindowSplitting(), e)
    assert len(found) == 3  # k = 2, 3, 4: one instance each, r and s split together
    k3 = next(d for d in found if "r1 * 3 + r2" in d.description)
    assert "relax r from [0, 5) to [0, 6)" in k3.description
    assert "relax s from [0, 5) to [0, 6)" in k3.description
    assert {it.name for it in k3.result.sums} == {"r1", "s1"}  # the offsets stay outside
    scope = [loc.expr for loc in locations(k3.result)][1]
    assert {it.name: it.extent for it in scope.sums} == {"c": 2, "r2": 3, "s2": 3}
    # No window, no instance: a matmul's k is read plainly by both operands.
    mm = canonical.matmul(Tensor("A", (4, 5)), Tensor("B", (5, 3)))
    assert window_iterators(mm) == [] and not list(WindowSplitting().apply(mm))


def test_window_splitting_refuses_a_relaxed_slab_that_is_not_zero():
    """r ranges over 5 of the kernel's 6 rows: relaxing r to 6 would add the real row 5, so
    every factor that relaxes r is refused; only k = 5 (splitting s alone, 6 → 10, the new
    slab reading padding) is proven."""
    from tvm_einweld.relay_passes.derivation import with_ranges

    e = with_ranges(conv(shape=(1, 2, 7, 6), out=3, k=6, pad=2), {"r": (0, 5)})
    found = all_instances(WindowSplitting(), e)
    assert [d.description.split(";")[0] for d in found] == ["relax s from [0, 6) to [0, 10)"]
    for k in (2, 3, 4):
        with pytest.raises(RuleNotApplicable, match="not proven"):
            check("window_splitting", next(WindowSplitting([k]).candidates(e, True)))


def test_traversal_merging_inlines_with_proof():
    e2 = apply_at(SummationSplitting(inner={"c"}), conv()).result
    e3 = apply_at(VariableSubstitution(("offset",)), e2, "top/scope0").result
    found = all_instances(TraversalMerging(), e3)
    assert any("inline scope read at [n, f, y, x, r, s]" in d.description for d in found)
    # Inlining the summation scope of E2 back gives the original single-level conv.
    back = apply_at(TraversalMerging(), e2).result
    assert not list(locations(back))[1:]
    same_value(conv(), back)


def test_boundary_tightening_and_relaxing():
    e = canonical.conv2d(Tensor("A", (1, 2, 5, 6)), Tensor("K", (3, 2, 3, 3)), padding=(1,) * 4)
    e2 = apply_at(SummationSplitting(inner={"c"}), e).result
    e3 = apply_at(VariableSubstitution(("offset",)), e2, "top/scope0").result
    e5 = apply_at(TraversalMerging(), e3).result
    found = all_instances(BoundaryTightening(), e5)
    assert any("tighten t1 from [-1, 6) to [0, 5)" in d.description for d in found)
    relaxed = all_instances(BoundaryRelaxing(), conv(k=5, pad=2))
    assert any("relax r from [0, 5) to [0, 6)" in d.description for d in relaxed)


def test_expression_splitting():
    e = canonical.matmul(Tensor("A", (5, 4)), Tensor("B", (4, 7)))
    found = all_instances(ExpressionSplitting(), e)
    assert {d.description for d in found} == {"split m at 2", "split n at 3"}


def test_expression_merging_and_fusion():
    a, b1, b2 = Tensor("A", (5, 6)), Tensor("B1", (6, 3)), Tensor("B2", (6, 4))
    e1, e2 = canonical.matmul(a, b1), canonical.matmul(a, b2)
    merged = merge_expressions(e1, e2)
    assert all(p.proven for p in merged.proofs)
    inputs = {**random_inputs(e1), **random_inputs(e2)}
    for before, after in zip((e1, e2), merged.results):
        np.testing.assert_allclose(evaluate(after, inputs), evaluate(before, inputs), atol=1e-9)
    with pytest.raises(RuleNotApplicable):  # different left inputs: not one computation
        merge_expressions(e1, canonical.matmul(Tensor("C", (5, 6)), b2))
    assert len(list(ExpressionMerging().apply(e1, e2))) == 1
    assert not list(ExpressionMerging().apply(e1, canonical.matmul(Tensor("C", (5, 6)), b2)))

    x, y = Tensor("X", (3, 4)), Tensor("Y", (3, 4))
    producer = canonical.add(x, y)
    fused = fuse(canonical.relu(Tensor("T", (3, 4))), "T", producer)
    assert [d.result for d in ExpressionFusion().apply(canonical.relu(Tensor("T", (3, 4))),
                                                       {"T": producer, "U": producer})] \
        == [fused.result]
    assert not list(locations(fused.result))[1:]  # one expression: one eOperator
    v = random_inputs(producer)
    np.testing.assert_allclose(evaluate(fused.result, v), np.maximum(v["X"] + v["Y"], 0), atol=1e-7)


# --- planted wrong rule instances ------------------------------------------------------------

def _e2():
    return apply_at(SummationSplitting(inner={"c"}), conv()).result


def _scope_level(expr):
    return [loc for loc in locations(expr)][-1]


def test_wrong_phi_is_rejected():
    loc = _scope_level(_e2())
    good = substitute(loc.expr, {"t1": ix.IVar("y") + ix.IVar("r") - 1},
                      {"y": ix.IVar("t1") - ix.IVar("r") + 1})
    check("variable_substitution", good, loc)
    wrong_psi = substitute(loc.expr, {"t1": ix.IVar("y") + ix.IVar("r") - 1},
                           {"y": ix.IVar("t1") - ix.IVar("r")})  # off by one
    with pytest.raises(RuleNotApplicable, match="refuted"):
        check("variable_substitution", wrong_psi, loc)
    not_injective = substitute(loc.expr, {"t1": ix.IVar("y") // 2 + ix.IVar("r")},
                               {"y": (ix.IVar("t1") - ix.IVar("r")) * 2})
    with pytest.raises(RuleNotApplicable, match="refuted"):
        check("variable_substitution", not_injective, loc)


def test_wrong_merge_factor_is_rejected():
    e = canonical.permute_dims(Tensor("A", (4, 6)), (0, 1))
    wrong = substitute(e, {"m": ix.IVar("i0") * 5 + ix.IVar("i1")},
                       {"i0": ix.IVar("m") // 5, "i1": ix.IVar("m") % 5})
    with pytest.raises(RuleNotApplicable, match="refuted"):
        check("variable_substitution", wrong)


def test_wrong_bounds_are_rejected():
    e2 = _e2()
    e3 = apply_at(VariableSubstitution(("offset",)), e2, "top/scope0").result
    e5 = apply_at(TraversalMerging(), e3).result
    loc = _scope_level(e5)
    with pytest.raises(RuleNotApplicable, match="refuted"):  # removes a row that reads data
        check("boundary_tightening", tighten(loc.expr, "t1", (0, 4)), loc)
    i0, i1 = Iterator("i0", 0, 3), Iterator("i1", 0, 4)
    x, y = Tensor("X", (3, 4)), Tensor("Y", (3, 4))
    scope_like = Expr((i0,), (i1,), x[i0.var, i1.var] + y[i0.var, 0])  # Σ_i1 X[i0,i1] + Y[i0,0]
    with pytest.raises(RuleNotApplicable, match="refuted"):  # Y[i0, 0] is not zero on the slab
        check("boundary_relaxing", relax(scope_like, "i1", (0, 6)))
    with pytest.raises(RuleNotApplicable, match="refuted"):  # 2·r1 + r2 does not cover [0, 5)
        check("summation_iterator_splitting", split_sum_iterator(conv(k=5, pad=2), "r", 2))


def test_inlining_a_scope_read_in_its_padding_moves_the_padding_onto_tensors():
    e = conv()
    for rule, path in [(SummationSplitting(inner={"c"}), "top"),
                       (VariableSubstitution(("offset",)), "top/scope0"),
                       (TraversalMerging(), "top"), (BoundaryTightening(), "top/scope0"),
                       (BoundaryTightening(), "top/scope0")]:
        e = apply_at(rule, e, path).result
    # The outer expression reads the tightened scope in its zero padding (t1 = -1, H).
    d = apply_at(TraversalMerging(), e)
    assert "padding moved onto the tensors" in d.description
    assert len(d.proofs) == 5  # four zero slabs and the image
    same_value(conv(), d.result)
    data = [a.source for a in accesses(d.result.body) if a.source.name == "A"][0]
    assert data.pad[2] == (1, 1) and data.pad[3] == (1, 1)


def test_inlining_a_scope_whose_padding_hides_data_is_rejected():
    # {L_t X[t]} over t ∈ [0, 3) with padding (0, 2): reads at 3, 4 see zeros, but inlining
    # would read X[3], X[4]. The relaxation's zero-slab condition is refuted.
    x, t, i = Tensor("X", (5,)), Iterator("t", 0, 3), Iterator("i", 0, 5)
    scope = Scope(Expr((t,), (), x[t.var]), ((0, 2),))
    outer = Expr((i,), (), scope[i.var] * 1.0)
    read = next(accesses(outer.body))
    with pytest.raises(RuleNotApplicable, match="refuted"):
        check("traversal_merging", inline_scope(outer, read))
    assert not list(TraversalMerging().apply(outer))


OPERATORS = {
    "conv stride 2 dilation 2": lambda: canonical.conv2d(
        Tensor("A", (1, 2, 9, 7)), Tensor("K", (3, 2, 3, 2)), strides=(2, 1), dilation=(2, 1),
        padding=(1, 0, 1, 1)),
    "grouped conv": lambda: canonical.conv2d(
        Tensor("A", (1, 4, 5, 5)), Tensor("K", (6, 2, 3, 3)), groups=2, padding=(1, 1, 1, 1)),
    "conv transpose stride 3": lambda: canonical.conv2d_transpose(
        Tensor("A", (1, 2, 3, 2)), Tensor("W", (2, 3, 5, 3)), strides=(3, 2),
        padding=(1, 0, 1, 0)),
    "batch matmul transposed": lambda: canonical.matmul(
        Tensor("A", (2, 3, 5)), Tensor("B", (2, 4, 5)), transpose_b=True),
    "g2bmm dilation 3": lambda: canonical.g2bmm(Tensor("A", (2, 7, 3)), Tensor("B", (2, 7, 3)),
                                                2, 3),
    "gbmm": lambda: canonical.gbmm(Tensor("A", (1, 6, 5)), Tensor("B", (1, 6, 4)), 2, 2),
}


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_every_rule_instance_on_every_operator_preserves_the_value(name):
    """Two levels of derivations from each operator: all proven instances equal the original."""
    expr = OPERATORS[name]()
    rules = [SummationSplitting(), VariableSubstitution(), SummationIteratorSplitting(),
             TraversalMerging(), BoundaryTightening(), BoundaryRelaxing(), WindowSplitting()]
    inputs = random_inputs(expr, seed=7)
    want = evaluate(expr, inputs)
    frontier, seen = [expr], 0
    for depth in range(2):
        nxt = []
        for e in frontier:
            for rule in rules:
                for d in rule.apply(e):
                    np.testing.assert_allclose(evaluate(d.result, inputs), want, atol=1e-9,
                                               err_msg=f"{name}: {d}")
                    nxt.append(d.result)
        seen += len(nxt)
        frontier = nxt[:12]
    assert seen >= 3, f"{name}: only {seen} derivations"


def test_every_rule_instance_on_the_case_intermediates_preserves_the_value():
    """One more level of every rule from each step of the paper's derivations (nested scopes,
    padded scopes, relaxed sums, split iterators): every proven instance is equal."""
    from tvm_einweld.relay_passes import cases

    derived = [
        cases.conv3x3_to_matmul(Tensor("A", (1, 3, 5, 6)), Tensor("K", (4, 3, 3, 3))),
        cases.conv_transpose_to_matmul(Tensor("A", (1, 2, 3, 2)), Tensor("W", (2, 3, 4, 4))),
        cases.conv5x5_to_conv3x3(Tensor("A", (1, 2, 6, 5)), Tensor("K", (2, 2, 5, 5))),
        cases.dilated_g2bmm(Tensor("A", (1, 7, 3)), Tensor("B", (1, 7, 3)), 2, 2),
    ]
    rules = [SummationSplitting(), VariableSubstitution(), SummationIteratorSplitting(),
             TraversalMerging(), BoundaryTightening(), BoundaryRelaxing(), ExpressionSplitting(),
             WindowSplitting()]
    for case in derived:
        inputs = random_inputs(case.original[0], seed=11)
        want = evaluate(case.original[0], inputs)
        count = 0
        for step in case.steps:
            for rule in rules:
                for d in rule.apply(step.result):
                    np.testing.assert_allclose(evaluate(d.result, inputs), want, atol=1e-9,
                                               err_msg=f"{case.name}: {d}")
                    count += 1
        assert count > 10 * len(case.steps), case.name


def test_a_side_condition_that_cannot_be_posed_refuses_the_instance():
    from tvm_einweld.relay_passes import LevelRewrite

    def broken():
        raise ValueError("ψ has no component for y")

    with pytest.raises(RuleNotApplicable, match="could not be checked"):
        check("variable_substitution", LevelRewrite(conv(), (broken,), "broken"))
