"""Side-by-side timing: rounds that alternate across runners, medians of medians.

This is the one implementation of the measurement loop; the harness uses it for runners in
worker processes (`isolation`), and any benchmark can use it for calls in its own process.

- Alternating rounds (A B C A B C ...) instead of timing each runner in a block make slow
  drifts of the machine (frequency, other processes, thermal state) hit every runner alike.
- A round is a few back-to-back calls of one runner, each timed on its own; the round's value
  is their median, which discards the occasional interrupted call (and the first call after
  the runner sat idle while the others ran).
- A runner's latency is the median of its round values; their spread (max - min) / median
  says how far the rounds agreed.

The machine's own noise is timed alongside (`reference_work`, in the parent process, in the
same rotation): a fixed single-threaded loop whose time changes only when the machine gives
the process less CPU. On a shared VM its round medians can differ by tens of percent (up to
92 % in a zoo row) while most agree within a few, and a runner's spread over the target next
to a reference spread over it is the machine's, not the runtime's.

The machine's phase is timed around the rounds too (`time_in_fast_phase`): the core-to-core
round trip, which on this project's VMs jumps from ~50 to ~400 ns for minutes while the host
places the two virtual CPUs apart, and every fork/join of a thread pool pays it. Rounds taken
then are timed again once the fast phase is back, and the discarded attempt is recorded.

A runner is given as a `Sampler`: `sampler(n)` makes n timed calls and returns the seconds of
each. `local_sampler(fn)` makes one from a zero-argument call in this process; a worker
process runs the same `local_sampler` on its side and answers over a pipe.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, Optional, Sequence, TypeVar

from .. import machine

Sampler = Callable[[int], Sequence[float]]  # n -> seconds of each of n timed calls
T = TypeVar("T")
RoundTrips = tuple[Optional[float], Optional[float]]  # ns, before and after some rounds


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one runner: one value per round (the median of its calls)."""

    name: str
    samples: tuple[float, ...]
    calls_per_round: int = 1

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def minimum(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median of the round values: how far the rounds agreed."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def local_sampler(call: Callable[[], object],
                  clock: Callable[[], float] = time.perf_counter) -> Sampler:
    """A sampler that times `call` in this process, call by call."""

    def sample(n: int) -> list[float]:
        seconds = []
        for _ in range(n):
            start = clock()
            call()
            seconds.append(clock() - start)
        return seconds

    return sample


def reference_work(iterations: int = 20_000) -> int:
    """A fixed computation for the machine's noise (about 1 ms): pure Python, one thread, no
    memory traffic beyond the first-level cache, so nothing but the CPU it gets can change its
    time (no thread pool, no library, no frequency-sensitive memory system)."""
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def alternate_rounds(samplers: Mapping[str, Sampler], repeats: int = 7, warmup: int = 1,
                     number: int | Mapping[str, int] = 1,
                     on_error: Optional[Callable[[str, Exception], None]] = None,
                     ) -> dict[str, Timing]:
    """Time every sampler in `repeats` rounds, round-robin, after `warmup` untimed rounds of
    one call each. A round of a runner is `number` calls (one count for all, or one per name).

    A sampler that raises is dropped from the rotation and reported to `on_error` (without
    one, the error propagates); the others go on, and it gets no Timing.
    """
    counts = {name: number if isinstance(number, int) else number[name] for name in samplers}
    if repeats < 1 or warmup < 0 or min(counts.values(), default=1) < 1:
        raise ValueError("repeats and number must be >= 1 and warmup >= 0")
    active = dict(samplers)
    rounds: dict[str, list[float]] = {name: [] for name in samplers}

    def one_round(calls_of: Callable[[str], int], keep: bool) -> None:
        for name, sampler in list(active.items()):
            try:
                seconds = sampler(calls_of(name))
            except Exception as err:
                if on_error is None:
                    raise
                del active[name]
                on_error(name, err)
                continue
            if keep:
                rounds[name].append(statistics.median(seconds))

    for _ in range(warmup):
        one_round(lambda name: 1, keep=False)
    for _ in range(repeats):
        one_round(counts.__getitem__, keep=True)
    return {name: Timing(name, tuple(rounds[name]), counts[name]) for name in active}


def time_alternating(calls: Mapping[str, Callable[[], object]], repeats: int = 7,
                     warmup: int = 1, number: int | Mapping[str, int] = 1,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """`alternate_rounds` for zero-argument calls made in this process."""
    return alternate_rounds({name: local_sampler(fn, clock) for name, fn in calls.items()},
                            repeats, warmup, number)


def median_seconds(calls: Sequence[Callable[[], object]], rounds: int) -> list[float]:
    """Median seconds per call of each function, in alternating rounds of about 50 ms each:
    `time_alternating` for a benchmark that only needs the numbers, in order."""
    named = {str(k): call for k, call in enumerate(calls)}
    timings = time_alternating(named, repeats=rounds,
                               number={k: calls_per_sample(c) for k, c in named.items()})
    return [timings[k].median for k in named]


def calls_per_sample(call: Callable[[], object], target_seconds: float = 0.05,
                     clock: Callable[[], float] = time.perf_counter) -> int:
    """How many back-to-back calls make one round last about `target_seconds`.

    The per-call time is the median of the calls after the first, made until a fifth of the
    target has passed (at least two): the first call after a pause (cold caches, a thread
    pool asleep) read up to 7x slow in the zoo (InfoGAN's onnxruntime: 20 calls a round, not
    the ~140 of a quarter second), which made rounds short and their spread wide. A first
    call as long as the target already decides one call a round."""
    start = clock()
    call()
    first = clock() - start
    if first >= target_seconds:
        return 1
    spent, rest = first, []
    while len(rest) < 2 or (spent < target_seconds / 5 and len(rest) < 1000):
        start = clock()
        call()
        rest.append(clock() - start)
        spent += rest[-1]
    once = statistics.median(rest)
    return max(1, min(1000, round(target_seconds / once))) if once > 0 else 1000


@dataclass(frozen=True)
class PhaseTimed(Generic[T]):
    """What `time_in_fast_phase` timed: the kept attempt's value, the round trips (ns) around
    it, and those around each attempt discarded because the machine was in its slow phase."""

    value: T
    round_trips: RoundTrips
    slow_attempts: tuple[RoundTrips, ...] = ()


# How long a benchmark waits for the VM's fast phase before keeping a slow attempt (the
# default of `time_in_fast_phase`; the test suite sets 0: tests assert no timings).
FAST_PHASE_WAIT_SECONDS = 120.0


def time_in_fast_phase(time_once: Callable[[], T], log: Callable[[str], None] = print,
                       retries: int = 1, wait_seconds: Optional[float] = None,
                       measure: Callable[[], Optional[float]] = machine.measure_round_trip_ns,
                       slow: Callable[..., bool] = machine.in_slow_phase,
                       await_fast: Callable[[float], Optional[float]] = machine.await_fast_phase,
                       gone: Callable[[], bool] = machine.fast_phase_gone
                       ) -> PhaseTimed[T]:
    """Call `time_once` (some timed rounds, with every other process quiet) between two
    round-trip measurements; where either reads slow (`machine.in_slow_phase`: over twice the
    fastest this process has seen), wait up to `wait_seconds` for the fast phase and time
    again, at most `retries` times. The last attempt is kept; when the fast phase does not
    come back in time, the slow attempt is kept (a report flags its row), and while it stays
    away (`gone`: no round trip near the fastest since that wait ran out) later rows keep
    their slow attempt without waiting. `measure`, `slow`, `await_fast` and `gone` are the
    machine's (tests plant others); `wait_seconds` defaults to `FAST_PHASE_WAIT_SECONDS`."""
    if wait_seconds is None:
        wait_seconds = FAST_PHASE_WAIT_SECONDS
    discarded: list[RoundTrips] = []
    while True:
        before = measure()
        value = time_once()
        trips = (before, measure())
        if len(discarded) >= retries or not slow(*trips):
            return PhaseTimed(value, trips, tuple(discarded))
        read = " -> ".join(f"{t:.0f}" if t else "?" for t in trips)
        if gone():
            log(f"  round trip {read} ns: the fast phase has not come back since the last "
                f"wait; keeping these rounds (flagged)")
            return PhaseTimed(value, trips, tuple(discarded))
        log(f"  round trip {read} ns, over twice the fastest: waiting for the cores to come "
            f"together, then timing again")
        if await_fast(wait_seconds) is None:
            log("  the fast phase did not come back: keeping these rounds (flagged)")
            return PhaseTimed(value, trips, tuple(discarded))
        discarded.append(trips)
