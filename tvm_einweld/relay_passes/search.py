"""Distance-guided derivation search (EinNet §6.1–6.2).

Two phases, as in the paper's Fig. 10:

* **Explorative derivation** (`explore`): apply every rule to every state, up to `max_depth`
  rule applications from the start, best-first (a priority callable, FIFO on ties, which is
  breadth-first by default) or depth-first. A state reached again along another rule sequence
  is dropped: its fingerprint (§6.2) is looked up, and a hit is confirmed by
  `structurally_equal` before the state is counted as pruned; a fingerprint collision between
  different expressions keeps both.
* **Converging derivation** (`converge`): towards one target operator, follow only derivations
  that reduce the expression distance (the paper's mismatch count of the iterator-mapping
  table, here summed over the levels instantiation must map to operators, `level_distance`)
  until it is 0, i.e. the expression instantiates as that operator; then only derivations that
  keep it at 0 and lower a compile-free cost estimate (`op_cost.roofline_seconds`: inlining an
  intermediate, not computing padding). The distance is a parameter (any
  `Callable[[Expr], Optional[float]]`, None meaning "cannot become this operator").

`distance_guided_search` runs both, interleaved: every explored state is a candidate, and as
soon as it is found it is also driven towards every target. Budgets (depth, states, seconds)
cover both phases. The search is deterministic for a given seed (up to where a time limit cuts
it): the seed only permutes the order in which the successors of a state are queued.

Both phases are one best-first loop (`_best_first`) that differ only in the key a state is
queued by and in which successors they admit: every explored successor that is new, and in
converging only those that improve (distance, cost). Anything said of the loop (repeats are
dropped before proving, a faulty rule is reported, the seed fixes the order) holds for both.

Rules are `derivation.Rule` objects, read only through that interface (`name`,
`explorative_only`, `propose`); the default set is `registry.RULES`'s searched rules. Their
side conditions (z3 proofs) dominate the search's time, so rule instances are proposed unproven
(`Rule.propose`) and proven only when the search keeps them: new, and improving while
converging. Only proven derivations become states. A
rule that raises is recorded in the statistics and contributes no successor, so a faulty rule
cannot stop the search, nor produce a wrong rewrite (the pass verifies whatever it picks).
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from ..expr.expression import Expr
from ..expr.fingerprint import fingerprint, structurally_equal
from .deadline import DeadlineExceeded, search_deadline
from .derivation import Derivation, Proposal, Rule

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
class TargetMatch:
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
    matches: Tuple[TargetMatch, ...] = ()

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


def proposals(expr: Expr, rules: Sequence[Rule], errors: List[str],
              deadline: Optional[float] = None) -> List[Proposal]:
    """Every instance of every rule at every level of `expr`, unproven (`Rule.propose`).
    Past `deadline` (a `time.perf_counter()` value) the proposals found so far are returned."""
    if deadline is not None:
        with search_deadline(deadline):
            return proposals(expr, rules, errors)
    out: List[Proposal] = []
    for rule in rules:
        try:
            for proposal in rule.propose(expr):
                out.append(proposal)
        except DeadlineExceeded:
            break  # the search is out of time: it stops at its next check
        except Exception as err:  # a faulty rule must not stop the search; it is reported
            errors.append(f"{rule.name} on {expr}: {type(err).__name__}: {err}")
    return out


Key = TypeVar("Key")


def _best_first(start: State, start_key: Key, rules: Sequence[Rule], budget: Budget,
                clock: _Clock, seen: _Seen, errors: List[str],
                admit: Callable[[Expr, Key], Optional[Key]],
                visit: Callable[[State, Key], Tuple[Key, bool]], lifo: bool = False) -> int:
    """The derivation loop both phases drive; returns the number of states expanded.

    It takes the frontier state of lowest key (FIFO on ties; the newest with `lifo`, which is
    depth-first), stops expanding at `budget.max_depth` steps from `start`, and asks every rule
    for its instances there in an order the budget's seed permutes. A proposal is kept when
    `admit(result, parent key)` gives it a key, it is not a repeat (`seen`), and its side
    conditions are proven, in that order, so proofs run only for what would be kept.
    `visit(child, key)` sees each kept state and returns (its frontier key, stop). The loop
    ends when the frontier is empty, `visit` says stop, or the clock runs out (between
    expansions; `visit` checks within one where the caller wants it)."""
    rng = random.Random(budget.seed)
    frontier: List[Tuple[Key, int, State]] = [(start_key, 0, start)]
    order = expanded = 0
    stop = False
    while frontier and not stop and not clock.out():
        key, _, state = frontier.pop() if lifo else heapq.heappop(frontier)
        if state.depth - start.depth >= budget.max_depth:
            continue
        expanded += 1
        props = proposals(state.expr, rules, errors, clock.deadline)
        rng.shuffle(props)
        for prop in props:
            child_key = admit(prop.result, key)
            if child_key is None or seen.known(prop.result, state.depth + 1):
                continue
            derivation = prop.prove()
            if derivation is None:
                continue
            child = State(derivation.result, state.depth + 1, state, derivation)
            seen.add(child)
            clock.states += 1
            order += 1
            child_key, stop = visit(child, child_key)
            if lifo:
                frontier.append((child_key, order, child))
            else:
                heapq.heappush(frontier, (child_key, order, child))
            if stop:
                break
    return expanded


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
    errors: List[str] = []
    states: List[State] = [start]
    seen.add(start)
    clock.states += 1

    def visit(child: State, _key) -> Tuple[float, bool]:
        states.append(child)
        key = priority(child) if priority is not None else 0.0
        if on_state and on_state(child):
            clock.stopped_by = "goal"
            return key, True
        return key, clock.out()

    expanded = 0
    if on_state and on_state(start):
        clock.stopped_by = "goal"
    else:
        expanded = _best_first(start, 0.0, rules, budget, clock, seen, errors,
                               lambda _result, _key: 0.0, visit, budget.strategy == "dfs")
    if clock.stopped_by == "exhausted":
        clock.out()  # proposals cut short by the deadline can empty the frontier early
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
    cost: Optional[Callable[[Expr], float]] = None,
) -> Tuple[Optional[State], int]:
    """Converging derivation towards one target operator.

    Only derivations that improve (distance, cost) lexicographically are followed: first the
    distance must drop (EinNet's rule) until it is 0, i.e. the expression instantiates as the
    target; from then on a derivation must keep it at 0 and lower `cost` (traversal merging
    that removes an intermediate, boundary tightening that stops computing padding). Each path
    therefore strictly improves, so the phase is short. Best-first on (distance, cost), within
    `budget.max_depth` further steps and `budget.max_states` new states; `clock` shares a
    deadline with a surrounding search. Returns the cheapest state at distance 0 (or None) and
    the number of states created.
    """
    clock = _Clock(budget, clock.deadline if clock is not None else None)
    cost = cost or (lambda e: 0.0)
    d0 = distance(start.expr)
    if d0 is None:
        return None, 0
    key0 = (d0, cost(start.expr))
    best: Optional[Tuple[Tuple[float, float], State]] = (key0, start) if d0 == 0 else None
    seen = _Seen()
    seen.add(start)
    created = 0

    def admit(result: Expr, key: Tuple[float, float]) -> Optional[Tuple[float, float]]:
        d = distance(result)
        if d is None or d > key[0]:
            return None
        child_key = (d, cost(result))
        return child_key if child_key < key else None

    def visit(child: State, key: Tuple[float, float]) -> Tuple[Tuple[float, float], bool]:
        nonlocal best, created
        created += 1
        if key[0] == 0 and (best is None or key < best[0]):
            best = (key, child)
        return key, False

    _best_first(start, key0, rules, budget, clock, seen, [], admit, visit)
    return (best[1] if best is not None else None), created


def distance_guided_search(
    expr: Expr,
    rules: Sequence[Rule],
    targets: Mapping[str, Distance] = None,
    budget: Budget = Budget(),
    converging_rules: Optional[Sequence[Rule]] = None,
    rank: Optional[Callable[[Expr], float]] = None,
    cost: Optional[Callable[[Expr], float]] = None,
    converge_states: int = 200,
    stop_when: Optional[Callable[[State], bool]] = None,
) -> SearchResult:
    """EinNet's DISTANCEGUIDEDSEARCH: explorative derivation (breadth-first up to
    `budget.max_depth`), and from every explored state as soon as it is found, converging
    derivation towards each target operator (at most `converge_states` states each). The
    budget's states and deadline cover both phases. Matches are reported in discovery order,
    one per distinct (target, expression). `cost` orders converging among equal distances
    (default: `op_cost.roofline_seconds`); `stop_when(state)`, asked of every explored state
    and every match, ends the search when it returns True (stopped_by "goal").
    `converging_rules` defaults to `rules` less those marked `explorative_only` (rules that
    enlarge an expression on purpose, such as `WindowSplitting`: they change which operator
    instance a level can become and never fix a mismatch themselves)."""
    if cost is None:
        from .op_cost import roofline_seconds as cost
    targets = dict(targets or {})
    conv_rules = list(converging_rules) if converging_rules is not None else \
        [r for r in rules if not r.explorative_only]
    conv_budget = Budget(max_depth=budget.max_depth, max_states=converge_states,
                         time_limit_s=budget.time_limit_s, seed=budget.seed)
    clock = _Clock(budget)
    matches: List[TargetMatch] = []
    matched: Dict[Tuple[str, str], List[Expr]] = {}
    converged = [0]

    def on_state(state: State) -> bool:
        if stop_when is not None and stop_when(state):
            return True
        for name, dist in sorted(targets.items()):
            if time.perf_counter() > clock.deadline:
                return False
            found, created = converge(state, conv_rules, dist, conv_budget, clock, cost)
            converged[0] += created
            clock.states += created
            if found is None:
                continue
            key = (name, fingerprint(found.expr))
            if any(structurally_equal(e, found.expr) for e in matched.get(key, [])):
                continue
            matched.setdefault(key, []).append(found.expr)
            matches.append(TargetMatch(name, found))
            if stop_when is not None and stop_when(found):
                return True
        return False

    result = _explore(State(expr), rules, budget, clock, _Seen(), None, rank, on_state)
    stats = SearchStats(result.stats.states + converged[0], result.stats.pruned,
                        result.stats.collisions, result.stats.expanded, clock.seconds,
                        clock.stopped_by, result.stats.rule_errors)
    all_states = result.states + tuple(m.state for m in matches)
    return SearchResult(result.start, all_states, stats,
                        _best_per_depth(all_states, rank, None), tuple(matches))


def default_rules() -> List[Rule]:
    """The intra-expression rules of EinNet §4.1 that the search applies by default: those of
    `registry.RULES` marked `searched`.

    Summation-iterator splitting and boundary relaxing on their own are left out: they apply
    to almost every state (one instance per divisor / per iterator) and are used by
    hand-sequenced derivations only. Their one combination that matters for operators is
    included as `WindowSplitting`: relax and split the window iterators of a sliding-window
    sum by a factor k and sum the k-window operator in a scope (conv 5×5 → conv 3×3 with 4×
    the channels + OffsetReduce, EinNet Fig. 6); it is proposed only for levels that have
    window iterators, once per factor below the longest window. Expression splitting is left
    out too (a split level is two operators where there was one).
    """
    from .registry import default_rules as registered  # pylint: disable=import-outside-toplevel

    return registered()


def level_distance(op: str) -> Distance:
    """Expression distance of a whole expression to operator `op`, summed over its
    compute-bound levels (the ones instantiation must map to a predefined operator;
    memory-bound levels become eOperators): 0 for a level that `mapping_table` matches to
    `op`, else its mismatch count (`mapping_table.expression_distance`, at least 1). None
    for an expression with no compute-bound level: it is all eOperators, not `op`."""
    from .mapping_table import MATCHERS, expression_distance
    from .op_cost import is_memory_bound, levels

    matcher = MATCHERS.get(op)

    @lru_cache(maxsize=65536)
    def level(expr: Expr) -> int:
        if matcher is not None and next(iter(matcher(expr)), None) is not None:
            return 0  # several iterators of a group flatten into one dimension
        return max(1, expression_distance(expr, op))

    @lru_cache(maxsize=65536)
    def distance(expr: Expr) -> Optional[float]:
        heavy = [e for e in levels(expr) if not is_memory_bound(e)]
        if not heavy:
            return None  # only eOperators: nothing left to become `op`
        return float(sum(level(e) for e in heavy))

    return distance


def default_targets() -> Dict[str, Distance]:
    """Converging targets: the operators of the iterator-mapping table that instantiation can
    match (`mapping_table.MATCHERS`)."""
    from .mapping_table import MATCHERS

    return {op: level_distance(op) for op in sorted(MATCHERS)}


__all__ = ["Budget", "State", "Proposal", "proposals", "TargetMatch", "SearchStats", "SearchResult",
           "explore", "converge",
           "distance_guided_search", "default_rules", "default_targets",
           "level_distance"]
