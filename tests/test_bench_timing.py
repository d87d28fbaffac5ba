"""The timing helper alternates runners, warms them up, and takes medians (fake clock); rounds
timed in the machine's slow phase are timed again (planted round trips)."""
from __future__ import annotations

import pytest

from tvm_einweld import machine
from tvm_einweld.bench.timing import (
    Timing, alternate_rounds, calls_per_sample, time_alternating, time_in_fast_phase,
)


class FakeClock:
    """Advances only when a fake runner 'works', by the duration that runner planted."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_runner(name: str, log: list[str], clock: FakeClock, durations: list[float]):
    def call() -> None:
        log.append(name)
        clock.now += durations[(len([x for x in log if x == name]) - 1) % len(durations)]
    return call


def test_round_robin_order_and_call_counts() -> None:
    log: list[str] = []
    clock = FakeClock()
    calls = {n: make_runner(n, log, clock, [1.0]) for n in "ABC"}
    timings = time_alternating(calls, repeats=4, warmup=2, clock=clock)
    assert log == list("ABC") * (2 + 4)  # warm-up rounds, then timed rounds, interleaved
    assert {n: len(t.samples) for n, t in timings.items()} == {"A": 4, "B": 4, "C": 4}


def test_median_of_samples_not_mean() -> None:
    log: list[str] = []
    clock = FakeClock()
    # A's third timed call is an outlier (interrupted); the median must ignore it.
    calls = {"A": make_runner("A", log, clock, [0.0, 2.0, 2.0, 50.0, 3.0, 1.0]),
             "B": make_runner("B", log, clock, [5.0])}
    timings = time_alternating(calls, repeats=5, warmup=1, clock=clock)
    assert timings["A"].samples == (2.0, 2.0, 50.0, 3.0, 1.0)
    assert timings["A"].median == 2.0 and timings["A"].minimum == 1.0
    assert timings["B"].median == 5.0


def test_number_per_runner_averages_back_to_back_calls() -> None:
    log: list[str] = []
    clock = FakeClock()
    calls = {"fast": make_runner("fast", log, clock, [1.0, 3.0]),
             "slow": make_runner("slow", log, clock, [10.0])}
    timings = time_alternating(calls, repeats=2, warmup=0, number={"fast": 2, "slow": 1},
                               clock=clock)
    assert log == ["fast", "fast", "slow"] * 2
    assert timings["fast"].samples == (2.0, 2.0)
    assert timings["slow"].samples == (10.0, 10.0)


def test_calls_per_sample_scales_to_target() -> None:
    clock = FakeClock()
    calls = {"x": make_runner("x", [], clock, [0.001])}
    assert calls_per_sample(calls["x"], 0.05, clock=clock) == 50
    slow = make_runner("y", [], clock, [1.0])
    assert calls_per_sample(slow, 0.05, clock=clock) == 1


def test_a_slow_first_call_does_not_shorten_the_rounds() -> None:
    """The call after a pause is slow (cold caches, sleeping threads): 7 ms, then 1 ms."""
    clock = FakeClock()
    cold = make_runner("x", [], clock, [0.007] + [0.001] * 999)
    assert calls_per_sample(cold, 0.25, clock=clock) == 250


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        time_alternating({"a": lambda: None}, repeats=0)
    with pytest.raises(ValueError):
        time_alternating({"a": lambda: None}, number={"a": 0})


def test_timing_spread() -> None:
    t = Timing("a", (1.0, 2.0, 3.0))
    assert t.median == 2.0 and t.spread == 1.0


# ---- alternate_rounds: the loop the worker processes are timed with ----------------------------
def test_a_round_is_the_median_of_its_calls() -> None:
    """A sampler returns every call's seconds; the round keeps their median, so one slow
    call (a pool waking up after the other runners' rounds) does not move it."""
    rounds = iter([[9.0, 1.0, 1.1], [1.2, 1.0, 8.0]])
    timings = alternate_rounds({"a": lambda n: next(rounds)}, repeats=2, warmup=0, number=3)
    assert timings["a"].samples == (1.1, 1.2) and timings["a"].calls_per_round == 3


def test_rounds_alternate_and_a_failing_sampler_is_dropped() -> None:
    order: list[tuple[str, int]] = []
    errors: dict[str, Exception] = {}

    def sampler(name: str, fail_on: int = 0):
        def sample(n: int) -> list[float]:
            order.append((name, n))
            if fail_on and len([o for o in order if o[0] == name]) == fail_on:
                raise RuntimeError(f"{name} broke")
            return [1.0] * n
        return sample

    timings = alternate_rounds({"a": sampler("a"), "b": sampler("b", fail_on=3),
                                "c": sampler("c")}, repeats=3, warmup=1,
                               number={"a": 2, "b": 1, "c": 5}, on_error=errors.__setitem__)
    # warm-up round (one call each), then rounds of each runner's count, a b c a b c ...
    assert order == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 1), ("c", 5),
                     ("a", 2), ("b", 1), ("c", 5), ("a", 2), ("c", 5)]
    assert set(timings) == {"a", "c"} and str(errors["b"]) == "b broke"
    with pytest.raises(RuntimeError, match="b broke"):  # without on_error it propagates
        order.clear()
        alternate_rounds({"b": sampler("b", fail_on=1)})


def _phase(trips: list, fast_after_wait: bool = True, retries: int = 1, gone: bool = False):
    """time_in_fast_phase over planted round trips (ns, in measuring order), with the fast
    phase reached by 50 ns (`gone`: a wait ran out and it has not shown since); returns
    (result, attempts made, waits)."""
    attempts, waits = [], []
    planted = iter(trips)
    result = time_in_fast_phase(
        lambda: attempts.append(len(attempts)) or len(attempts), log=lambda text: None,
        retries=retries, measure=lambda: next(planted),
        slow=lambda *t: any(x is not None and x > 100 for x in t),
        await_fast=lambda timeout: waits.append(timeout) or (50.0 if fast_after_wait else None),
        gone=lambda: gone)
    return result, len(attempts), len(waits)


def test_no_wait_while_the_fast_phase_stays_away() -> None:
    result, attempts, waits = _phase([400.0, 380.0], gone=True)
    assert (attempts, waits, result.value, result.slow_attempts) == (1, 0, 1, ())


def test_waits_stop_after_one_runs_out_until_the_fast_phase_shows(monkeypatch) -> None:
    """One fast reading (22 ns) sets the floor; a wait runs out; later slow readings wait
    no more, until one near the floor shows again."""
    monkeypatch.setattr(machine, "_ROUND_TRIPS", [22.0, 130.0])
    monkeypatch.setattr(machine, "_WAITED_IN_VAIN", [])
    assert not machine.fast_phase_gone()  # no wait ran out yet
    machine._WAITED_IN_VAIN.append(len(machine._ROUND_TRIPS))
    machine._ROUND_TRIPS.extend([125.0, 131.0])
    assert machine.fast_phase_gone()
    machine._ROUND_TRIPS.append(30.0)
    assert not machine.fast_phase_gone()


def test_fast_rounds_are_kept() -> None:
    result, attempts, waits = _phase([50.0, 60.0])
    assert (result.value, result.round_trips, result.slow_attempts) == (1, (50.0, 60.0), ())
    assert (attempts, waits) == (1, 0)


def test_slow_rounds_are_timed_again_and_recorded() -> None:
    result, attempts, waits = _phase([50.0, 400.0, 45.0, 55.0])
    assert (attempts, waits) == (2, 1)
    assert result.value == 2 and result.round_trips == (45.0, 55.0)
    assert result.slow_attempts == ((50.0, 400.0),)


def test_slow_rounds_kept_when_the_fast_phase_does_not_return() -> None:
    result, attempts, waits = _phase([400.0, 380.0], fast_after_wait=False)
    assert (attempts, waits, result.value) == (1, 1, 1)
    assert result.round_trips == (400.0, 380.0) and result.slow_attempts == ()


def test_retries_are_bounded() -> None:
    result, attempts, _ = _phase([400.0] * 8, retries=2)
    assert attempts == 3 and len(result.slow_attempts) == 2


def test_slow_phase_is_judged_against_the_fastest_measured(monkeypatch) -> None:
    monkeypatch.setattr(machine, "_ROUND_TRIPS", [48.0, 300.0])
    assert machine.fastest_round_trip_ns() == 48.0
    assert machine.in_slow_phase(None, 97.0) and not machine.in_slow_phase(90.0, None)
    monkeypatch.setattr(machine, "_ROUND_TRIPS", [])
    assert not machine.in_slow_phase(1e6)  # nothing measured yet: no phase known
