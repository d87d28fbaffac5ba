"""Benchmark one model with several runners: prepare, check against onnxruntime, then time.

Each runner is prepared and timed in its own worker process (`isolation`: spinning thread
pools and TVM's CPU pin must not reach the next runner), with every runtime given the
physical cores. The parent alternates rounds of timed calls across the workers
(`timing.alternate_rounds`) and takes medians.

A runner that cannot be prepared, crashes, or disagrees with the onnxruntime reference is
reported as such and left out of the timing: a fast wrong answer is never a result. Its
outputs are checked once more after the timing (a runtime that reuses buffers can go wrong
on later calls). Where such a runner names a stand-in (stock tuned TVM without weight
pre-packing for the pre-packing one), the stand-in is measured in its place and the report
says so.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence, Union

import onnx

from ..machine import code_version, load_average, physical_cores
from ..models import random_inputs
from .check import FP32, Tolerance, compare_outputs
from .isolation import InProcessRunner, Prepared, WorkerError, WorkerProcess, error_line
from .roofline import GraphCost, graph_cost
from .runners import RUNNERS, Runner, reference_outputs
from .timing import (
    PhaseTimed, Timing, alternate_rounds, calls_per_sample, local_sampler, reference_work,
    time_in_fast_phase,
)

OK, WRONG, FAILED, SKIPPED = "ok", "wrong", "failed", "skipped"
# The name of the machine's reference loop among the samplers (`timing.reference_work`).
REFERENCE = "machine (reference loop)"

Handle = Union[WorkerProcess, InProcessRunner]


@dataclass(frozen=True)
class RunnerResult:
    runner: str
    status: str  # OK, WRONG, FAILED or SKIPPED
    detail: str  # agreement with the reference, the error, or why skipped
    prepare_seconds: Optional[float] = None
    timing: Optional[Timing] = None
    # What it ran with: thread variables, CPUs, runtime options read back after preparing.
    settings: tuple[tuple[str, str], ...] = ()
    pid: Optional[int] = None  # the process it ran in
    error: Optional[float] = None  # max |err| / max |ref| against the reference

    @property
    def latency(self) -> Optional[float]:
        return self.timing.median if self.timing else None

    @property
    def spread(self) -> Optional[float]:
        return self.timing.spread if self.timing else None


@dataclass(frozen=True)
class ModelResult:
    model: str
    batch: int
    cost: Optional[GraphCost]
    results: tuple[RunnerResult, ...]
    # runner -> the runner measured in its place because it failed or was wrong
    stand_ins: tuple[tuple[str, str], ...] = ()
    load_before: Optional[float] = None  # 1-minute load average before preparing
    load_after: Optional[float] = None  # ... and after the timing
    code: Optional[str] = None  # tvm_einweld's `code_version()` that measured the row
    # The machine's reference loop, timed in the same rounds (`timing.reference_work`).
    reference: Optional[Timing] = None
    # Core-to-core round trip (ns) just before and just after the timed rounds
    # (`machine.measure_round_trip_ns`): multi-threaded latencies read high where it is slow.
    round_trip_before: Optional[float] = None
    round_trip_after: Optional[float] = None
    # Round trips around earlier attempts at the rounds, discarded as timed in the slow phase.
    slow_attempts: tuple[tuple[Optional[float], Optional[float]], ...] = ()

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
    repeats: int = 7  # timed rounds per runner
    warmup: int = 1  # untimed rounds (one call each) before them
    # A round repeats short calls back to back up to this and keeps their median: one call
    # of a 50 ms model per round let a single slow call set a round (GCN, CSRNet: 20-48 %
    # spreads); five agree within a few percent on an idle machine.
    min_sample_seconds: float = 0.25
    threads: Optional[int] = None  # threads every runtime gets; None: the physical cores
    isolate: bool = True  # each runner in its own worker process
    prepare_timeout: Optional[float] = None  # seconds to prepare (tune + compile); None: no limit
    call_timeout: float = 600.0  # seconds any other request may take, at least

    def thread_count(self) -> int:
        return self.threads or physical_cores()


def _open(runner: Runner, plan: TimingPlan, log_dir: Path) -> Handle:
    if not plan.isolate:
        return InProcessRunner(runner.prepare)
    return WorkerProcess(runner.prepare, plan.thread_count(), log_dir / f"{runner.name}.log",
                         timeout=plan.call_timeout, environment=dict(runner.environment),
                         name=runner.name)


def _detail(err: Exception) -> str:
    return str(err) if isinstance(err, WorkerError) else error_line(err)


def _prepare_and_check(runner: Runner, handle: Handle, model_bytes: bytes, trials: int,
                       work_dir: Path, inputs, expected, plan: TimingPlan) -> RunnerResult:
    start = time.perf_counter()
    try:
        prepared: Prepared = handle.prepare(model_bytes, trials, work_dir / runner.name, inputs,
                                            timeout=plan.prepare_timeout)
    except Exception as err:  # a broken runner is a result to report, not a crash
        return RunnerResult(runner.name, FAILED, _detail(err), time.perf_counter() - start,
                            pid=handle.pid)
    agreement = compare_outputs(prepared.outputs, expected, runner.tolerance.rtol,
                                runner.tolerance.atol_scale)
    return RunnerResult(runner.name, OK if agreement.ok else WRONG, agreement.detail,
                        prepared.prepare_seconds, settings=prepared.settings, pid=prepared.pid,
                        error=agreement.relative_error)


def time_and_recheck(handles: Mapping[str, Handle], expected, repeats: int, warmup: int,
                     min_sample_seconds: float, log: Callable[[str], None],
                     tolerances: Mapping[str, Tolerance] = MappingProxyType({}),
                     reference: bool = False
                     ) -> tuple[dict[str, Timing], dict[str, tuple[str, str]], Optional[Timing],
                                PhaseTimed]:
    """Alternating rounds over the prepared `handles` (each round about `min_sample_seconds` of
    back-to-back calls), with the machine's reference loop among them when `reference` (in
    this process, idle while the workers run), timed again where the machine was in its slow
    phase (`timing.time_in_fast_phase`); then one more output check of each handle against
    `expected` (within its tolerance in `tolerances`, else fp32's): a runtime that reuses
    buffers can go wrong on later calls. The zoo harness and the kernel benchmark both time
    with it. Returns the timings, per handle that went wrong on the way (status, detail),
    the reference loop's timing (None when not timed) and the rounds' phase (the
    core-to-core round trips (ns) measured with every worker quiet just before and after the
    rounds, and those of attempts timed again)."""
    problems: dict[str, tuple[str, str]] = {}
    numbers = {}
    for name, handle in handles.items():
        try:
            numbers[name] = handle.calibrate(min_sample_seconds)
        except Exception as err:
            problems[name] = (FAILED, f"calibrating: {_detail(err)}")
    samplers = {name: handles[name].sample for name in numbers}
    if samplers and reference:
        samplers[REFERENCE] = local_sampler(reference_work)
        numbers[REFERENCE] = calls_per_sample(reference_work, min_sample_seconds)

    def rounds() -> dict[str, Timing]:  # every worker quiet around them
        return alternate_rounds(
            samplers, repeats, warmup, numbers,
            on_error=lambda name, err: problems.setdefault(name, (FAILED,
                                                                  f"timing: {_detail(err)}")))

    timed = time_in_fast_phase(rounds, log) if samplers else PhaseTimed({}, (None, None))
    timings = dict(timed.value)
    reference_timing = timings.pop(REFERENCE, None)
    for name in list(timings):
        tolerance = tolerances.get(name, FP32)
        try:
            agreement = compare_outputs(handles[name].outputs(), expected, tolerance.rtol,
                                        tolerance.atol_scale)
        except Exception as err:
            problems[name] = (FAILED, f"after timing: {_detail(err)}")
            continue
        if not agreement.ok:
            problems[name] = (WRONG, f"after timing: {agreement.detail}")
    for name, (status, detail) in problems.items():
        timings.pop(name, None)
        log(f"  {name} {status}: {detail}")
    return timings, problems, reference_timing, timed


def benchmark_model(name: str, model: onnx.ModelProto, batch: int, runners: Sequence[Runner],
                    trials: int, work_dir: Path, plan: TimingPlan = TimingPlan(), seed: int = 0,
                    log: Callable[[str], None] = print) -> ModelResult:
    load_before = load_average()
    inputs = random_inputs(model, seed)
    expected = reference_outputs(model, inputs)
    try:
        cost = graph_cost(model)
    except ValueError as err:
        log(f"  {name}: no roofline ({err})")
        cost = None
    model_bytes = model.SerializeToString()
    model_dir = work_dir / f"{name}_b{batch}"
    checked: list[RunnerResult] = []
    handles: dict[str, Handle] = {}
    by_name: dict[str, Runner] = {}
    stand_ins = []
    pending = list(runners)
    with contextlib.ExitStack() as stack:
        opened: dict[str, Handle] = {}

        def open_handle(runner: Runner) -> Handle:
            handle = _open(runner, plan, model_dir)
            stack.callback(handle.close)
            return handle

        # Workers start together (their imports overlap); they prepare one at a time.
        for runner in runners:
            if not runner.unavailable():
                opened[runner.name] = open_handle(runner)
        while pending:
            runner = pending.pop(0)
            reason = runner.unavailable()
            if reason:
                checked.append(RunnerResult(runner.name, SKIPPED, reason))
                continue
            log(f"  {name} b{batch}: preparing {runner.name} ...")
            handle = opened.pop(runner.name, None) or open_handle(runner)
            result = _prepare_and_check(runner, handle, model_bytes, trials, model_dir, inputs,
                                        expected, plan)
            log(f"  {name} b{batch}: {runner.name} {result.status}: {result.detail}"
                + (f" (prepared in {result.prepare_seconds:.1f} s)"
                   if result.prepare_seconds else ""))
            checked.append(result)
            if result.status == OK:
                handles[runner.name], by_name[runner.name] = handle, runner
            else:
                handle.close()  # free its memory now
                if runner.stand_in and runner.stand_in not in {r.name for r in runners}:
                    stand_ins.append((runner.name, runner.stand_in))
                    pending.insert(0, RUNNERS[runner.stand_in])
        log(f"  {name} b{batch}: timing {', '.join(handles) or 'nothing'} "
            f"({plan.repeats} alternating rounds)")
        timings, problems, reference, phase = time_and_recheck(
            handles, expected, plan.repeats, plan.warmup, plan.min_sample_seconds, log,
            {name: runner.tolerance for name, runner in by_name.items()}, reference=True)
    results = []
    for r in checked:
        status, detail = problems.get(r.runner, (r.status, r.detail))
        results.append(RunnerResult(r.runner, status, detail, r.prepare_seconds,
                                    timings.get(r.runner), r.settings, r.pid, r.error))
    return ModelResult(name, batch, cost, tuple(results), tuple(stand_ins), load_before,
                       load_average(), code_version(), reference, *phase.round_trips,
                       phase.slow_attempts)
