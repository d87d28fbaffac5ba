"""Benchmark one model with several runners: prepare, check against onnxruntime, then time.

A runner that cannot be prepared, crashes, or disagrees with the onnxruntime reference is
reported as such and left out of the timing: a fast wrong answer is never a result. Where
such a runner names a stand-in (stock tuned TVM without weight pre-packing for the pre-packing
one), the stand-in is measured in its place and the report says so.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import onnx

from ..models import random_inputs
from .check import compare_outputs
from .roofline import GraphCost, graph_cost
from .runners import RUNNERS, RunFn, Runner, reference_outputs
from .timing import Timing, calls_per_sample, time_alternating

OK, WRONG, FAILED, SKIPPED = "ok", "wrong", "failed", "skipped"


@dataclass(frozen=True)
class RunnerResult:
    runner: str
    status: str  # OK, WRONG, FAILED or SKIPPED
    detail: str  # agreement with the reference, the error, or why skipped
    prepare_seconds: Optional[float] = None
    timing: Optional[Timing] = None

    @property
    def latency(self) -> Optional[float]:
        return self.timing.median if self.timing else None


@dataclass(frozen=True)
class ModelResult:
    model: str
    batch: int
    cost: Optional[GraphCost]
    results: tuple[RunnerResult, ...]
    # runner -> the runner measured in its place because it failed or was wrong
    stand_ins: tuple[tuple[str, str], ...] = ()

    def result(self, runner: str) -> Optional[RunnerResult]:
        return next((r for r in self.results if r.runner == runner), None)

    def latency(self, runner: str) -> Optional[float]:
        r = self.result(runner)
        return r.latency if r else None

    def stand_in(self, runner: str) -> Optional[str]:
        return dict(self.stand_ins).get(runner)

    def latency_or_stand_in(self, runner: str) -> Optional[float]:
        """The runner's latency, or its stand-in's where it was not timed."""
        mine = self.latency(runner)
        other = self.stand_in(runner)
        return mine if mine is not None or other is None else self.latency(other)


@dataclass(frozen=True)
class TimingPlan:
    repeats: int = 7
    warmup: int = 1
    min_sample_seconds: float = 0.02  # short calls are repeated back to back up to this


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _prepare_and_check(runner: Runner, model: onnx.ModelProto, trials: int, work_dir: Path,
                       inputs, expected) -> tuple[RunnerResult, Optional[RunFn]]:
    reason = runner.unavailable()
    if reason:
        return RunnerResult(runner.name, SKIPPED, reason), None
    start = time.perf_counter()
    try:
        run = runner.prepare(model, trials, work_dir / runner.name)
        prepare_seconds = time.perf_counter() - start
        outputs = run(inputs)
    except Exception as err:  # a broken runner is a result to report, not a crash
        return RunnerResult(runner.name, FAILED, _first_line(err),
                            time.perf_counter() - start), None
    agreement = compare_outputs(outputs, expected)
    status = OK if agreement.ok else WRONG
    return RunnerResult(runner.name, status, agreement.detail, prepare_seconds), \
        (run if agreement.ok else None)


def benchmark_model(name: str, model: onnx.ModelProto, batch: int, runners: Sequence[Runner],
                    trials: int, work_dir: Path, plan: TimingPlan = TimingPlan(), seed: int = 0,
                    log: Callable[[str], None] = print) -> ModelResult:
    inputs = random_inputs(model, seed)
    expected = reference_outputs(model, inputs)
    try:
        cost = graph_cost(model)
    except ValueError as err:
        log(f"  {name}: no roofline ({err})")
        cost = None
    checked, runnable, stand_ins = [], {}, []
    pending = list(runners)
    while pending:
        runner = pending.pop(0)
        log(f"  {name} b{batch}: preparing {runner.name} ...")
        result, run = _prepare_and_check(runner, model, trials, work_dir / f"{name}_b{batch}",
                                         inputs, expected)
        log(f"  {name} b{batch}: {runner.name} {result.status}: {result.detail}"
            + (f" (prepared in {result.prepare_seconds:.1f} s)" if result.prepare_seconds else ""))
        checked.append(result)
        if run is not None:
            runnable[runner.name] = run
        elif result.status in (WRONG, FAILED) and runner.stand_in and \
                runner.stand_in not in {r.name for r in runners}:
            stand_ins.append((runner.name, runner.stand_in))
            pending.insert(0, RUNNERS[runner.stand_in])
    calls = {n: (lambda run=run: run(inputs)) for n, run in runnable.items()}
    numbers = {n: calls_per_sample(c, plan.min_sample_seconds) for n, c in calls.items()}
    timings = time_alternating(calls, plan.repeats, plan.warmup, numbers)
    results = tuple(
        RunnerResult(r.runner, r.status, r.detail, r.prepare_seconds, timings.get(r.runner))
        for r in checked
    )
    return ModelResult(name, batch, cost, results, tuple(stand_ins))

