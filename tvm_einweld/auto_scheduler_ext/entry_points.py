"""Drop-in entry points mirroring MetaSchedule's ``tune_tir`` / ``tune_relax``, and a Relax
pass that tunes with adaptive layout strategies and applies the result.

The records land in a MetaSchedule database (``JSONDatabase`` in ``work_dir`` by default)
under the tasks' own workloads, so stock ``MetaScheduleApplyDatabase`` applies them; the Relax
stage then runs the compile-time layout passes of
``static_shape_tuning_pipeline(cpu_weight_prepack=True)``.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target

from ..tir_passes.rules import is_scheduled
from .selectors import StrategySelector, make_selector
from .strategies import Strategy
from .task_loop import RoundCallback, TaskTuningResult, default_builder, tune_task

logger = logging.getLogger("tvm_einweld.auto_scheduler_ext")

TaskCallback = Callable[[TaskTuningResult], None]


def _trials_per_task(max_trials_global: int, max_trials_per_task: Optional[int], num_tasks: int) -> int:
    """Equal shares of the global budget, capped by the per-task limit."""
    share = max_trials_global // num_tasks
    if max_trials_per_task is not None:
        share = min(share, max_trials_per_task)
    if share <= 0:
        raise ValueError(
            f"max_trials_global={max_trials_global} leaves no trials for each of {num_tasks} tasks"
        )
    return share


def _tune_tasks(
    tasks: list,  # (name, IRModule) pairs
    target: Target,
    work_dir: str,
    max_trials_global: int,
    *,
    layout_strategy: str = "adaptive",
    selector: Optional[str | StrategySelector] = None,
    max_trials_per_task: Optional[int] = None,
    num_trials_per_iter: int = 16,
    builder: Optional[ms.builder.Builder] = None,
    runner: Optional[ms.runner.Runner] = None,
    database: Optional[ms.database.Database] = None,
    search: Optional[ms.search_strategy.EvolutionarySearch] = None,
    seed: int = -1,
    on_round: Optional[RoundCallback] = None,
    on_task: Optional[TaskCallback] = None,
    early_stopping_rounds: int = 50,
) -> ms.database.Database:
    """Tune (name, IRModule) tasks one after another; the options are ``tune_tir``'s."""
    if not tasks:
        raise ValueError("no tuning tasks in the module")
    target = Target(target) if not isinstance(target, Target) else target
    chosen = make_selector(layout_strategy, selector)
    if database is None:
        os.makedirs(work_dir, exist_ok=True)  # JSONDatabase cannot create its folder
        database = ms.database.JSONDatabase(work_dir=work_dir)
    builder = builder or default_builder()
    runner = runner or ms.runner.LocalRunner()
    trials = _trials_per_task(max_trials_global, max_trials_per_task, len(tasks))
    finished = []
    for index, (name, mod) in enumerate(tasks):
        logger.info("task %d/%d %s: %d trials, strategy %s", index + 1, len(tasks), name, trials, chosen.name)
        result = tune_task(
            mod,
            target,
            database,
            max_trials=trials,
            num_trials_per_iter=num_trials_per_iter,
            selector=chosen,
            builder=builder,
            runner=runner,
            search=search,
            early_stopping_rounds=early_stopping_rounds,
            task_name=name,
            seed=seed,
            on_round=on_round,
        )
        finished.append((mod, result))
        logger.info("%s", summary_table(finished))
        if on_task is not None:
            on_task(result)
    return database


def summary_table(finished: list) -> str:
    """A task table like MetaSchedule's task scheduler prints: (IRModule, result) pairs."""
    from tvm.s_tir.analysis import estimate_tir_flops  # pylint: disable=import-outside-toplevel

    lines = [
        " ID | Name | FLOP | Trials | Best (us) | GFLOPs | Rounds NL/LR/LC | Deployed",
        "----+------+------+--------+-----------+--------+-----------------+---------",
    ]
    for i, (mod, r) in enumerate(finished):
        flop = estimate_tir_flops(mod)
        best = "N/A" if r.best_secs is None else f"{r.best_secs * 1e6:.2f}"
        gflops = "N/A" if r.best_secs is None else f"{flop / r.best_secs / 1e9:.2f}"
        counts = "/".join(str(sum(o.strategy is s for o in r.rounds)) for s in Strategy)
        lines.append(f" {i} | {r.task_name} | {int(flop)} | {r.trials} | {best} | {gflops} | {counts} | {r.deployed.value}")
    return "\n".join(lines)


def tune_tir(
    mod: tvm.IRModule | tvm.tirx.PrimFunc,
    target: str | dict | Target,
    work_dir: str,
    max_trials_global: int,
    *,
    layout_strategy: str = "adaptive",
    selector: Optional[str | StrategySelector] = None,
    max_trials_per_task: Optional[int] = None,
    num_trials_per_iter: int = 16,
    builder: Optional[ms.builder.Builder] = None,
    runner: Optional[ms.runner.Runner] = None,
    database: Optional[ms.database.Database] = None,
    search: Optional[ms.search_strategy.EvolutionarySearch] = None,
    seed: int = -1,
    on_round: Optional[RoundCallback] = None,
    on_task: Optional[TaskCallback] = None,
    early_stopping_rounds: int = 50,
) -> ms.database.Database:
    """Tune every PrimFunc of ``mod`` (each one task) like ``ms.tune_tir``, with layout
    strategies: "adaptive" (switch per round, ``selector`` "predefined", "bandit", "leader"
    or "stall"), or a single "NL", "LR" or "LC". Buffers named in a PrimFunc's
    ``layout_free_buffers`` attribute are the static data whose layout may be rewritten.
    Returns the database."""
    if isinstance(mod, tvm.tirx.PrimFunc):
        mod = tvm.IRModule({"main": mod})
    tasks = [
        (gv.name_hint, tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
        for gv, func in mod.functions.items()
        if isinstance(func, tvm.tirx.PrimFunc)
    ]
    return _tune_tasks(
        tasks, target, work_dir, max_trials_global,
        layout_strategy=layout_strategy, selector=selector, max_trials_per_task=max_trials_per_task,
        num_trials_per_iter=num_trials_per_iter, builder=builder, runner=runner, database=database,
        search=search, seed=seed, on_round=on_round, on_task=on_task,
        early_stopping_rounds=early_stopping_rounds,
    )


def prepare_relax(mod: tvm.IRModule, params: Optional[dict], target: Target) -> tvm.IRModule:
    """The passes ``static_shape_tuning_pipeline(cpu_weight_prepack=True)`` runs before tuning:
    bind the weights, legalize and fuse, and mark constant weights layout-free."""
    if params:
        mod = relax.transform.BindParams("main", params)(mod)
    with target:
        return tvm.transform.Sequential(
            [
                relax.transform.DecomposeOpsForInference(),
                relax.transform.CanonicalizeBindings(),
                relax.pipeline.zero_pipeline(),
                relax.transform.AttachAttrLayoutFreeBuffers(),
            ]
        )(mod)


def apply_database(work_dir: str, target: Target) -> tvm.transform.Pass:
    """Apply the tuned records, then transform the constant weights once at compile time."""

    @tvm.transform.module_pass(opt_level=0, name="EinweldApplyLayoutTuning")
    def _apply(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(
                [
                    relax.transform.MetaScheduleApplyDatabase(work_dir),
                    relax.transform.SplitLayoutRewritePreproc(),
                    relax.transform.LiftTransformParams(),
                    relax.transform.FoldConstant(),
                ]
            )(mod)

    return _apply


def relax_tasks(prepared: tvm.IRModule, target: Target) -> list:
    """(name, IRModule) tuning tasks of a module prepared by ``prepare_relax``."""
    extracted = ms.relax_integration.extract_tasks(prepared, target)
    # Kernels another pass already scheduled (TileGraphFusion's fused groups) are not tasks.
    return [(t.task_name, t.dispatched[0]) for t in extracted if not is_scheduled(t.dispatched[0])]


def tune_relax(
    mod: tvm.IRModule,
    params: Optional[dict],
    target: str | dict | Target,
    work_dir: str,
    max_trials_global: int,
    **kwargs,
) -> ms.database.Database:
    """Tune the TIR tasks of a Relax module (weights in ``params`` or bound as constants) with
    layout strategies, like ``ms.relax_integration.tune_relax``. Keyword arguments are those of
    ``tune_tir``. Returns the database."""
    target = Target(target) if not isinstance(target, Target) else target
    tasks = relax_tasks(prepare_relax(mod, params, target), target)
    return _tune_tasks(tasks, target, work_dir, max_trials_global, **kwargs)


def adaptive_layout_tuning_pass(
    target: str | dict | Target,
    work_dir: str,
    max_trials_global: int,
    **kwargs,
) -> tvm.transform.Pass:
    """A Relax pipeline stage: prepare, tune with layout strategies, apply the records and fold
    the weights' layout transforms at compile time. The drop-in replacement for
    ``static_shape_tuning_pipeline(total_trials, target, work_dir, cpu_weight_prepack=True)``;
    keyword arguments are those of ``tune_tir``. Constant weights must be bound in the module."""
    target = Target(target) if not isinstance(target, Target) else target

    @tvm.transform.module_pass(opt_level=0, name="EinweldAdaptiveLayoutTuning")
    def _stage(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        prepared = prepare_relax(mod, None, target)
        tasks = relax_tasks(prepared, target)
        if tasks:
            _tune_tasks(tasks, target, work_dir, max_trials_global, **kwargs)
        else:
            logger.info("no kernel left to tune: every kernel is already scheduled")
        return apply_database(work_dir, target)(prepared)

    return _stage
