"""Tune one task under several strategy variants at the same trial budget, then re-measure
every variant's best deployable program side by side (alternating, medians).

Times seen during tuning come from different moments of a shared machine; the ranking uses
only the final re-measurement, where each round times every variant once, in turn.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..machine import cpu_model
from .build_fn import build_cpu_kernel
from .selectors import RoundOutcome, StrategySelector, make_selector
from .strategies import args_info
from .task_loop import RoundCallback, TaskTuningResult, tune_task


@dataclass(frozen=True)
class Variant:
    """A way to tune: "NL" / "LR" / "LC" alone, or "adaptive" with a selector."""

    label: str
    layout_strategy: str
    selector: Optional[str | StrategySelector] = None  # a name (`make_selector`) or one


SINGLE_AND_ADAPTIVE = (
    Variant("NL", "NL"),
    Variant("LR", "LR"),
    Variant("LC", "LC"),
    Variant("adaptive", "adaptive", "predefined"),
)
# Every single strategy and every adaptive rule (`selectors`): #15's comparison.
ALL_RULES = SINGLE_AND_ADAPTIVE + (Variant("bandit", "adaptive", "bandit"),
                                   Variant("leader", "adaptive", "leader"),
                                   Variant("stall", "adaptive", "stall"))


@dataclass(frozen=True)
class VariantResult:
    variant: Variant
    tuning: TaskTuningResult
    best_program: Optional[s_tir.Schedule]  # the deployable program: NL A, LR L+P, else P
    secs: Optional[float] = None  # median of the side-by-side re-measurement


def best_program(mod: tvm.IRModule, result: TaskTuningResult) -> Optional[s_tir.Schedule]:
    if result.best_trace is None:
        return None
    sch = s_tir.Schedule(mod)
    result.best_trace.apply_to_schedule(sch, remove_postproc=False)
    return sch


def tune_variants(
    mod: tvm.IRModule,
    target: Target,
    work_root: str,
    trials: int,
    variants: Sequence[Variant] = SINGLE_AND_ADAPTIVE,
    *,
    task_name: str = "main",
    on_round: Optional[RoundCallback] = None,
    **options,
) -> list:
    """Tune ``mod`` once per variant, each with its own database under ``work_root``.
    ``options`` go to ``tune_task`` (num_trials_per_iter, builder, runner, search, seed...).
    Each variant's rounds are kept beside its database (`ROUNDS_FILE`), so that a run cut
    short resumes with its selector's history as well as its records."""
    out = []
    for variant in variants:
        work_dir = os.path.join(work_root, f"{task_name}-{variant.label}")
        os.makedirs(work_dir, exist_ok=True)
        rounds_path = os.path.join(work_dir, ROUNDS_FILE)
        history = _load_rounds(rounds_path)

        def keep(name: str, outcome: RoundOutcome, path=rounds_path, kept=list(history)) -> None:
            # tune_task drops rounds its database does not hold; so does the file
            kept[:] = [o for o in kept if o.round_index < outcome.round_index] + [outcome]
            with open(path, "w") as f:
                json.dump([o.to_json() for o in kept], f)
            if on_round is not None:
                on_round(name, outcome)

        result = tune_task(
            mod,
            target,
            ms.database.JSONDatabase(work_dir=work_dir),
            max_trials=trials,
            selector=make_selector(variant.layout_strategy, variant.selector),
            task_name=f"{task_name}[{variant.label}]",
            on_round=keep,
            history=history,
            **options,
        )
        out.append(VariantResult(variant, result, best_program(mod, result)))
    return out


ROUNDS_FILE = "rounds.json"


def _load_rounds(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [RoundOutcome.from_json(o) for o in json.load(f)]


def remeasure(
    programs: Sequence[Optional[s_tir.Schedule]],
    target: Target,
    rounds: int = 7,
    min_repeat_ms: int = 50,
) -> list:
    """Median run time of each program (None stays None), alternating between the programs in
    every round so that load changes hit all of them alike. Weights are fed in each program's
    own layout (P gets its rewritten weights, as after compile-time folding)."""
    dev = tvm.cpu()
    timers = {}
    for i, sch in enumerate(programs):
        if sch is None:
            continue
        kernel = build_cpu_kernel(sch.mod, target)
        rng = np.random.default_rng(i)
        args = [
            tvm.runtime.tensor(rng.standard_normal([int(d) for d in a.shape]).astype(a.dtype), dev)
            for a in args_info(sch)
        ]
        evaluator = kernel.time_evaluator("main", dev, number=1, repeat=1, min_repeat_ms=min_repeat_ms)
        timers[i] = (evaluator, args)
    samples = {i: [] for i in timers}
    for _ in range(rounds):
        for i, (evaluator, args) in timers.items():
            samples[i].append(evaluator(*args).mean)
    return [statistics.median(samples[i]) if i in samples else None for i in range(len(programs))]


def remeasure_variants(results: Sequence[VariantResult], target: Target, **kwargs) -> list:
    secs = remeasure([r.best_program for r in results], target, **kwargs)
    return [VariantResult(r.variant, r.tuning, r.best_program, t) for r, t in zip(results, secs)]


def compare_task(mod, target, work_root, trials, variants=SINGLE_AND_ADAPTIVE, **options) -> list:
    """tune_variants + remeasure_variants."""
    return remeasure_variants(tune_variants(mod, target, work_root, trials, variants, **options), target)


def machine_description() -> str:
    cpu = cpu_model()
    return f"{cpu}, {os.cpu_count()} logical cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
