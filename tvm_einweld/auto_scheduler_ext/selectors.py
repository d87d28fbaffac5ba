"""Strategy selectors: which layout strategy a tuning round trains on (``Select_Strategy``).

A selector is a small frozen object with
``select(round_index, total_rounds, cost_model, history) -> Strategy``. It keeps no state of
its own: everything it needs is in ``history`` (one ``RoundOutcome`` per finished round), so a
resumed run, or two tasks sharing one selector, behave the same as a fresh one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from .strategies import Strategy


@dataclass(frozen=True)
class RoundOutcome:
    """What one tuning round did and measured."""

    round_index: int
    strategy: Strategy
    trials: int
    round_best_secs: Optional[float]  # fastest deployable program measured this round
    best_so_far_secs: Optional[float]  # fastest deployable program after this round
    failures: int  # measurements that failed to build or run
    measurements: int = 0  # programs built and run (adaptive rounds also measure P)
    wall_secs: float = 0.0  # the round's time: search, measurements, model update

    def to_json(self) -> dict:
        return dict(round_index=self.round_index, strategy=self.strategy.value,
                    trials=self.trials, round_best_secs=self.round_best_secs,
                    best_so_far_secs=self.best_so_far_secs, failures=self.failures,
                    measurements=self.measurements, wall_secs=self.wall_secs)

    @staticmethod
    def from_json(data: dict) -> "RoundOutcome":
        return RoundOutcome(**dict(data, strategy=Strategy(data["strategy"])))


class StrategySelector(Protocol):
    name: str

    def select(
        self,
        round_index: int,
        total_rounds: int,
        cost_model: object,
        history: Sequence[RoundOutcome],
    ) -> Strategy: ...


@dataclass(frozen=True)
class FixedStrategy:
    """Always the same strategy: plain MetaSchedule/Ansor with one layout strategy."""

    strategy: Strategy

    @property
    def name(self) -> str:
        return self.strategy.value

    def select(self, round_index, total_rounds, cost_model, history) -> Strategy:
        return self.strategy


@dataclass(frozen=True)
class PredefinedRule:
    """The paper's rule: NL, then LR, then LC, with round shares 5:5:6.

    NL and LR first train the model on programs whose search and optimisation spaces agree
    (or nearly), narrowing the search; LC then fine-tunes it for the deployed P programs.
    """

    order: tuple = (Strategy.NL, Strategy.LR, Strategy.LC)
    shares: tuple = (5, 5, 6)
    name: str = "predefined"

    def __post_init__(self) -> None:
        if len(self.order) != len(self.shares) or not self.order:
            raise ValueError("PredefinedRule needs one share per strategy")
        if any(s <= 0 for s in self.shares):
            raise ValueError("PredefinedRule shares must be positive")

    def select(self, round_index, total_rounds, cost_model, history) -> Strategy:
        total = sum(self.shares)
        cumulative = 0
        for strategy, share in zip(self.order, self.shares):
            cumulative += share
            if round_index < round(total_rounds * cumulative / total):
                return strategy
        return self.order[-1]


def round_reward(outcome: RoundOutcome, best_before: Optional[float]) -> float:
    """Reward of a round in [0, 1]: 1 when it found a new best deployable program, otherwise
    how close its fastest program came to the best known before it (0 if nothing ran)."""
    if outcome.round_best_secs is None:
        return 0.0
    if best_before is None:
        return 1.0
    return min(1.0, best_before / outcome.round_best_secs)


@dataclass(frozen=True)
class BanditSelector:
    """UCB1 over the three strategies, rewarded by the measured results of their rounds.

    Each strategy is tried once (in the paper's NL, LR, LC order); after that the round goes to
    the strategy with the highest mean reward plus an exploration bonus. Every round measures
    the deployable programs, so rewards of different strategies are comparable.
    """

    strategies: tuple = (Strategy.NL, Strategy.LR, Strategy.LC)
    exploration: float = 0.5
    name: str = "bandit"

    def select(self, round_index, total_rounds, cost_model, history) -> Strategy:
        rewards: dict = {s: [] for s in self.strategies}
        best_before: Optional[float] = None
        for outcome in history:
            if outcome.strategy in rewards:
                rewards[outcome.strategy].append(round_reward(outcome, best_before))
            if outcome.best_so_far_secs is not None:
                best_before = outcome.best_so_far_secs
        for strategy in self.strategies:
            if not rewards[strategy]:
                return strategy
        plays = sum(len(r) for r in rewards.values())

        def ucb(strategy: Strategy) -> float:
            r = rewards[strategy]
            return sum(r) / len(r) + self.exploration * math.sqrt(2 * math.log(plays) / len(r))

        return max(self.strategies, key=ucb)  # ties go to the earlier strategy


@dataclass(frozen=True)
class LeaderRule:
    """Try each strategy once, follow the one that found the best program, end on LC.

    Our rule, from what the 5:5:6 rule does on MetaSchedule. Every round of an adaptive run
    measures the deployable P of its candidates, so each strategy's rounds can be judged by
    the one thing that is deployed; the 5:5:6 rule ignores that and spends 10 of 16 rounds
    searching for fast A or L+P programs whether or not those are the ones whose P is fast
    (at 256 trials, LC alone was the best single strategy on 3 of 4 ResNet-50 blocks and
    NL on the fourth). Here:

    1. warm-up: the first `len(order)` rounds go to NL, LR, LC in turn (the paper's order),
       so that the one cost model sees programs of every form;
    2. the middle rounds go to the *leader*: the strategy of the round that found the best
       deployable program so far (LC if no round has measured one yet, e.g. just after a
       resume, whose history is empty);
    3. the last `tail` of the rounds are LC, the paper's reason for ending on it: the model
       is fine-tuned on the deployed programs themselves.

    Stateless like the others: the leader is read from `history`.
    """

    order: tuple = (Strategy.NL, Strategy.LR, Strategy.LC)
    tail: float = 1 / 3
    name: str = "leader"

    def __post_init__(self) -> None:
        if not self.order or not 0.0 <= self.tail <= 1.0:
            raise ValueError("LeaderRule needs strategies and a tail share in [0, 1]")

    def select(self, round_index, total_rounds, cost_model, history) -> Strategy:
        if round_index >= total_rounds - round(total_rounds * self.tail):
            return Strategy.LC
        if round_index < len(self.order):
            return self.order[round_index]
        return leader(history) or Strategy.LC


def leader(history: Sequence[RoundOutcome]) -> Optional[Strategy]:
    """The strategy of the last round that improved the best deployable program (None if no
    round has measured one)."""
    best, found = None, None
    for outcome in history:
        if outcome.round_best_secs is not None and (best is None or outcome.round_best_secs < best):
            best, found = outcome.round_best_secs, outcome.strategy
    return found


@dataclass(frozen=True)
class StallRule:
    """The paper's phases (NL, then LR, then LC, each contiguous), each early phase left as
    soon as it stops finding faster deployable programs.

    A phase before the last lasts at most its 5:5:6 share of the rounds, as in
    `PredefinedRule`, and at least `min_rounds`; it ends early once its last `patience`
    rounds found no deployable program faster than the best before them (it stalled), and
    the rounds it leaves go to LC. Why: the phases keep the search in one strategy for whole
    stretches (the bandit, which switches nearly every round, ended 42 % behind the best
    single strategy on the first ResNet-50 block at 512 trials; 5:5:6 matched the best), and
    the early exit gives LC, the best single strategy on three of four blocks at 256 trials,
    the rounds that NL or LR no longer use. Read from `history` alone; with none (a resumed
    run) it follows `PredefinedRule` by round index.
    """

    order: tuple = (Strategy.NL, Strategy.LR, Strategy.LC)
    shares: tuple = (5, 5, 6)
    patience: int = 2
    min_rounds: int = 2
    name: str = "stall"

    def select(self, round_index, total_rounds, cost_model, history) -> Strategy:
        rule = PredefinedRule(self.order, self.shares)
        if not history:
            return rule.select(round_index, total_rounds, cost_model, history)
        phase = self.order.index(history[-1].strategy) if history[-1].strategy in self.order else 0
        if phase == len(self.order) - 1:
            return self.order[phase]
        in_phase = 0
        while in_phase < len(history) and history[-1 - in_phase].strategy is self.order[phase]:
            in_phase += 1
        cap = round(total_rounds * self.shares[phase] / sum(self.shares))
        if in_phase >= max(cap, 1) or (in_phase >= self.min_rounds and self._stalled(history)):
            return self.order[phase + 1]
        return self.order[phase]

    def _stalled(self, history: Sequence[RoundOutcome]) -> bool:
        """No new best deployable program in the last `patience` rounds."""
        if len(history) <= self.patience:
            return False
        before = history[-1 - self.patience].best_so_far_secs
        return before is not None and all(
            o.round_best_secs is None or o.round_best_secs >= before
            for o in history[-self.patience:])


def make_selector(layout_strategy: str, selector: Optional[str | StrategySelector] = None):
    """The selector for ``layout_strategy`` ("adaptive", "NL", "LR", "LC"); for "adaptive",
    ``selector`` is "predefined" (default), "bandit", "leader", "stall" or a selector
    object."""
    if layout_strategy.lower() != "adaptive":
        if selector is not None:
            raise ValueError("a selector only applies to layout_strategy='adaptive'")
        return FixedStrategy(Strategy.parse(layout_strategy))
    if selector is None or selector == "predefined":
        return PredefinedRule()
    if selector == "bandit":
        return BanditSelector()
    if selector == "leader":
        return LeaderRule()
    if selector == "stall":
        return StallRule()
    if isinstance(selector, str):
        raise ValueError(f"unknown selector {selector!r}; expected 'predefined', 'bandit', "
                         f"'leader' or 'stall'")
    return selector
