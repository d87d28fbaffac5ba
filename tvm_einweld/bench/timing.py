"""Side-by-side timing: runners called in alternation, median of repetitions.

Alternating (A B C A B C ...) instead of timing each runner in a block makes slow drifts of
the machine (frequency, other processes, thermal state) hit every runner alike; the median
discards the occasional interrupted sample.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one runner: every sample, and their median / minimum."""

    name: str
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def minimum(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the samples were."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def time_alternating(calls: Mapping[str, Callable[[], object]], repeats: int = 7,
                     warmup: int = 1, number: int | Mapping[str, int] = 1,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Time each zero-argument call `repeats` times, round-robin across the calls.

    Every call first runs `warmup` times (also round-robin, untimed). A sample is the mean of
    `number` back-to-back calls (one count for all, or one per call name), so very short
    calls can be lengthened past timer resolution.
    """
    counts = {name: number if isinstance(number, int) else number[name] for name in calls}
    if repeats < 1 or warmup < 0 or min(counts.values(), default=1) < 1:
        raise ValueError("repeats and number must be >= 1 and warmup >= 0")
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = clock()
            for _ in range(counts[name]):
                fn()
            samples[name].append((clock() - start) / counts[name])
    return {name: Timing(name, tuple(s)) for name, s in samples.items()}


def calls_per_sample(call: Callable[[], object], target_seconds: float = 0.05,
                     clock: Callable[[], float] = time.perf_counter) -> int:
    """How many back-to-back calls make one sample last about `target_seconds`."""
    start = clock()
    call()
    once = clock() - start
    return max(1, min(1000, int(target_seconds / once))) if once > 0 else 1000
