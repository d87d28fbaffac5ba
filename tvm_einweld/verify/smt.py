"""z3 proofs of the side conditions that derivation rules rely on (EinNet §4, TASO §5).

Every check states a property "for all integer points of a box, P holds", asks z3 for a point
of the box where P fails, and reads the answer:
  * unsat   -> "proven"  (no such point exists);
  * sat     -> "refuted" (the model is a counterexample, returned by iterator name);
  * unknown -> "unknown" (timeout, or z3 gave up on non-linear arithmetic).
Every check has a time limit (`timeout_ms`, shared by all the queries a check makes), so unlike
TASO's verifier no rule can hang the search, and "unknown" is never read as "proven".

Index functions use floor `//` and `%` with positive constant divisors. SMT-LIB integer `div`
and `mod` are Euclidean: for a positive divisor they coincide with floor division, so `to_z3`
maps `//` and `%` to them directly (tests/test_verify_smt.py checks this against Python).

z3's Python API shares one global context: call these checks from one thread at a time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import z3

from ..expr import index as ix
from ..expr.expression import (
    Access, BinaryOp, Constant, Expr, Iterator, Scalar, Scope, UnaryOp,
)
from ..expr.index import IndexExpr

STATUSES = ("proven", "refuted", "unknown")

# Unary functions with f(0) = 0: a factor f(u) is zero wherever u is.
ZERO_PRESERVING = frozenset(("relu", "tanh", "neg", "abs", "sqrt"))


@dataclass(frozen=True)
class ProofResult:
    """The outcome of one z3 check. Only status "proven" establishes the property."""

    status: str
    what: str
    counterexample: Optional[Dict[str, int]] = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown proof status {self.status!r}")

    @property
    def proven(self) -> bool:
        return self.status == "proven"

    def __str__(self) -> str:
        cex = f" counterexample {self.counterexample}" if self.counterexample else ""
        return f"{self.status}: {self.what}{cex} ({self.seconds:.3f}s)"


def run_side_condition(condition: Callable[[], ProofResult]) -> ProofResult:
    """`condition()`, or "unknown" when it cannot even be posed (it raises ValueError,
    KeyError or TypeError: an unbound iterator, a missing component). Unknown is not proven,
    so a malformed condition refuses its rewrite with the message instead of aborting the
    search or the verification that asked."""
    try:
        return condition()
    except (ValueError, KeyError, TypeError) as err:
        return ProofResult("unknown", f"side condition could not be checked: "
                                      f"{type(err).__name__}: {err}")


# --- translation -----------------------------------------------------------------------------

def to_z3(e: IndexExpr, env: Mapping[str, z3.ArithRef]) -> z3.ArithRef:
    """The z3 integer term of an index function; iterators are looked up in `env`.

    Index functions only divide by positive constants (IBin checks it), where z3's Euclidean
    `div`/`mod` equal floor division/modulo.
    """
    return ix.interpret(e, env, z3.IntVal, lambda a, b: a / b, lambda a, b: a % b)


class _Space:
    """z3 variables for a box of iterators. `prefix` keeps two boxes with equal names apart."""

    def __init__(self, iterators: Sequence[Iterator], prefix: str = "") -> None:
        names = [it.name for it in iterators]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate iterator names {names}")
        self.iterators = tuple(iterators)
        self.env: Dict[str, z3.ArithRef] = {
            it.name: z3.Int(prefix + it.name) for it in iterators
        }

    def inside(self) -> z3.BoolRef:
        return _box_holds(self.env, self.iterators)

    def term(self, e: IndexExpr) -> z3.ArithRef:
        return to_z3(e, self.env)

    def point(self, model: z3.ModelRef) -> Dict[str, int]:
        return {name: model.eval(v, model_completion=True).as_long()
                for name, v in self.env.items()}


class _Deadline:
    """One time budget shared by the queries of a check."""

    def __init__(self, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        self.start = time.perf_counter()
        self.end = self.start + timeout_ms / 1000.0

    def left_ms(self) -> int:
        return max(1, int((self.end - time.perf_counter()) * 1000))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _find_violation(
    assumptions: z3.BoolRef, goal: z3.BoolRef, deadline: _Deadline
) -> Tuple[str, Optional[z3.ModelRef]]:
    """("proven", None) if assumptions ⇒ goal, ("refuted", model) or ("unknown", reason)."""
    solver = z3.Solver()
    solver.set("timeout", deadline.left_ms())
    solver.add(assumptions, z3.Not(goal))
    answer = solver.check()
    if answer == z3.unsat:
        return "proven", None
    if answer == z3.sat:
        return "refuted", solver.model()
    return "unknown", solver.reason_unknown()


def _forall(what: str, space: _Space, goal: z3.BoolRef, timeout_ms: int) -> ProofResult:
    """Prove `goal` at every point of `space` with one query."""
    deadline = _Deadline(timeout_ms)
    status, info = _find_violation(space.inside(), goal, deadline)
    return _result(status, what, space, info, deadline)


def _result(status: str, what: str, space: _Space, info, deadline: _Deadline) -> ProofResult:
    if status == "refuted":
        return ProofResult("refuted", what, space.point(info), deadline.elapsed())
    if status == "unknown":
        return ProofResult("unknown", f"{what} (z3: {info})", None, deadline.elapsed())
    return ProofResult("proven", what, None, deadline.elapsed())


def _check_reads(exprs: Sequence[IndexExpr], known: Sequence[str], role: str) -> None:
    known_set = set(known)
    for e in exprs:
        extra = ix.free_vars(e) - known_set
        if extra:
            raise ValueError(f"{role} {e} reads {sorted(extra)}, not among {sorted(known_set)}")


def _fmt_map(m: Mapping[str, IndexExpr]) -> str:
    return "{" + ", ".join(f"{k} ↦ {v}" for k, v in m.items()) + "}"


def _fmt_box(its: Sequence[Iterator]) -> str:
    return "{" + ", ".join(str(it) for it in its) + "}"


# --- checks ----------------------------------------------------------------------------------

def prove_index_equal(
    a: IndexExpr, b: IndexExpr, domain: Sequence[Iterator], timeout_ms: int = 5000
) -> ProofResult:
    """∀x ∈ domain: a(x) = b(x)."""
    space = _Space(domain)
    _check_reads((a, b), space.env, "index function")
    return _forall(f"{a} = {b} on {_fmt_box(domain)}", space, space.term(a) == space.term(b),
                   timeout_ms)


def prove_left_inverse(
    phi: Mapping[str, IndexExpr],
    psi: Mapping[str, IndexExpr],
    domain: Sequence[Iterator],
    timeout_ms: int = 5000,
) -> ProofResult:
    """∀x ∈ X: ψ(φ(x)) = x, so φ is injective on X and ψ undoes it.

    phi maps each new iterator name to an expression over the domain iterators; psi maps each
    domain iterator name to an expression over the new iterators.
    """
    space = _Space(domain)
    _check_components(psi, domain, "inverse map ψ")
    _check_reads(tuple(phi.values()), space.env, "φ component")
    _check_reads(tuple(psi.values()), tuple(phi), "ψ component")
    goal = _round_trip(phi, psi, space.env, domain)
    what = f"ψ∘φ = id on {_fmt_box(domain)} for φ = {_fmt_map(phi)}, ψ = {_fmt_map(psi)}"
    return _forall(what, space, goal, timeout_ms)


def _check_components(m: Mapping[str, IndexExpr], box: Sequence[Iterator], role: str) -> None:
    """`m` has exactly one component per iterator of `box`."""
    names = {it.name for it in box}
    if set(m) != names:
        raise ValueError(f"{role} has components {sorted(m)}, expected exactly {sorted(names)}")


def _round_trip(
    there: Mapping[str, IndexExpr],
    back: Mapping[str, IndexExpr],
    env: Mapping[str, z3.ArithRef],
    box: Sequence[Iterator],
    image_box: Sequence[Iterator] = (),
) -> z3.BoolRef:
    """back(there(v)) = v for the point v of `box` (and there(v) ∈ image_box, if given)."""
    image = {name: to_z3(e, env) for name, e in there.items()}
    conds = [to_z3(back[it.name], image) == env[it.name] for it in box]
    return z3.And(conds + [_box_holds(image, image_box)])


def prove_bijection(
    phi: Mapping[str, IndexExpr],
    psi: Mapping[str, IndexExpr],
    domain: Sequence[Iterator],
    codomain: Sequence[Iterator],
    timeout_ms: int = 5000,
) -> ProofResult:
    """φ: X → Y is a bijection with inverse ψ:
    ∀x∈X: φ(x)∈Y ∧ ψ(φ(x))=x   and   ∀y∈Y: ψ(y)∈X ∧ φ(ψ(y))=y.

    Counterexamples name domain points by the domain iterators and codomain points by the
    codomain iterators (the `what` says which half failed).
    """
    _check_components(psi, domain, "inverse map ψ")
    _check_components(phi, codomain, "substitution φ")
    deadline = _Deadline(timeout_ms)
    what = (f"φ = {_fmt_map(phi)} is a bijection {_fmt_box(domain)} → {_fmt_box(codomain)} "
            f"with inverse ψ = {_fmt_map(psi)}")
    halves = (
        ("φ maps X into Y and ψ∘φ = id", phi, psi, domain, codomain),
        ("ψ maps Y into X and φ∘ψ = id", psi, phi, codomain, domain),
    )
    unknown = None
    for label, there, back, box, image_box in halves:
        space = _Space(box)
        _check_reads(tuple(there.values()), space.env, "map component")
        goal = _round_trip(there, back, space.env, box, image_box)
        status, info = _find_violation(space.inside(), goal, deadline)
        if status == "refuted":
            return _result(status, f"{what}: fails, {label} does not hold", space, info, deadline)
        if status == "unknown":
            unknown = (space, info, label)
    if unknown is not None:
        space, info, label = unknown
        return _result("unknown", f"{what}: {label} not decided", space, info, deadline)
    return ProofResult("proven", what, None, deadline.elapsed())


def prove_image_within(
    phi: Sequence[IndexExpr],
    domain: Sequence[Iterator],
    box: Sequence[Tuple[int, int]],
    timeout_ms: int = 5000,
) -> ProofResult:
    """∀x ∈ X: lo_i ≤ φ_i(x) < hi_i for every component (Φ(X×Y) ⊆ Z, traversal merging)."""
    if len(phi) != len(box):
        raise ValueError(f"{len(phi)} components but a box of {len(box)} dimensions")
    space = _Space(domain)
    _check_reads(tuple(phi), space.env, "component")
    terms = [space.term(e) for e in phi]
    goal = z3.And([z3.And(t >= lo, t < hi) for t, (lo, hi) in zip(terms, box)])
    target = " × ".join(f"[{lo}, {hi})" for lo, hi in box)
    what = f"({', '.join(str(e) for e in phi)}) maps {_fmt_box(domain)} into {target}"
    return _forall(what, space, goal, timeout_ms)


def prove_cover(
    domain: Sequence[Iterator], parts: Sequence[Sequence[Iterator]], timeout_ms: int = 5000
) -> ProofResult:
    """X ⊆ X1 ∪ X2 ∪ ... for boxes over the domain's iterator names.

    A part that does not name an iterator leaves it unconstrained.
    """
    space = _Space(domain)
    in_part = [_box_holds(space.env, _part_of(part, space)) for part in parts]
    goal = z3.Or(in_part) if in_part else z3.BoolVal(False)
    union = " ∪ ".join(_fmt_box(p) for p in parts) if parts else "∅"
    return _forall(f"{_fmt_box(domain)} ⊆ {union}", space, goal, timeout_ms)


def prove_partition(
    domain: Sequence[Iterator], parts: Sequence[Sequence[Iterator]], timeout_ms: int = 5000
) -> ProofResult:
    """X = X1 ⊎ X2 ⊎ ...: every point of X lies in exactly one part.

    Splitting a summation Σ_X into Σ_X1 + Σ_X2 needs this, not only the cover: a point in
    two parts would be counted twice. Parts are read as in `prove_cover`, restricted to X.
    """
    space = _Space(domain)
    in_part = [_box_holds(space.env, _part_of(part, space)) for part in parts]
    exactly_one = z3.PbEq([(c, 1) for c in in_part], 1) if in_part else z3.BoolVal(False)
    union = " ⊎ ".join(_fmt_box(p) for p in parts) if parts else "∅"
    return _forall(f"{_fmt_box(domain)} = {union} (disjoint)", space, exactly_one, timeout_ms)


def _part_of(part: Sequence[Iterator], space: _Space) -> Sequence[Iterator]:
    unknown_names = [it.name for it in part if it.name not in space.env]
    if unknown_names:
        raise ValueError(f"part {_fmt_box(part)} names iterators {unknown_names} "
                         f"outside the domain")
    return part


def _box_holds(env: Mapping[str, z3.ArithRef], box: Sequence[Iterator]) -> z3.BoolRef:
    return z3.And([z3.And(env[it.name] >= it.lo, env[it.name] < it.hi) for it in box])


# --- constant regions (boundary tightening) --------------------------------------------------

def prove_constant_region(
    expr: Expr,
    region: Mapping[str, Tuple[int, int]],
    value: float = 0.0,
    timeout_ms: int = 5000,
) -> ProofResult:
    """For every input, the body of `expr` is `value` at every point of `region`.

    `region` restricts some iterators (traversal or summation) to sub-ranges [lo, hi); the
    others keep their full range. A zero body on the region means both that those output
    elements are zero and that those summation terms contribute nothing, which is what
    boundary tightening (EinNet §4.1) removes.

    The proof is structural and input-independent: expanding the body into a sum of products,
    every product must contain a factor that is zero on the whole region: a constant 0, an
    access whose index lies, at every region point, in the zero padding of its source (proved
    by z3) or, for a scope, in padding or at points where the scope's body is zero (the same
    proof one level down), or f(u) with f(0) = 0 (relu, tanh, neg, abs, sqrt) and u zero.
    The recursion below
    decides exactly that without expanding (a product is zero when one factor is, a sum when
    all terms are). When the structure does not prove it, a concrete evaluation of the body
    on random inputs over the region may still refute it; otherwise the answer is "unknown".
    """
    deadline = _Deadline(timeout_ms)
    box = _region_box(expr, region)
    what = f"body of {expr} is {value:g} on {_fmt_box(box)}"
    if value != 0.0:
        return ProofResult("unknown", f"{what}: only the constant 0 is supported", None,
                           deadline.elapsed())
    failure = _zero_on(expr.body, _Region.of_box(box), deadline)
    if failure is None:
        return ProofResult("proven", what, None, deadline.elapsed())
    reason, timed_out = failure
    if not timed_out and deadline.left_ms() > 1:
        point = _nonzero_point(expr, box)
        if point is not None:
            return ProofResult("refuted", f"{what}: the body is nonzero on random inputs",
                               point, deadline.elapsed())
    return ProofResult("unknown", f"{what}: {reason}", None, deadline.elapsed())


def _region_box(expr: Expr, region: Mapping[str, Tuple[int, int]]) -> Tuple[Iterator, ...]:
    ranges = expr.ranges
    unknown = sorted(set(region) - set(ranges))
    if unknown:
        raise ValueError(f"region names {unknown}, which are not iterators of the expression")
    box = []
    for it in expr.iterators:
        lo, hi = region.get(it.name, (it.lo, it.hi))
        if lo < it.lo or hi > it.hi:
            raise ValueError(f"region [{lo}, {hi}) of {it.name} leaves its range [{it.lo}, "
                             f"{it.hi})")
        if hi <= lo:
            raise ValueError(f"region [{lo}, {hi}) of {it.name} is empty")
        box.append(Iterator(it.name, lo, hi))
    return tuple(box)


class _Region:
    """The points at which a body must be zero: z3 terms for its iterators plus assumptions.

    The top level is a box. Inside a scope the region is the set of scope points read from the
    outer region (scope traversal = the outer index, summation iterators in range), so zero-ness
    can be followed through materialised scopes.
    """

    def __init__(self, env: Mapping[str, z3.ArithRef], assumptions: z3.BoolRef) -> None:
        self.env, self.assumptions = dict(env), assumptions

    @staticmethod
    def of_box(box: Sequence[Iterator]) -> "_Region":
        space = _Space(box)
        return _Region(space.env, space.inside())

    def term(self, e: IndexExpr) -> z3.ArithRef:
        return to_z3(e, self.env)

    def inside_scope(self, scope: Scope, indices: Sequence[z3.ArithRef],
                     in_data: z3.BoolRef, depth: int) -> "_Region":
        """Region of `scope`'s body at the (non-padding) points `indices` read."""
        inner = scope.expr
        env = {it.name: z3.Int(f"scope{depth}!{it.name}") for it in inner.iterators}
        facts = [self.assumptions, in_data]
        facts += [env[it.name] == t for it, t in zip(inner.traversals, indices)]
        facts += [z3.And(env[it.name] >= it.lo, env[it.name] < it.hi) for it in inner.sums]
        return _Region(env, z3.And(facts))

    def point(self, model: z3.ModelRef) -> Dict[str, int]:
        return {name: model.eval(v, model_completion=True).as_long()
                for name, v in self.env.items()}


def _zero_on(s: Scalar, region: _Region, deadline: _Deadline,
             depth: int = 0) -> Optional[Tuple[str, bool]]:
    """None if `s` is zero on the whole region, else (why not, whether z3 ran out of time)."""
    if isinstance(s, Constant):
        return None if s.value == 0.0 else (f"constant {s} is not zero", False)
    if isinstance(s, Access):
        return _zero_access(s, region, deadline, depth)
    if isinstance(s, UnaryOp):
        if s.fn not in ZERO_PRESERVING:
            return (f"{s.fn}(0) ≠ 0, so {s} is not zero", False)
        return _zero_on(s.arg, region, deadline, depth)
    if isinstance(s, BinaryOp):
        left = _zero_on(s.lhs, region, deadline, depth)
        if s.op == "*":
            if left is None:
                return None
            right = _zero_on(s.rhs, region, deadline, depth)
            if right is None:
                return None
            return (f"neither factor of {s} is zero ({left[0]}; {right[0]})",
                    left[1] or right[1])
        if left is not None:
            return left
        return _zero_on(s.rhs, region, deadline, depth)
    raise TypeError(f"unknown scalar node {type(s).__name__}")


def _zero_access(a: Access, region: _Region, deadline: _Deadline,
                 depth: int) -> Optional[Tuple[str, bool]]:
    """An access is zero where its index lies in the source's zero padding, or (for a scope)
    where the scope's own body is zero at the point read."""
    src = a.source
    terms = [region.term(i) for i in a.indices]
    in_padding = z3.Or([z3.Or(t < o, t >= o + n)
                        for t, o, n in zip(terms, src.origin, src.shape)])
    status, info = _find_violation(region.assumptions, in_padding, deadline)
    if status == "proven":
        return None
    if isinstance(src, Scope):
        inner = region.inside_scope(src, terms, z3.Not(in_padding), depth + 1)
        if _zero_on(src.expr.body, inner, deadline, depth + 1) is None:
            return None
    if status == "refuted":
        return (f"{a} reads data, not padding, at {region.point(info)}", False)
    return (f"z3 could not decide whether {a} reads only padding ({info})", True)


_MAX_REFUTATION_POINTS = 1 << 18  # keeps the concrete refutation well under a second


def _nonzero_point(expr: Expr, box: Sequence[Iterator]) -> Optional[Dict[str, int]]:
    """A region point where the body is nonzero on random inputs, if one is found."""
    import math

    import numpy as np

    from ..expr.interpreter import EvaluationError, evaluate, random_inputs

    if math.prod(it.extent for it in box) > _MAX_REFUTATION_POINTS:
        return None
    pointwise = Expr(tuple(box), (), expr.body, expr.dtype)
    try:
        values = evaluate(pointwise, random_inputs(pointwise, seed=0))
    except EvaluationError:
        return None
    with np.errstate(invalid="ignore"):
        bad = np.argwhere(values != 0.0)
    if bad.size == 0:
        return None
    return {it.name: int(v) + it.lo for it, v in zip(box, bad[0])}


__all__ = [
    "ProofResult", "run_side_condition", "to_z3", "prove_index_equal", "prove_left_inverse", "prove_bijection",
    "prove_image_within", "prove_cover", "prove_partition", "prove_constant_region",
    "ZERO_PRESERVING",
]
