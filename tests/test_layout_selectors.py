"""Strategy selectors follow their rules."""
import pytest

from tvm_einweld.auto_scheduler_ext.selectors import (
    BanditSelector,
    FixedStrategy,
    LeaderRule,
    PredefinedRule,
    RoundOutcome,
    StallRule,
    leader,
    make_selector,
    round_reward,
)
from tvm_einweld.auto_scheduler_ext.strategies import Strategy

NL, LR, LC = Strategy.NL, Strategy.LR, Strategy.LC


@pytest.mark.parametrize("total", [3, 7, 16, 32, 64, 100])
def test_predefined_rule_order_and_shares(total):
    rule = PredefinedRule()
    picks = [rule.select(r, total, None, []) for r in range(total)]
    # NL, then LR, then LC, never going back
    order = [s for i, s in enumerate(picks) if i == 0 or picks[i - 1] is not s]
    assert order == [NL, LR, LC]
    for strategy, share in zip((NL, LR, LC), (5, 5, 6)):
        assert abs(picks.count(strategy) - total * share / 16) <= 1


def test_predefined_rule_ignores_history():
    rule = PredefinedRule()
    history = [RoundOutcome(0, LC, 4, 1.0, 1.0, 0)]
    assert [rule.select(r, 16, None, history) for r in (0, 5, 10)] == [NL, LR, LC]


def test_fixed_and_factory():
    assert all(FixedStrategy(LR).select(r, 5, None, []) is LR for r in range(5))
    assert make_selector("LC") == FixedStrategy(LC)
    assert make_selector("adaptive") == PredefinedRule()
    assert make_selector("adaptive", "bandit") == BanditSelector()
    with pytest.raises(ValueError):
        make_selector("XX")
    with pytest.raises(ValueError):
        make_selector("adaptive", "nope")
    with pytest.raises(ValueError):
        make_selector("NL", "bandit")


def outcome(i, strategy, round_best, best):
    return RoundOutcome(i, strategy, 4, round_best, best, 0)


def test_bandit_tries_each_then_exploits_the_rewarded_one():
    bandit = BanditSelector(exploration=0.1)
    history = []
    assert bandit.select(0, 30, None, history) is NL
    history.append(outcome(0, NL, 2.0, 2.0))
    assert bandit.select(1, 30, None, history) is LR
    history.append(outcome(1, LR, 4.0, 2.0))  # LR samples were twice as slow
    assert bandit.select(2, 30, None, history) is LC
    history.append(outcome(2, LC, 1.0, 1.0))  # LC found a new best
    history.append(outcome(3, NL, 3.0, 1.0))  # NL's next round fell well short of it
    assert bandit.select(4, 30, None, history) is LC
    # LC keeps failing to run anything: the bandit moves away from it.
    for i in range(4, 12):
        history.append(outcome(i, LC, None, 1.0))
    assert bandit.select(12, 30, None, history) is not LC


def test_round_reward():
    assert round_reward(outcome(0, NL, None, None), 1.0) == 0.0
    assert round_reward(outcome(0, NL, 2.0, 2.0), None) == 1.0
    assert round_reward(outcome(0, NL, 0.5, 0.5), 1.0) == 1.0
    assert round_reward(outcome(0, NL, 4.0, 1.0), 1.0) == 0.25


def test_leader_rule_warms_up_follows_the_leader_and_ends_on_lc():
    rule = LeaderRule()
    history = []
    picks = []
    # The round's best P per strategy: LR's rounds find the new bests in the middle.
    round_best = {NL: 3.0, LR: 1.0, LC: 2.0}
    best = None
    for r in range(16):
        strategy = rule.select(r, 16, None, history)
        picks.append(strategy)
        found = round_best[strategy] - 0.01 * r
        best = found if best is None else min(best, found)
        history.append(outcome(r, strategy, found, best))
    assert picks[:3] == [NL, LR, LC]
    assert all(p is LR for p in picks[3:11])  # LR found every best since round 1
    assert all(p is LC for p in picks[11:])  # the last third
    assert make_selector("adaptive", "leader") == LeaderRule()


def test_leader_rule_reads_the_leader_from_history_alone():
    rule = LeaderRule()
    history = [outcome(0, NL, 2.0, 2.0), outcome(1, LR, None, 2.0), outcome(2, LC, 2.5, 2.0),
               outcome(3, NL, 1.5, 1.5), outcome(4, LC, 1.6, 1.5)]
    assert leader(history) is NL
    assert rule.select(5, 16, None, history) is NL
    # A resumed run has no history: LC until a round has measured something.
    assert leader([]) is None and rule.select(5, 16, None, []) is LC
    # Short runs: the tail still ends on LC.
    assert [rule.select(r, 3, None, []) for r in range(3)] == [NL, LR, LC]
    with pytest.raises(ValueError):
        LeaderRule(tail=1.5)


def _play(rule, total, improves):
    """Run `rule` for `total` rounds; `improves(strategy, i)`: whether round i finds a new
    best. Returns the strategies picked."""
    history, picks, best = [], [], 10.0
    for r in range(total):
        strategy = rule.select(r, total, None, history)
        picks.append(strategy)
        found = best * 0.9 if improves(strategy, r) else best * 1.1
        best = min(best, found)
        history.append(outcome(r, strategy, found, best))
    return picks


def test_stall_rule_keeps_the_paper_shares_while_every_phase_improves():
    picks = _play(StallRule(), 16, lambda s, r: True)
    assert picks == _play(PredefinedRule(), 16, lambda s, r: True)
    assert picks == [NL] * 5 + [LR] * 5 + [LC] * 6


def test_stall_rule_leaves_a_stalled_phase_early():
    # Nothing improves after the first round: NL stops after two rounds without a new best,
    # LR after its minimum of two, LC gets the rest.
    picks = _play(StallRule(), 16, lambda s, r: r == 0)
    assert picks == [NL] * 3 + [LR] * 2 + [LC] * 11
    # NL keeps improving, LR never does: NL its full share, LR its minimum.
    picks = _play(StallRule(), 16, lambda s, r: s is NL)
    assert picks == [NL] * 5 + [LR] * 2 + [LC] * 9
    # No history (a resumed run): the paper's rule by round index.
    assert [StallRule().select(r, 16, None, []) for r in (0, 5, 10)] == [NL, LR, LC]
    assert make_selector("adaptive", "stall") == StallRule()
