"""Exact screening, random-input testing (expressions and Relax modules) and verify_rewrite."""
import numpy as np
import pytest
from tvm import relax

from tvm_einweld.expr import (
    Constant, Expr, Iterator, Scope, Tensor, canonical, evaluate, unary,
)
from tvm_einweld.expr.expression import Access
from tvm_einweld.expr.index import IVar
from tvm_einweld.verify import (
    DEFAULT_MODULUS, ProofResult, compare_expressions, compare_relax, prove_index_equal,
    screen_modular, verify_rewrite,
)
from tvm_einweld.verify.inputs import draw, shared_tensors
from tvm_einweld.verify.stand_ins import STAND_IN_OFFSETS

i, k = Iterator("i", 0, 6), Iterator("k", 0, 64)
A, B, C = Tensor("A", (6, 64)), Tensor("B", (6, 64)), Tensor("C", (64,))


def _a(t, *idx):
    return Access(t, tuple(it.var for it in idx))


def _cancelling(scale: float):
    """Σ_k (A·s + B)·C − Σ_k A·C·s = Σ_k B·C exactly; in floats the s-terms swamp B·C."""
    lhs_sum = Expr((i,), (k,), (_a(A, i, k) * scale + _a(B, i, k)) * _a(C, k))
    big = Expr((i,), (k,), _a(A, i, k) * _a(C, k) * scale)
    lhs = Expr((i,), (), Access(Scope(lhs_sum), (i.var,)) - Access(Scope(big), (i.var,)))
    rhs = Expr((i,), (k,), _a(B, i, k) * _a(C, k))
    return lhs, rhs


def test_modulus_is_a_prime_below_2_31():
    p = DEFAULT_MODULUS
    assert p < 2**31 and all(pow(a, p - 1, p) == 1 for a in (2, 3, 5, 7, 11))
    assert all(p % d for d in range(2, 46341))


def test_screening_is_exact_where_float_testing_is_noisy():
    lhs, rhs = _cancelling(2.0**60)
    exact = screen_modular(lhs, rhs)
    assert exact.equal and exact.mismatches == 0 and exact.draws == 3
    noisy = compare_expressions(lhs, rhs)
    assert not noisy.equal and noisy.max_abs_error > noisy.tolerance  # rounding noise


def test_screening_sees_differences_below_float_tolerance():
    lhs, rhs = _cancelling(1.0)
    tiny = Expr((i,), (k,), _a(B, i, k) * _a(C, k) + _a(A, i, k) * _a(C, k) * 2.0**-30)
    assert compare_expressions(rhs, tiny).equal  # within float32 tolerance
    res = screen_modular(rhs, tiny)
    assert not res.equal and res.mismatches == 3
    assert "differ" in res.what


def test_screening_rational_constants():
    x = Iterator("x", 0, 5)
    X = Tensor("X", (5,))
    halves = Expr((x,), (), _a(X, x) * 0.5 + _a(X, x) * 0.25 + _a(X, x) * 0.25)
    assert screen_modular(halves, Expr((x,), (), _a(X, x) * 1)).equal
    assert not screen_modular(halves, Expr((x,), (), _a(X, x) * 0.75)).equal


def test_screening_matches_modular_interpreter_on_multilinear_identity():
    """(A + B)·C summed = A·C summed + B·C summed: distributivity, exact mod p."""
    ab = Expr((i,), (k,), (_a(A, i, k) + _a(B, i, k)) * _a(C, k))
    other_shape = canonical.matmul(Tensor("A", (6, 64)), Tensor("C", (64, 1)))
    assert screen_modular(ab, ab).equal
    assert not screen_modular(ab, Expr((i,), (k,), _a(A, i, k) * _a(C, k))).equal
    assert "shapes differ" in screen_modular(ab, other_shape).what


def test_distinct_stand_ins_per_function():
    x = Iterator("x", 0, 5)
    X = Tensor("X", (5,))
    relu, tanh = (Expr((x,), (), unary(f, _a(X, x))) for f in ("relu", "tanh"))
    assert len(set(STAND_IN_OFFSETS.values())) == len(STAND_IN_OFFSETS)
    assert not screen_modular(relu, tanh).equal
    assert not compare_expressions(relu, tanh).equal
    # neg is linear and kept exact: -(-x) = x.
    negneg = Expr((x,), (), unary("neg", unary("neg", _a(X, x))))
    assert screen_modular(negneg, Expr((x,), (), _a(X, x) * 1)).equal


def test_polynomial_replacement_unmasks_relu():
    """relu(X - 2) and relu(X - 3) are both 0 on [-1, 1]: only the stand-in tells them apart."""
    x = Iterator("x", 0, 8)
    X = Tensor("X", (8,))
    a = Expr((x,), (), unary("relu", _a(X, x) - Constant(2.0)))
    b = Expr((x,), (), unary("relu", _a(X, x) - Constant(3.0)))
    assert compare_expressions(a, b, polynomial_nonlinear=False).equal
    res = compare_expressions(a, b)
    assert not res.equal and res.max_abs_error > 1


def test_compare_expressions_reports_shapes_inputs_and_tolerance():
    mm = canonical.matmul(Tensor("A", (2, 3)), Tensor("B", (3, 4)))
    other = canonical.matmul(Tensor("A", (2, 3)), Tensor("B", (3, 5)))
    res = compare_expressions(mm, other)
    assert not res.equal and "output shapes differ: [2, 4] vs [2, 5]" in res.what
    wrong_input = canonical.matmul(Tensor("A", (2, 3)), Tensor("B", (3, 4), dtype="float16"))
    assert not compare_expressions(mm, wrong_input).equal
    ok = compare_expressions(mm, mm, trials=2)
    assert ok.equal and ok.trials == 2 and ok.max_abs_error == 0.0 and ok.tolerance == 1e-4


def test_dtype_aware_tolerance():
    x = Iterator("x", 0, 16)
    for dtype, accepted in (("float16", True), ("float32", False)):
        X = Tensor("X", (16,), dtype=dtype)
        a = Expr((x,), (), _a(X, x) * 1, dtype)
        b = Expr((x,), (), _a(X, x) * (1 + 2.0**-12), dtype)
        assert compare_expressions(a, b).equal == accepted, dtype


def test_random_testing_matches_numpy():
    """The compared values are the interpreter's; spot-check one against numpy."""
    mm = canonical.matmul(Tensor("A", (2, 3)), Tensor("B", (3, 4)))
    tensors, _ = shared_tensors(mm, mm)
    ins = draw(tensors, 0)
    np.testing.assert_allclose(evaluate(mm, ins), ins["A"] @ ins["B"], rtol=1e-6)


# --- Relax ---------------------------------------------------------------------------------------

def _relax_mlp(act: str = "relu", fused: bool = False, shift: float = 0.0, both: bool = True):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    w1 = relax.Var("w1", relax.TensorType((3, 4), "float32"))
    w2 = relax.Var("w2", relax.TensorType((3, 4), "float32"))
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            if fused:  # x·w1 + x·w2 = x·(w1 + w2)
                y = bb.emit(relax.op.matmul(x, relax.op.add(w1, w2)))
            else:
                y = bb.emit(relax.op.add(relax.op.matmul(x, w1), relax.op.matmul(x, w2)))
            y = bb.emit(relax.op.subtract(y, relax.const(shift, "float32")))
            z = bb.emit(getattr(relax.op.nn, act)(y) if act == "relu" else
                        getattr(relax.op, act)(y))
            out = bb.emit_output(relax.Tuple([z, y]) if both else z)
        bb.emit_func_output(out)
    return bb.get()


def test_compare_relax_accepts_a_correct_rewrite_and_rejects_wrong_ones():
    base = _relax_mlp()
    ok = compare_relax(base, _relax_mlp(fused=True))
    assert ok.equal and ok.trials == 3 and ok.max_abs_error < 1e-5
    assert not compare_relax(base, _relax_mlp(act="tanh")).equal


def test_compare_relax_replacement_unmasks_relu():
    """relu(y - 10) and relu(y - 11) are 0 on every input in [-1, 1]."""
    a, b = _relax_mlp(shift=10.0, both=False), _relax_mlp(shift=11.0, both=False)
    assert compare_relax(a, b, replace_nonlinear=False).equal
    res = compare_relax(a, b)
    assert not res.equal and "replaced by polynomials" in res.what


def test_compare_relax_signature_mismatch():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(relax.op.nn.relu(x))
    res = compare_relax(_relax_mlp(), bb.get())
    assert not res.equal and "parameters differ" in res.what
    with pytest.raises(ValueError):
        compare_relax(_relax_mlp(), _relax_mlp(), func_name="nope")


# --- verify_rewrite ------------------------------------------------------------------------------

def test_verify_rewrite_needs_every_proof():
    mm = canonical.matmul(Tensor("A", (2, 3)), Tensor("B", (3, 4)))
    proven, unknown = ProofResult("proven", "p"), ProofResult("unknown", "u (timeout)")
    assert verify_rewrite(mm, mm, [lambda: proven]).ok
    v = verify_rewrite(mm, mm, [lambda: proven, lambda: unknown])
    assert not v.ok and "unknown" in v.reason and len(v.proofs) == 2
    assert v.screening.equal and v.testing.equal


def test_verify_rewrite_rejects_when_a_side_condition_cannot_be_checked():
    mm = canonical.matmul(Tensor("A", (2, 3)), Tensor("B", (3, 4)))

    def malformed():
        return prove_index_equal(IVar("q"), IVar("q"), [Iterator("k", 0, 2)])

    v = verify_rewrite(mm, mm, [malformed])
    assert not v.ok and v.proofs[0].status == "unknown" and "could not be checked" in v.reason


def test_screening_reports_constants_without_residue():
    x = Iterator("x", 0, 3)
    X = Tensor("X", (3,))
    a = Expr((x,), (), _a(X, x) * float("inf"))
    res = screen_modular(a, a)
    assert not res.equal and "no residue" in res.what
