"""`python -m tvm_einweld verify`: check the checker.

Two tables:
  1. the canonical-operator self-check: every canonical expression on random inputs against
     TVM's build of the operator (or a numpy reference);
  2. the mutation suite: correct rewrites that must be accepted and planted wrong rewrites
     (off-by-one offset, wrong stride, wrong padding, dropped summation element, swapped
     iterators, ...) that must be rejected, with what each check said.
Exit code 1 when a planted mutation is accepted, a correct rewrite rejected or an operator
expression disagrees with its reference; 0 otherwise.
"""
from __future__ import annotations

import argparse
import time
from typing import List, Sequence

HELP = "self-check the canonical operator expressions and run the verifier's mutation suite"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", choices=("selfcheck", "mutations"),
                        help="run one of the two parts only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def _table(headers: Sequence[str], rows: List[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h)
              for k, h in enumerate(headers)]
    line = "  ".join("{:<%d}" % w for w in widths)
    out = [line.format(*headers), line.format(*("-" * w for w in widths))]
    out += [line.format(*row) for row in rows]
    return "\n".join(o.rstrip() for o in out)


def _selfcheck(seed: int) -> int:
    from tvm_einweld.verify.selfcheck import run_selfcheck

    start = time.perf_counter()
    checks = run_selfcheck(seed)
    rows = [(c.name, c.reference, "ok" if c.result.equal else "MISMATCH",
             f"{c.result.max_abs_error:.2e}", f"{c.result.max_rel_error:.2e}") for c in checks]
    print("Canonical operator expressions vs reference (random inputs in [-1, 1])")
    print(_table(("operator", "reference", "result", "max abs err", "max rel err"), rows))
    failed = [c for c in checks if not c.result.equal]
    for c in failed:
        print(f"  MISMATCH {c.name}: {c.result.what}")
    print(f"{len(checks) - len(failed)}/{len(checks)} operators agree "
          f"({time.perf_counter() - start:.1f} s)\n")
    return len(failed)


def _mutations(seed: int) -> int:
    from tvm_einweld.verify.mutations import run_suite

    start = time.perf_counter()
    results = run_suite(seed=seed)
    rows, wrong = [], 0
    for case, verdict in results:
        good = verdict.ok == case.correct
        wrong += not good
        proofs = ",".join(p.status for p in verdict.proofs) or "-"
        rows.append((
            case.name, "accept" if case.correct else "reject",
            "accepted" if verdict.ok else "rejected",
            "equal" if verdict.screening.equal else "differ",
            "equal" if verdict.testing.equal else "differ",
            proofs, "ok" if good else "WRONG VERDICT",
        ))
    print("Mutation suite: correct rewrites and planted wrong rewrites")
    print(_table(("rewrite", "expected", "verdict", "exact mod p", "random test", "z3 proofs",
                  ""), rows))
    for case, verdict in results:
        if verdict.ok != case.correct:
            print(f"  WRONG VERDICT {case.name}:\n{verdict}")
    planted = sum(not c.correct for c, _ in results)
    caught = sum(not c.correct and not v.ok for c, v in results)
    print(f"{caught}/{planted} planted mutations rejected, "
          f"{sum(c.correct and v.ok for c, v in results)}/{len(results) - planted} correct "
          f"rewrites accepted ({time.perf_counter() - start:.1f} s)")
    return wrong


def run(args: argparse.Namespace) -> int:
    failures = 0
    if args.only in (None, "selfcheck"):
        failures += _selfcheck(args.seed)
    if args.only in (None, "mutations"):
        failures += _mutations(args.seed)
    return 1 if failures else 0
