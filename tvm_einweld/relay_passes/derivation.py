"""Derivations: one application of one rule, with the side conditions that make it correct.

A rule (EinNet §4) looks at an expression and proposes successors. Each proposal carries its
side conditions as zero-argument callables returning a `verify.smt.ProofResult`; `Rule.apply`
runs them and yields only the proposals whose conditions are all *proven*. `Rule` declares what
every rule has (name, whether the search uses it, proposing and applying), so the search reads
rules through that one interface; the registry of the package's rules is `registry.RULES`. Unknown counts as
failure, so a rule instance that z3 cannot decide is never produced.

Rules look at one expression level at a time; `locations` lets every rule act on the top-level
expression and on every nested scope, rebuilding the whole expression around the rewrite.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator as PyIterator, List, Optional, Sequence, Tuple

from ..expr import index as ix
from ..expr.expression import Access, Expr, Iterator, Scope, Tensor, accesses, map_accesses
from ..verify.smt import ProofResult, run_side_condition
from ..expr.index_simplify import simplify_expr

SideCondition = Callable[[], ProofResult]


class RuleNotApplicable(ValueError):
    """A requested rule instance does not exist or its side conditions were not proven."""


@dataclass(frozen=True)
class LevelRewrite:
    """A proposed rewrite of one expression level, not yet checked."""

    result: Expr
    side_conditions: Tuple[SideCondition, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class Derivation:
    """A checked rule application: `result` equals the input expression."""

    rule: str
    result: Expr
    side_conditions: Tuple[SideCondition, ...]
    description: str
    proofs: Tuple[ProofResult, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return f"{self.rule}: {self.description}"


@dataclass(frozen=True)
class Location:
    """An expression level inside a larger expression: the top level or a nested scope."""

    expr: Expr
    rebuild: Callable[[Expr], Expr]
    path: str
    is_top: bool


def locations(expr: Expr) -> PyIterator[Location]:
    """The top level of `expr`, then every nested scope (outermost first)."""
    yield Location(expr, lambda new: _check_top(expr, new), "top", True)
    yield from _nested(expr, lambda new: _check_top(expr, new), "top")


def _check_top(old: Expr, new: Expr) -> Expr:
    if tuple((t.lo, t.hi) for t in old.traversals) != tuple((t.lo, t.hi) for t in new.traversals):
        raise RuleNotApplicable("a rewrite of the top level must keep the output's ranges")
    return new


def _nested(expr: Expr, rebuild: Callable[[Expr], Expr], path: str) -> PyIterator[Location]:
    seen: List[Scope] = []
    for acc in accesses(expr.body):
        scope = acc.source
        if not isinstance(scope, Scope) or scope in seen:
            continue
        seen.append(scope)
        sub_path = f"{path}/scope{len(seen) - 1}"

        def rebuild_scope(new: Expr, scope=scope, expr=expr, rebuild=rebuild) -> Expr:
            return rebuild(replace_source(expr, scope, rescope(scope, new)))

        yield Location(scope.expr, rebuild_scope, sub_path, False)
        yield from _nested(scope.expr, rebuild_scope, sub_path)


def rescope(scope: Scope, new: Expr) -> Scope:
    """`new` as a replacement of `scope`: padding grows where the range shrank, so every index
    that was readable before (value or zero padding) is still readable."""
    if len(new.traversals) != len(scope.expr.traversals):
        raise RuleNotApplicable("a rewrite of a scope must keep its rank")
    pad = []
    for old_it, new_it, (pl, ph) in zip(scope.expr.traversals, new.traversals, scope.pad):
        pad.append((max(0, pl + new_it.lo - old_it.lo), max(0, ph + old_it.hi - new_it.hi)))
    return Scope(new, tuple(pad))


def replace_source(expr: Expr, old, new) -> Expr:
    """`expr` with every access to source `old` reading `new` instead (same indices)."""
    def swap(a: Access) -> Access:
        return Access(new, a.indices) if a.source == old else a

    return Expr(expr.traversals, expr.sums, map_accesses(expr.body, swap), expr.dtype)


def check(rule: str, candidate: LevelRewrite, loc: Optional[Location] = None) -> Derivation:
    """Run the side conditions of `candidate`; the derivation, or RuleNotApplicable saying why."""
    proofs = tuple(run_side_condition(cond) for cond in candidate.side_conditions)
    failed = [p for p in proofs if not p.proven]
    where = f" at {loc.path}" if loc is not None and not loc.is_top else ""
    if failed:
        raise RuleNotApplicable(
            f"{rule}{where}: {candidate.description}: side condition not proven: "
            + "; ".join(str(p) for p in failed))
    result = loc.rebuild(candidate.result) if loc is not None else candidate.result
    return Derivation(rule, result, candidate.side_conditions,
                      candidate.description + where, proofs)


@dataclass(frozen=True)
class Proposal:
    """A rule instance whose side conditions are not proven yet: `prove()` returns the
    derivation, or None when a condition does not hold. The search proves only proposals it
    keeps (new, and improving where converging), since the z3 proofs dominate its time."""

    rule: str
    result: Expr
    prove: Callable[[], Optional[Derivation]] = field(compare=False, repr=False)

    @staticmethod
    def proven(derivation: Derivation) -> "Proposal":
        """A derivation that is already checked, as a proposal that proves at once."""
        return Proposal(derivation.rule, derivation.result, lambda: derivation)


class Rule:
    """A derivation rule (EinNet §4): what every rule declares and how it is applied.

    A rule implements `candidates(expr, is_top)` for one expression level (or, when it finds
    whole derivations itself, overrides `propose`). Everything else has a default that
    follows from it, so the search and `apply_at` treat every rule alike:

    * `name`: the rule's name in derivations, logs and statistics.
    * `explorative_only`: the search's converging derivation leaves it out (a rule that
      enlarges a level on purpose, see `search.distance_guided_search`).
    * `searched`: `search.default_rules()` applies it (a rule proposing an instance at almost
      every state, such as boundary relaxing, is for hand-sequenced derivations only).
    * `propose(expr)`: every instance at every level of `expr` (`locations`), unproven.
    * `apply(expr)`: the proven ones among them, as derivations.
    """

    name: str = "rule"
    explorative_only: bool = False
    searched: bool = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "apply" in vars(cls) and "propose" not in vars(cls):
            # The search reads `propose` only: an `apply` of its own would be ignored there.
            raise TypeError(f"{cls.__name__} overrides Rule.apply; override `propose` (or "
                            "`candidates`) instead, `apply` follows from it")

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        """The rewrites of one level (`is_top`: the whole expression), unproven; none here."""
        return ()

    def propose(self, expr: Expr) -> PyIterator[Proposal]:
        """Every instance of this rule at every level of `expr`, its side conditions not run
        yet: `Proposal.prove()` runs them (`check`). An instance whose rewrite cannot be put
        back into `expr` (`RuleNotApplicable` from the rebuild) is not proposed."""
        for loc in locations(expr):
            for cand in self.candidates(loc.expr, loc.is_top):
                try:
                    result = loc.rebuild(cand.result)
                except RuleNotApplicable:
                    continue
                yield Proposal(self.name, result, _prover(self.name, cand, loc))

    def apply(self, expr: Expr) -> PyIterator[Derivation]:
        """Every proven instance of this rule, at every level of `expr`."""
        for proposal in self.propose(expr):
            derivation = proposal.prove()
            if derivation is not None:
                yield derivation


def _prover(name: str, cand: LevelRewrite, loc: Location) -> Callable[[], Optional[Derivation]]:
    def prove() -> Optional[Derivation]:
        try:
            return check(name, cand, loc)
        except RuleNotApplicable:
            return None

    return prove


def apply_at(rule: Rule, expr: Expr, path: str = "top",
             where: Callable[[LevelRewrite], bool] = lambda c: True,
             verify: bool = False) -> Derivation:
    """The first proven instance of `rule` at location `path` accepted by `where`.

    Used to apply rules by hand in a fixed sequence; raises RuleNotApplicable listing why
    each candidate was refused when none qualifies. With `verify`, each instance is also
    checked against `expr` by exact screening and random testing (`verify.verify_rewrite`)
    and refused if they disagree.
    """
    reasons = []
    for loc in locations(expr):
        if loc.path != path:
            continue
        for cand in rule.candidates(loc.expr, loc.is_top):
            if not where(cand):
                continue
            try:
                derivation = check(rule.name, cand, loc)
            except RuleNotApplicable as err:
                reasons.append(str(err))
                continue
            if verify:
                from ..verify import verify_rewrite

                verdict = verify_rewrite(expr, derivation.result)
                if not verdict.ok:
                    reasons.append(f"{derivation}: {verdict.reason}")
                    continue
            return derivation
    raise RuleNotApplicable(f"no proven instance of {rule.name} at {path} in {expr}"
                            + ("".join(f"\n  {r}" for r in reasons)))


def fresh_name(taken: Iterable[str], stem: str) -> str:
    taken = set(taken)
    k = 1
    while f"{stem}{k}" in taken:
        k += 1
    return f"{stem}{k}"


def simplify(expr: Expr) -> Expr:
    """`expr` with every index function of its body simplified (nested scopes untouched)."""
    return simplify_expr(expr)


def widen_padding(expr: Expr) -> Expr:
    """`expr` with every source padded enough that no read leaves its padded bounds.

    Used where a rule makes an expression read points whose values are never used (the extra
    points of a bounding box): padding only adds zeros, so widening it cannot change any value
    that is read. Index functions are simplified first.
    """
    expr = simplify(expr)
    ranges = expr.ranges

    def widen(a: Access) -> Access:
        src = a.source
        pad = []
        for idx, o, n, (pl, ph) in zip(a.indices, src.origin, src.shape, src.pad):
            lo, hi = ix.bounds(idx, ranges)
            pad.append((max(pl, o - lo), max(ph, hi - (o + n - 1))))
        pad = tuple(pad)
        return a if pad == src.pad else Access(src.with_pad(pad), a.indices)

    return Expr(expr.traversals, expr.sums, map_accesses(expr.body, widen), expr.dtype)


def trim_padding(expr: Expr) -> Expr:
    """`expr` with the padding of its input tensors cut to what its reads can reach.

    Sound because padding no read reaches has no effect; scopes keep theirs (their padding is
    the zero region a rewrite created and consumers may rely on).
    """
    expr = simplify(expr)
    ranges = expr.ranges

    def trim(a: Access) -> Access:
        src = a.source
        if not isinstance(src, Tensor):
            return a
        pad = []
        for idx, n, (pl, ph) in zip(a.indices, src.shape, src.pad):
            lo, hi = ix.bounds(idx, ranges)
            pad.append((min(pl, max(0, -lo)), min(ph, max(0, hi - (n - 1)))))
        pad = tuple(pad)
        return a if pad == src.pad else Access(src.with_pad(pad), a.indices)

    return Expr(expr.traversals, expr.sums, map_accesses(expr.body, trim), expr.dtype)


def with_ranges(expr: Expr, ranges: dict) -> Expr:
    """`expr` with some iterators' ranges replaced: {name: (lo, hi)}."""
    def re(its: Sequence[Iterator]) -> Tuple[Iterator, ...]:
        return tuple(Iterator(it.name, *ranges[it.name]) if it.name in ranges else it
                     for it in its)

    return Expr(re(expr.traversals), re(expr.sums), expr.body, expr.dtype)


__all__ = [
    "LevelRewrite", "Derivation", "Location", "Proposal", "Rule", "RuleNotApplicable",
    "SideCondition", "apply_at", "check", "fresh_name", "locations", "replace_source", "rescope", "simplify",
    "trim_padding", "widen_padding", "with_ranges",
]
