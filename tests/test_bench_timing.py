"""The timing helper alternates runners, warms them up, and takes medians (fake clock)."""
from __future__ import annotations

import pytest

from tvm_einweld.bench.timing import Timing, calls_per_sample, time_alternating


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


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        time_alternating({"a": lambda: None}, repeats=0)
    with pytest.raises(ValueError):
        time_alternating({"a": lambda: None}, number={"a": 0})


def test_timing_spread() -> None:
    t = Timing("a", (1.0, 2.0, 3.0))
    assert t.median == 2.0 and t.spread == 1.0
