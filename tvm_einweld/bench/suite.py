"""The zoo benchmark: every selected model x batch through every selected runner, one report.

`python -m tvm_einweld bench` and `benchmarks/zoo.py` both call `run_suite`; presets QUICK
and FULL fix what each measures so the committed reports are reproducible.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..models import get_model
from .harness import ModelResult, TimingPlan, benchmark_model
from ..machine import (describe_machine, is_busy, load_average, own_decisions, row_round_trips,
                       slow_round_trips, usable_cpus)
from .report import SuiteResult
from .runners import RUNNERS, Runner


@dataclass(frozen=True)
class BenchConfig:
    models: tuple[str, ...]
    batches: tuple[int, ...] = (1,)
    runners: tuple[str, ...] = ("tvm-untuned", "tvm-tuned", "onnxruntime", "tvm_einweld",
                                "openvino", "openvino-default", "pytorch")
    trials: int = 0  # MetaSchedule trials per model, the same for every tuned runner
    baseline: str = "tvm-tuned"
    plan: TimingPlan = TimingPlan()
    work_dir: Optional[Path] = None  # tuning logs; a temporary directory when None


ALL_MODELS = ("infogan", "dcgan", "fsrcnn", "gcn", "resnet18", "csrnet", "longformer",
              "bert", "vit", "mobilenetv2", "nafnet", "nerf")

# A few minutes on 2 cores: three small models and no tuning (MetaSchedule's search costs
# minutes per task on a busy 2-core machine); `--trials N` adds a budget.
QUICK = BenchConfig(models=("infogan", "fsrcnn", "mobilenetv2"), trials=0,
                    plan=TimingPlan(repeats=5, warmup=1))
# Every model at batch 1 with 256 MetaSchedule trials per model for each tuned runner (the
# budget issue 15 compares at). On 2 cores this takes hours (at 128 trials: 2-5 min of stock
# tuning for the GAN generators and FSRCNN, 15 min for GCN, and as much again wherever stock
# pre-packing is wrong and its stand-in is tuned); `--resume` continues a cut-short run;
# `--models`, `--trials` and `--runners` cut it down.
FULL = BenchConfig(models=ALL_MODELS, trials=256, plan=TimingPlan(repeats=5, warmup=1))


def resolve_runners(names: Sequence[str]) -> list[Runner]:
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise KeyError(f"unknown runner(s) {', '.join(unknown)}; known: {', '.join(RUNNERS)}")
    return [RUNNERS[n] for n in names]


def run_suite(config: BenchConfig, command: Optional[str] = None,
              log: Callable[[str], None] = print,
              on_model: Optional[Callable[[SuiteResult], None]] = None,
              resume: Optional[SuiteResult] = None) -> SuiteResult:
    """Measure every (model, batch) of `config`; batches a model does not fit are skipped.

    `on_model` gets the result so far after each (model, batch), so a long run that is cut
    short still leaves its finished rows (the notes say how many are still to come).
    `resume`, such a cut-short result of the same configuration, supplies its rows, start,
    machine and wall time; only the rows it lacks are measured (tuning runners continue from
    the databases in `config.work_dir`)."""
    runners = resolve_runners(config.runners)
    for m in config.models:
        get_model(m)  # fail early on a typo, before any tuning
    if resume is not None:
        check_resumable(resume, config)
    started = datetime.datetime.now(datetime.timezone.utc)
    start = time.perf_counter()
    load = load_average()
    machine = describe_machine() if resume is None else resume.machine
    log(f"machine: {machine.describe()}")
    threads = config.plan.thread_count()
    log(f"every runtime gets {threads} threads"
        + (", each runner in its own process" if config.plan.isolate else ", in this process"))
    notes = [f"{r.name} skipped: {why}" for r in runners if (why := r.unavailable())]
    if config.trials == 0 and "tvm-tuned" in config.runners:
        notes.append("tvm-tuned at 0 trials is static_shape_tuning_pipeline without search: "
                     "its weight-prepack rewrites with TVM's default (unscheduled) kernels")
    for note in notes:
        log(note)
    results: list[ModelResult] = list(resume.models) if resume else []
    done = {(m.model, m.batch) for m in results}
    if resume is not None:
        notes += [n for n in resume.notes if n.startswith("resumed ")]
        notes.append(f"resumed {started.isoformat(timespec='seconds')} with {len(done)} "
                     f"row(s) of the run started {resume.started_utc}")

    def result(notes_now: list[str]) -> SuiteResult:
        load_now = load_average()
        busiest = max([x for x in (load, load_now) if x is not None], default=None)
        if is_busy(busiest, len(usable_cpus())):
            notes_now = notes_now + [
                f"the machine was busy (1-min load up to {busiest:.1f} on "
                f"{len(usable_cpus())} CPUs): latencies read high and spreads wide; "
                "measure again on an idle machine before quoting them"]
        trips = row_round_trips((m.round_trip_before, m.round_trip_after) for m in results)
        slow = [results[i].model for i in slow_round_trips(trips)]
        if slow:
            notes_now = notes_now + [
                f"core round trip over twice the run's fastest "
                f"({min(t for t in trips if t is not None):.0f} ns) on {', '.join(slow)}: the "
                "two CPUs sat apart (a VM host's placement) while those rows ran, so their "
                "multi-threaded latencies read high; ratios within a row still hold"]
        return SuiteResult(
            command=command or " ".join(shlex.quote(a) for a in sys.argv),
            started_utc=resume.started_utc if resume else started.isoformat(timespec="seconds"),
            wall_seconds=time.perf_counter() - start + (resume.wall_seconds if resume else 0.0),
            machine=machine,
            load_average=resume.load_average if resume else load,
            trials=config.trials,
            runners=tuple(r.name for r in runners),
            baseline=config.baseline,
            models=tuple(results),
            notes=tuple(notes_now),
            load_after=load_now,
            threads=threads if config.plan.isolate else None,
            isolated=config.plan.isolate,
        )

    with contextlib.ExitStack() as stack:
        work_dir = Path(config.work_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="einweld_bench_")))
        stack.enter_context(own_decisions(work_dir))
        for name in config.models:
            entry = get_model(name)
            for batch in config.batches:
                if batch not in entry.batches:
                    log(f"{name}: batch {batch} does not fit this machine class, skipped")
                    continue
                if (name, batch) in done:
                    log(f"{name} batch {batch}: measured in the run being resumed")
                    continue
                log(f"{name} batch {batch}: {entry.summary}")
                results.append(benchmark_model(name, entry.build(batch), batch, runners,
                                               config.trials, work_dir, config.plan, log=log))
                if on_model is not None:
                    left = len(config.models) - 1 - config.models.index(name)
                    on_model(result(notes + [f"partial: {left} more model(s) to measure"]))
    return result(notes)


def check_resumable(earlier: SuiteResult, config: BenchConfig) -> None:
    """Raise ValueError unless `earlier` measured what `config` measures (same budget,
    runners, baseline, thread count and isolation), so its rows and the new ones compare."""
    now = (config.trials, tuple(config.runners), config.baseline,
           config.plan.thread_count() if config.plan.isolate else None, config.plan.isolate)
    then = (earlier.trials, earlier.runners, earlier.baseline, earlier.threads, earlier.isolated)
    names = ("trials", "runners", "baseline", "threads", "isolation")
    differ = [f"{n} {a!r} then, {b!r} now" for n, a, b in zip(names, then, now) if a != b]
    if differ:
        raise ValueError("cannot resume a run with other settings: " + "; ".join(differ))


def with_overrides(config: BenchConfig, **changes) -> BenchConfig:
    """The preset with the given fields replaced (None leaves a field as it is)."""
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
