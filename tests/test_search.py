"""Derivation search: determinism, fingerprint pruning, budgets, finding known targets."""
from __future__ import annotations

from typing import Iterable

import pytest

from tvm_einweld.expr import Tensor
from tvm_einweld.expr import canonical as C
from tvm_einweld.expr.expression import Expr
from tvm_einweld.expr.fingerprint import fingerprint, structurally_equal
from tvm_einweld.relay_passes.derivation import LevelRewrite, Rule
from tvm_einweld.relay_passes.search import (
    Budget, converge, distance_guided_search, explore, State,
)
from tvm_einweld.relay_passes.summation_splitting import SummationSplitting, split_summation
from tvm_einweld.relay_passes.traversal_merging import TraversalMerging
from tvm_einweld.verify import compare_expressions


def conv(c: int = 8, f: int = 8, hw: int = 6, k: int = 3) -> Expr:
    a, w = Tensor("A", (1, c, hw, hw)), Tensor("K", (f, c, k, k))
    return C.conv2d(a, w, padding=(k // 2,) * 4)


RULES = [SummationSplitting(), TraversalMerging()]


def test_deterministic_for_a_seed():
    e = conv()
    runs = [explore(e, RULES, Budget(max_depth=3, seed=7)) for _ in range(2)]
    prints = [[fingerprint(s.expr) for s in r.states] for r in runs]
    assert prints[0] == prints[1]
    assert [s.rules for s in runs[0].states] == [s.rules for s in runs[1].states]
    # Another seed visits the same set when the space is exhausted, maybe in another order.
    other = explore(e, RULES, Budget(max_depth=3, seed=8))
    assert sorted(prints[0]) == sorted(fingerprint(s.expr) for s in other.states)


def test_repeated_states_are_pruned_and_counted():
    e = conv()
    result = explore(e, RULES, Budget(max_depth=3))
    stats = result.stats
    # Splitting then inlining the split-off scope gives the start again, so some successors
    # must be repeats; every kept state is distinct from every other.
    assert stats.pruned > 0
    assert stats.states == len(result.states)
    assert 0 < stats.pruned_fraction < 1
    for i, a in enumerate(result.states):
        for b in result.states[i + 1:]:
            assert not structurally_equal(a.expr, b.expr)
    assert stats.stopped_by == "exhausted"


def test_every_state_equals_the_start():
    e = conv(c=4, f=4, hw=5)
    result = explore(e, RULES, Budget(max_depth=2))
    assert len(result.states) > 3
    for s in result.states:
        assert compare_expressions(e, s.expr, trials=1).equal, s.rules


def test_budgets_are_respected():
    e = conv()
    few = explore(e, RULES, Budget(max_depth=7, max_states=5))
    assert few.stats.states <= 5 and few.stats.stopped_by == "max_states"
    shallow = explore(e, RULES, Budget(max_depth=1))
    assert max(s.depth for s in shallow.states) == 1
    assert all(s.depth <= 1 for s in shallow.states)
    quick = explore(e, RULES, Budget(max_depth=7, max_states=10**6, time_limit_s=0.05))
    assert quick.stats.stopped_by in ("time_limit", "exhausted")
    assert quick.stats.seconds < 5  # the limit is checked between expansions
    dfs = explore(e, RULES, Budget(max_depth=3, strategy="dfs"))
    bfs = explore(e, RULES, Budget(max_depth=3))
    assert sorted(fingerprint(s.expr) for s in dfs.states) == \
        sorted(fingerprint(s.expr) for s in bfs.states)


def test_finds_a_known_target():
    e = conv()
    # Σ_{r,s} { Σ_c A·K } : the channel reduction materialised first (a matmul-like scope).
    target = split_summation(e, frozenset({"c"})).result
    hits = []
    result = explore(e, RULES, Budget(max_depth=2),
                     on_state=lambda s: structurally_equal(s.expr, target) and not hits.append(s))
    assert hits, "the search did not reach the known target"
    assert hits[0].rules == ("summation_splitting",)
    assert result.stats.stopped_by == "goal"


def test_best_per_depth_uses_rank():
    e = conv()
    rank = lambda x: -_scope_count(x)  # prefer deeper nesting
    result = explore(e, RULES, Budget(max_depth=2), rank=rank)
    assert len(result.best_per_depth) == 3
    assert result.best_per_depth[0].depth == 0
    for d, best in enumerate(result.best_per_depth):
        same_depth = [s for s in result.states if s.depth == d]
        assert rank(best.expr) == min(rank(s.expr) for s in same_depth)


def _scope_count(e: Expr) -> int:
    from tvm_einweld.expr.expression import scopes

    return len(list(scopes(e)))


def test_converging_follows_only_decreasing_distance():
    e = conv()
    # Distance: summation iterators left at the top level beyond one.
    distance = lambda x: len(x.sums) - 1
    found, created = converge(State(e), RULES, distance, Budget(max_depth=3))
    assert found is not None and distance(found.expr) == 0
    assert found.depth == 1 and created >= 1
    assert compare_expressions(e, found.expr, trials=1).equal


def test_distance_guided_search_reports_matches():
    e = conv()
    targets = {"one_sum": lambda x: len(x.sums) - 1,
               "never": lambda x: None}
    result = distance_guided_search(e, RULES, targets, Budget(max_depth=1))
    assert {m.target for m in result.matches} == {"one_sum"}
    for m in result.matches:
        assert len(m.state.expr.sums) == 1
    assert result.stats.states >= len(result.states) - len(result.matches)


class _Broken(Rule):
    name = "broken"

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        raise RuntimeError("planted fault")


def test_a_raising_rule_is_reported_not_fatal():
    result = explore(conv(), [_Broken()] + RULES, Budget(max_depth=1))
    assert len(result.states) > 1
    assert result.stats.rule_errors and "planted fault" in result.stats.rule_errors[0]


def test_invalid_budget():
    with pytest.raises(ValueError):
        Budget(strategy="random")
    with pytest.raises(ValueError):
        Budget(max_states=0)


def test_a_slow_rule_is_stopped_at_the_time_limit():
    """A rule's proposal step that runs long (as fitting an inverse over a large modulus can)
    is interrupted at the search's deadline, not only between states."""
    import time

    from tvm_einweld.relay_passes.deadline import DeadlineExceeded, check_deadline

    interrupted = []

    class Slow(Rule):
        name = "slow"

        def candidates(self, expr, is_top):
            give_up = time.perf_counter() + 60
            try:
                while time.perf_counter() < give_up:
                    check_deadline()
            except DeadlineExceeded:
                interrupted.append(True)
                raise
            return []

    result = explore(conv(), [Slow()], Budget(max_depth=3, time_limit_s=0.2))
    assert interrupted and result.stats.stopped_by == "time_limit"
    assert not result.stats.rule_errors
