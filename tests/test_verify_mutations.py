"""The mutation suite: every planted wrong rewrite is rejected, every correct one accepted.

Each planted fault must be caught by exact screening *and* by random testing on their own,
so neither check is the only line of defence (except the rewrite tailored to the fixed float
stand-in, which only screening's random stand-ins can catch); the z3 side conditions the
rules rely on are checked where the fault breaks them.
"""
import pytest

from conftest import run_vm
from tvm_einweld.expr import Tensor, evaluate
from tvm_einweld.verify.inputs import draw, shared_tensors
from tvm_einweld.verify.mutations import (
    TAILORED, boundary_tightening, conv_offset_reduce, split_summation, suite,
)

CASES = suite()
KINDS = ("off-by-one offset", "wrong stride", "wrong padding", "dropped summation range element",
         "swapped iterators of equal range")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_verdict(case):
    verdict = case.verify()
    assert verdict.ok == case.correct, str(verdict)
    if case.correct:
        assert all(p.proven for p in verdict.proofs)
    else:
        assert not verdict.screening.equal and verdict.screening.mismatches == 3
        # Float testing uses TASO's fixed stand-in, which the tailored rewrite matches.
        assert verdict.testing.equal == case.name.startswith(TAILORED)
        assert "REJECTED" in str(verdict)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_verdicts_do_not_depend_on_the_seed(seed):
    for case in CASES:
        assert case.verify(seed).ok == case.correct, case.name


def test_suite_plants_every_fault_kind():
    names = [c.name for c in CASES if not c.correct]
    for kind in KINDS:
        assert any(n.startswith(kind) for n in names), kind
    assert sum(c.correct for c in CASES) >= 4


def test_offset_reduce_matches_tvm_conv():
    """The accepted conv derivation also matches TVM's own conv2d build (not only the IR)."""
    import numpy as np
    from tvm import relax

    A, K = Tensor("A", (1, 3, 7, 7)), Tensor("K", (4, 3, 3, 3))
    derived = conv_offset_reduce(A, K, stride=2)
    tensors, _ = shared_tensors(derived, derived)
    ins = draw(tensors, 3)
    bb = relax.BlockBuilder()
    a = relax.Var("A", relax.TensorType(A.shape, "float32"))
    k = relax.Var("K", relax.TensorType(K.shape, "float32"))
    with bb.function("main", [a, k]):
        bb.emit_func_output(relax.op.nn.conv2d(a, k, strides=2, padding=1))
    ref = run_vm(bb.get(), ins["A"], ins["K"])
    np.testing.assert_allclose(evaluate(derived, ins), ref, rtol=1e-5, atol=1e-5)


def test_side_conditions_refute_the_faults_they_cover():
    wrong = boundary_tightening(bias=True).verify()
    assert [p.status for p in wrong.proofs] == ["refuted", "refuted"]
    assert all(p.counterexample for p in wrong.proofs)
    split = split_summation(3).verify()
    assert split.proofs[0].status == "refuted"
    off = next(c for c in CASES if c.name.startswith("off-by-one")).verify()
    assert off.proofs[0].status == "refuted"
