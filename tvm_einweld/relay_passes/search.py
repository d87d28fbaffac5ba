"""Distance-guided derivation search (EinNet §6.1–6.2).

Two phases, as in the paper's Fig. 10:

* **Explorative derivation** (`explore`): apply every rule to every state, up to `max_depth`
  rule applications from the start, best-first (a priority callable, FIFO on ties, which is
  breadth-first by default) or depth-first. A state reached again along another rule sequence
  is dropped: its fingerprint (§6.2) is looked up, and a hit is confirmed by
  `structurally_equal` before the state is counted as pruned; a fingerprint collision between
  different expressions keeps both.
* **Converging derivation** (`converge`): towards one target operator, follow only derivations
  that strictly reduce an expression distance (the paper's mismatch count of the iterator-mapping
  table), until the distance is 0, i.e. the expression instantiates as that operator. The
  distance is a parameter (any `Callable[[Expr], Optional[float]]`, None meaning "cannot become
  this operator"), so the matching module supplies it.

`distance_guided_search` runs both: every explored state is a candidate, and each one is also
driven towards every target. Budgets (depth, states, seconds) are shared by both phases. The
search is deterministic for a given seed: the seed only permutes the order in which the
successors of a state are queued.

Rules are the `derivation.Rule` objects (their `apply(expr)` yields proven `Derivation`s); a
rule that raises is recorded in the statistics and contributes no successor, so a faulty rule
cannot stop the search, and cannot produce a wrong rewrite either (only proven derivations
become states, and the pass verifies whatever it picks again).
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..expr.expression import Expr
from ..expr.fingerprint import fingerprint, structurally_equal
from .derivation import Derivation, Rule

Distance = Callable[[Expr], Optional[float]]
Priority = Callable[["State"], float]


@dataclass(frozen=True)
class Budget:
    """Limits of one search. `max_states` counts distinct states, the start included."""

    max_depth: int = 7
    max_states: int = 2000
    time_limit_s: float = 30.0
    strategy: str = "best_first"  # or "dfs"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in ("best_first", "dfs"):
            raise ValueError(f"unknown search strategy {self.strategy!r} (best_first or dfs)")
        if self.max_depth < 0 or self.max_states < 1 or self.time_limit_s <= 0:
            raise ValueError(f"invalid budget {self}")


@dataclass(frozen=True)
class State:
    """An expression reached from the start by a sequence of derivations."""

    expr: Expr
    depth: int = 0
    parent: Optional["State"] = field(default=None, repr=False, compare=False)
    derivation: Optional[Derivation] = field(default=None, repr=False, compare=False)

    @property
    def derivations(self) -> Tuple[Derivation, ...]:
        """The derivations from the start to this state, in order."""
        chain, state = [], self
        while state.derivation is not None:
            chain.append(state.derivation)
            state = state.parent
        return tuple(reversed(chain))

    @property
    def rules(self) -> Tuple[str, ...]:
        return tuple(d.rule for d in self.derivations)


@dataclass(frozen=True)
class Match:
    """A state whose expression instantiates as `target` (distance 0)."""

    target: str
    state: State


@dataclass(frozen=True)
class SearchStats:
    states: int  # distinct states created (start included)
    pruned: int  # successors dropped as repeats (fingerprint hit confirmed structurally)
    collisions: int  # fingerprint hits that were different expressions (kept)
    expanded: int  # states whose successors were generated
    seconds: float
    stopped_by: str  # "exhausted", "max_states" or "time_limit"
    rule_errors: Tuple[str, ...] = ()

    @property
    def pruned_fraction(self) -> float:
        """Pruned successors as a fraction of all successors generated."""
        total = self.states - 1 + self.pruned
        return self.pruned / total if total else 0.0


@dataclass(frozen=True)
class SearchResult:
    start: State
    states: Tuple[State, ...]  # every distinct state, in discovery order (start first)
    stats: SearchStats
    best_per_depth: Tuple[Optional[State], ...]  # lowest-ranked state at each depth
    matches: Tuple[Match, ...] = ()

    def find(self, predicate: Callable[[Expr], bool]) -> Optional[State]:
        """The first state (discovery order) whose expression satisfies `predicate`."""
        return next((s for s in self.states if predicate(s.expr)), None)


class _Seen:
    """Fingerprint table of states; hits are confirmed by structural equality."""

    def __init__(self) -> None:
        self.table: Dict[str, List[State]] = {}
        self.pruned = 0
        self.collisions = 0

    def known(self, expr: Expr, depth: int) -> bool:
        """True (and counted as pruned) when `expr` was seen at a depth <= `depth`."""
        bucket = self.table.get(fingerprint(expr), [])
        hit = False
        for old in bucket:
            if structurally_equal(old.expr, expr):
                if old.depth <= depth:
                    self.pruned += 1
                    return True
                hit = True
        if bucket and not hit:
            self.collisions += 1
        return False

    def add(self, state: State) -> None:
        self.table.setdefault(fingerprint(state.expr), []).append(state)


class _Clock:
    """Shared state budget and deadline of one search."""

    def __init__(self, budget: Budget, deadline: Optional[float] = None) -> None:
        self.budget = budget
        self.start = time.perf_counter()
        self.deadline = self.start + budget.time_limit_s if deadline is None else deadline
        self.states = 0
        self.stopped_by = "exhausted"

    def out(self) -> bool:
        if self.states >= self.budget.max_states:
            self.stopped_by = "max_states"
        elif time.perf_counter() > self.deadline:
            self.stopped_by = "time_limit"
        else:
            return False
        return True

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def successors(state: State, rules: Sequence[Rule], errors: List[str]) -> List[State]:
    """Every proven derivation of every rule from `state`, as states one level deeper."""
    out = []
    for rule in rules:
        try:
            for d in rule.apply(state.expr):
                out.append(State(d.result, state.depth + 1, state, d))
        except Exception as err:  # a faulty rule must not stop the search; it is reported
            errors.append(f"{getattr(rule, 'name', type(rule).__name__)} on {state.expr}: "
                          f"{type(err).__name__}: {err}")
    return out


def explore(
    expr: Expr,
    rules: Sequence[Rule],
    budget: Budget = Budget(),
    priority: Optional[Priority] = None,
    rank: Optional[Callable[[Expr], float]] = None,
    on_state: Optional[Callable[[State], bool]] = None,
) -> SearchResult:
    """Explorative derivation from `expr`.

    `priority(state)` orders the frontier of the best-first strategy (lower first; FIFO on
    ties, so the default is breadth-first). `rank(expr)` chooses the best state per depth
    (default: the priority, else discovery order). `on_state(state)` is called for every new
    state; returning True stops the search (used to stop at a goal).
    """
    clock = _Clock(budget)
    return _explore(State(expr), rules, budget, clock, _Seen(), priority, rank, on_state)


def _explore(start: State, rules, budget: Budget, clock: _Clock, seen: _Seen,
             priority, rank, on_state) -> SearchResult:
    rng = random.Random(budget.seed)
    errors: List[str] = []
    order = 0
    states: List[State] = [start]
    seen.add(start)
    clock.states += 1
    frontier: List[Tuple[float, int, State]] = [(0.0, 0, start)]
    stop = bool(on_state and on_state(start))
    if stop:
        clock.stopped_by = "goal"
    expanded = 0
    while frontier and not stop and not clock.out():
        if budget.strategy == "dfs":
            _, _, state = frontier.pop()
        else:
            _, _, state = heapq.heappop(frontier)
        if state.depth >= budget.max_depth:
            continue
        expanded += 1
        children = successors(state, rules, errors)
        rng.shuffle(children)
        for child in children:
            if seen.known(child.expr, child.depth):
                continue
            seen.add(child)
            states.append(child)
            clock.states += 1
            order += 1
            key = priority(child) if priority is not None else 0.0
            if budget.strategy == "dfs":
                frontier.append((key, order, child))
            else:
                heapq.heappush(frontier, (key, order, child))
            if on_state and on_state(child):
                clock.stopped_by, stop = "goal", True
                break
            if clock.out():
                stop = True
                break
    stats = SearchStats(len(states), seen.pruned, seen.collisions, expanded, clock.seconds,
                        clock.stopped_by, tuple(errors))
    return SearchResult(start, tuple(states), stats, _best_per_depth(states, rank, priority))


def _best_per_depth(states: Sequence[State], rank, priority) -> Tuple[Optional[State], ...]:
    if not states:
        return ()
    depth = max(s.depth for s in states)
    best: List[Optional[State]] = [None] * (depth + 1)
    keys: List[float] = [float("inf")] * (depth + 1)
    for s in states:
        if rank is not None:
            key = rank(s.expr)
        elif priority is not None:
            key = priority(s)
        else:
            key = 0.0
        if best[s.depth] is None or key < keys[s.depth]:
            best[s.depth], keys[s.depth] = s, key
    return tuple(best)


def converge(
    start: State,
    rules: Sequence[Rule],
    distance: Distance,
    budget: Budget = Budget(),
    clock: Optional[_Clock] = None,
) -> Tuple[Optional[State], int]:
    """Converging derivation: only derivations that reduce `distance` are followed.

    Best-first on the distance, within `budget.max_depth` further steps and `budget.max_states`
    new states. Returns the first state at distance 0 (or None) and the number of states it
    created. `clock` shares a deadline with a surrounding search.
    """
    clock = _Clock(budget, clock.deadline if clock is not None else None)
    d0 = distance(start.expr)
    if d0 is None:
        return None, 0
    if d0 == 0:
        return start, 0
    rng = random.Random(budget.seed)
    seen = _Seen()
    seen.add(start)
    errors: List[str] = []
    created, order = 0, 0
    frontier: List[Tuple[float, int, State, float]] = [(d0, 0, start, d0)]
    while frontier and not clock.out():
        _, _, state, dist = heapq.heappop(frontier)
        if state.depth - start.depth >= budget.max_depth:
            continue
        children = successors(state, rules, errors)
        rng.shuffle(children)
        for child in children:
            d = distance(child.expr)
            if d is None or d >= dist or seen.known(child.expr, child.depth):
                continue
            seen.add(child)
            created += 1
            clock.states += 1
            if d == 0:
                return child, created
            order += 1
            heapq.heappush(frontier, (d, order, child, d))
    return None, created


def distance_guided_search(
    expr: Expr,
    rules: Sequence[Rule],
    targets: Mapping[str, Distance] = None,
    budget: Budget = Budget(),
    converging_rules: Optional[Sequence[Rule]] = None,
    rank: Optional[Callable[[Expr], float]] = None,
) -> SearchResult:
    """Explorative derivation, then converging derivation from each explored state towards
    each target operator (EinNet's DISTANCEGUIDEDSEARCH). Matches are reported in order."""
    targets = dict(targets or {})
    conv_rules = list(converging_rules) if converging_rules is not None else list(rules)
    clock = _Clock(budget)
    seen = _Seen()
    result = _explore(State(expr), rules, budget, clock, seen, None, rank, None)
    matches: List[Match] = []
    matched_fps: Dict[Tuple[str, str], List[Expr]] = {}
    converged = 0
    for state in result.states:
        for name, dist in sorted(targets.items()):
            if time.perf_counter() > clock.deadline:
                clock.stopped_by = "time_limit"
                break
            found, created = converge(state, conv_rules, dist, budget, clock)
            converged += created
            if found is None:
                continue
            key = (name, fingerprint(found.expr))
            if any(structurally_equal(e, found.expr) for e in matched_fps.get(key, [])):
                continue
            matched_fps.setdefault(key, []).append(found.expr)
            matches.append(Match(name, found))
    stats = SearchStats(result.stats.states + converged, seen.pruned, seen.collisions,
                        result.stats.expanded, clock.seconds, clock.stopped_by,
                        result.stats.rule_errors)
    all_states = result.states + tuple(m.state for m in matches)
    return SearchResult(result.start, all_states, stats,
                        _best_per_depth(all_states, rank, None), tuple(matches))


def default_rules() -> List[Rule]:
    """The intra-expression rules of EinNet §4.1 that the search applies by default.

    Summation-iterator splitting and boundary relaxing are left out: they apply to almost
    every state (one instance per divisor / per iterator) and are used by hand-sequenced
    derivations and converging derivation only.
    """
    from .boundary import BoundaryTightening
    from .summation_splitting import SummationSplitting
    from .traversal_merging import TraversalMerging
    from .variable_substitution import VariableSubstitution

    return [SummationSplitting(), VariableSubstitution(), TraversalMerging(),
            BoundaryTightening()]


def default_targets() -> Dict[str, Distance]:
    """Converging targets: the predefined operators of the iterator-mapping table with their
    expression distance (`mapping_table.expression_distance`)."""
    from .mapping_table import expression_distance

    return {op: (lambda e, op=op: expression_distance(e, op))
            for op in ("matmul", "conv2d", "g2bmm")}


__all__ = ["Budget", "State", "Match", "SearchStats", "SearchResult", "explore", "converge",
           "distance_guided_search", "successors", "default_rules", "default_targets"]
