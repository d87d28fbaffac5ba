"""The expression IR itself: construction, printing, interpreter semantics, lowering."""
import numpy as np
import pytest

from tvm_einweld.expr import (
    EvaluationError, Expr, Iterator, Tensor, evaluate, random_inputs, unary,
)
from tvm_einweld.expr import canonical as C
from tvm_einweld.expr import index as ix
from tvm_einweld.expr.lowering import build

rng = np.random.default_rng(1)


def test_expressions_are_immutable_and_hashable():
    e1 = C.conv2d(Tensor("A", (1, 4, 6, 6)), Tensor("K", (2, 4, 3, 3)), padding=1)
    e2 = C.conv2d(Tensor("A", (1, 4, 6, 6)), Tensor("K", (2, 4, 3, 3)), padding=1)
    assert e1 == e2 and hash(e1) == hash(e2)
    assert len({e1, e2}) == 1
    with pytest.raises(AttributeError):
        e1.body = None  # frozen


def test_printing_uses_the_papers_notation():
    e = C.conv2d(Tensor("A", (1, 4, 6, 6)), Tensor("K", (2, 4, 3, 3)), padding=1)
    assert str(e) == ("L{n:0..1, f:0..2, y:0..6, x:0..6} Σ{c:0..4, r:0..3, s:0..3} "
                      "A[n, c, y + r - 1, x + s - 1] * K[f, c, r, s]")


def test_index_functions_fold_and_keep_floor_semantics():
    h, r = ix.IVar("h"), ix.IVar("r")
    assert str((h + 0) * 1 + r - 0) == "h + r"
    assert ix.linear_form(h * 3 + r - 2 - h) == ({"h": 2, "r": 1}, -2)
    assert ix.linear_form(h // 2) is None
    assert ix.evaluate((h - 5) // 2, {"h": 0}) == -3  # floor, not truncation
    assert ix.evaluate((h - 5) % 2, {"h": 0}) == 1
    assert ix.bounds(h * 2 - r, {"h": (0, 4), "r": (-1, 2)}) == (-1, 7)
    with pytest.raises(ValueError):
        h // r


def test_iterator_ranges_may_start_below_zero():
    a = rng.uniform(-1, 1, (5,))
    t = Iterator("t", -2, 7)  # reads a[-2..6], padding two elements on each side
    e = Expr((t,), (), Tensor("A", (5,), pad=((2, 2),))[t.var])
    out = evaluate(e, {"A": a})
    np.testing.assert_allclose(out, np.concatenate([[0, 0], a, [0, 0]]))


def test_access_outside_padding_is_an_error_not_a_silent_zero():
    t = Iterator("t", -3, 5)
    e = Expr((t,), (), Tensor("A", (5,), pad=((2, 0),))[t.var])
    with pytest.raises(EvaluationError, match="outside its padded bounds"):
        evaluate(e, {"A": np.zeros(5)})


def test_scope_is_addressed_by_iterator_values():
    """An inner scope over t ∈ [-1, 5) read by an outer expression at t = h + r - 1."""
    a = rng.uniform(-1, 1, (4,))
    t = Iterator("t", -1, 5)
    inner = Expr((t,), (), Tensor("A", (4,), pad=((1, 1),))[t.var] * 2.0).as_scope()
    h, r = Iterator("h", 0, 4), Iterator("r", 0, 3)
    outer = Expr((h,), (r,), inner[h.var + r.var - 1])
    expected = np.array([2 * sum(np.pad(a, 1)[hh + rr] for rr in range(3)) for hh in range(4)])
    np.testing.assert_allclose(evaluate(outer, {"A": a}), expected)
    run, names = build(outer)
    np.testing.assert_allclose(run(a.astype("float32")), expected, rtol=1e-5)


def test_scope_padding_reads_zero():
    a = rng.uniform(-1, 1, (3,))
    t = Iterator("t", 0, 3)
    inner = Expr((t,), (), unary("relu", Tensor("A", (3,))[t.var])).as_scope(pad=((1, 1),))
    u = Iterator("u", -1, 4)
    outer = Expr((u,), (), inner[u.var])
    np.testing.assert_allclose(evaluate(outer, {"A": a}), np.concatenate([[0], np.maximum(a, 0), [0]]))
    run, _ = build(outer)
    np.testing.assert_allclose(run(a.astype("float32")), np.concatenate([[0], np.maximum(a, 0), [0]]), rtol=1e-6)


def test_a_scalar_input_keeps_its_zero_dimensions_when_built():
    """A 0-d input (ONNX's scalar constants, e.g. GCN's `x * const[]`) reaches the compiled
    function as a 0-d tensor: numpy's ascontiguousarray would have made it 1-d and the call fail."""
    a, s = rng.uniform(-1, 1, (2, 3)), np.array(1.5)
    i, j = Iterator("i", 0, 2), Iterator("j", 0, 3)
    e = Expr((i, j), (), Tensor("A", (2, 3))[i.var, j.var] * Tensor("S", ())[()])
    run, names = build(e)
    assert names == ["A", "S"]
    np.testing.assert_allclose(run(a, s), a * 1.5, rtol=1e-6)


def test_interpreter_handles_a_resnet_sized_conv_exactly():
    """1×64×56×56 3×3 conv: chunked evaluation must equal a direct numpy computation."""
    expr = C.conv2d(Tensor("A", (1, 64, 56, 56)), Tensor("K", (64, 64, 3, 3)), padding=1)
    inputs = random_inputs(expr, seed=3)
    out = evaluate(expr, inputs)
    a = np.pad(inputs["A"].astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    k = inputs["K"].astype(np.float64)
    ref = sum(np.einsum("nchw,fc->nfhw", a[:, :, r:r + 56, s:s + 56], k[:, :, r, s])
              for r in range(3) for s in range(3))
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-10)


def test_modular_mode_is_exact_and_needs_polynomial_stand_ins():
    p = 2147483629
    e = C.matmul(Tensor("A", (3, 4)), Tensor("B", (4, 2)))
    inputs = random_inputs(e, seed=0, modulus=p)
    expected = (inputs["A"].astype(object) @ inputs["B"].astype(object)) % p
    assert (evaluate(e, inputs, modulus=p).astype(object) == expected).all()
    r = C.relu(Tensor("A", (3,)))
    with pytest.raises(EvaluationError, match="no value modulo"):
        evaluate(r, {"A": np.arange(3)}, modulus=p)
    x = np.arange(3)
    assert list(evaluate(r, {"A": x}, modulus=p, polynomial_nonlinear=True)) == list(x * (x + 1) + 1)


def test_missing_or_misshaped_inputs_are_reported():
    e = C.relu(Tensor("A", (3,)))
    with pytest.raises(EvaluationError, match="no input array"):
        evaluate(e, {})
    with pytest.raises(EvaluationError, match="shape"):
        evaluate(e, {"A": np.zeros(4)})


def test_malformed_expressions_are_rejected_at_construction():
    i = Iterator("i", 0, 3)
    with pytest.raises(ValueError, match="unbound"):
        Expr((i,), (), Tensor("A", (3,))[ix.IVar("j")])
    with pytest.raises(ValueError, match="empty range"):
        Iterator("i", 3, 3)
    with pytest.raises(ValueError, match="indices"):
        Tensor("A", (3, 3))[i.var]


def test_simplified_index_functions_equal_the_originals_on_their_domain():
    from tvm_einweld.expr.index_simplify import simplify_index

    i0, i1, r = ix.IVar("i0"), ix.IVar("i1"), ix.IVar("r")
    ranges = {"i0": (0, 1), "i1": (0, 1568), "r": (-2, 3)}
    cases = [(i0 * 1568 + i1) // 196 % 8, (i1 * 3 + r) // 3, (i1 + r + 7) % 5 - r, i1 * 2 - i1]
    grid = np.meshgrid(*[np.arange(*ranges[n]) for n in ("i0", "i1", "r")], indexing="ij")
    env = dict(zip(("i0", "i1", "r"), grid))
    for e in cases:
        s = simplify_index(e, ranges)
        np.testing.assert_array_equal(np.broadcast_to(ix.evaluate(s, env), grid[0].shape),
                                      np.broadcast_to(ix.evaluate(e, env), grid[0].shape))
    assert str(simplify_index(cases[0], ranges)) == "i1 // 196"


def test_printed_index_functions_keep_needed_parentheses():
    x, y = ix.IVar("x"), ix.IVar("y")
    assert str(x * (y // 2)) == "x * (y // 2)"
    assert str((x % 7) * (y % 7)) == "x % 7 * (y % 7)"
    assert str(x - (y + 1)) == "x - (y + 1)"
    assert str(x + (y - 1)) == "x + y - 1"
    with pytest.raises(ValueError, match="positive constant divisor"):
        ix.IBin("//", x, y)
