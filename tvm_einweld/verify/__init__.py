"""Verification of rewrites, TASO style: exact screening, random testing and z3 proofs.

    from tvm_einweld.verify import verify_rewrite, prove_bijection
    verdict = verify_rewrite(before, after, side_conditions=[
        lambda: prove_bijection(phi, psi, domain, codomain),
    ])
    if not verdict.ok:
        print(verdict.reason)        # the rewrite is not applied

Modules: `screening` (exact evaluation modulo a prime), `random_testing` (float inputs in
[-1, 1], expressions or Relax modules), `smt` (z3 side conditions with time limits),
`mutations` (planted wrong rewrites the verifier must reject), `selfcheck` (canonical
operator expressions against numpy/TVM).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Tuple

from ..expr.expression import Expr
from .random_testing import TestResult, compare_expressions, compare_relax, replace_nonlinear_ops
from .screening import DEFAULT_MODULUS, ScreeningResult, screen_modular
from .smt import (
    ProofResult, prove_bijection, prove_constant_region, prove_cover, prove_image_within,
    prove_index_equal, prove_left_inverse, prove_partition, run_side_condition, to_z3,
)


@dataclass(frozen=True)
class Verdict:
    """All checks of one rewrite. `ok` only when every check passed; `reason` says why not."""

    ok: bool
    screening: ScreeningResult
    testing: TestResult
    proofs: Tuple[ProofResult, ...]
    reason: str

    def __str__(self) -> str:
        lines = [("ACCEPTED: " if self.ok else "REJECTED: ") + self.reason,
                 f"  screening: {self.screening}", f"  testing:   {self.testing}"]
        lines += [f"  proof:     {p}" for p in self.proofs]
        return "\n".join(lines)


def verify_rewrite(
    before: Expr,
    after: Expr,
    side_conditions: Sequence[Callable[[], ProofResult]] = (),
    *,
    draws: int = 3,
    trials: int = 3,
    seed: int = 0,
) -> Verdict:
    """Check that `after` computes what `before` does, and that every side condition holds.

    Runs exact screening modulo a prime (`draws` inputs), random float testing (`trials`
    inputs) and every side-condition proof (all of them, so the verdict reports everything).
    A proof that is "unknown", or a side condition that raises, fails.
    """
    screening = screen_modular(before, after, draws=draws, seed=seed)
    testing = compare_expressions(before, after, trials=trials, seed=seed)
    proofs = tuple(run_side_condition(check) for check in side_conditions)
    failures = []
    if not screening.equal:
        failures.append(f"exact screening: {screening.what}")
    if not testing.equal:
        failures.append(f"random testing: {testing.what}")
    failures += [f"side condition {p.status}: {p.what}" for p in proofs if not p.proven]
    reason = "; ".join(failures) if failures else "screening, testing and all side conditions pass"
    return Verdict(not failures, screening, testing, proofs, reason)


__all__ = [
    "Verdict", "verify_rewrite", "ProofResult", "to_z3", "prove_index_equal",
    "prove_left_inverse", "prove_bijection", "prove_image_within", "prove_cover", "prove_partition",
    "prove_constant_region", "TestResult", "compare_expressions", "compare_relax",
    "replace_nonlinear_ops", "ScreeningResult", "screen_modular", "DEFAULT_MODULUS",
]
