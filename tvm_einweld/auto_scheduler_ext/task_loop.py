"""The adaptive-layout tuning loop for one task (AL-Ansor, Algorithm 1, on MetaSchedule).

Each round is MetaSchedule's generate / measure / update cycle with a strategy chosen first,
one small function per step:
  1. `selector.select(round, total_rounds, cost_model, history)` picks NL, LR or LC. It sees
     nothing of this round's candidates, so asking it first is the same as the paper's line 5;
     it lets the search score candidates as programs of the chosen strategy.
  2. `_generate`: MetaSchedule's evolutionary search samples candidates A with the shared
     XGBModel, and P and L+P are derived from every A (`strategies.derive_programs`).
  3. `_measure`: the round's strategy program is built and run (NL: A, LR: L+P, LC: P), plus P
     in adaptive mode, where P is what gets deployed.
  4. `_update`: the one XGBModel is trained on the strategy's measurements (its features carry
     the strategy), and the search is told the results.
  5. `_record`: the deployable programs are committed to the database under the task's own
     workload (a faster one than the best so far only if it computes what the task computes,
     else under a rejected workload); the other measurements under a strategy-tagged workload.
     The best deployable record is what `MetaScheduleApplyDatabase` later applies.

Records are committed every round, so an interrupted run resumes from its database: finished
trials are counted, the cost model is retrained on them and the search seeds from them.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import tvm
import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.logging import get_logging_func
from tvm.s_tir.meta_schedule.runner import RunnerResult
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate
from tvm.target import Target

from .check import ProgramChecker
from .features import StrategyFeatureExtractor
from .measure import FAILED_SECS, PooledBuilder, build_and_run, run_seconds
from .selectors import FixedStrategy, RoundOutcome, StrategySelector
from .strategies import Strategy, args_info, derive_programs, tagged_workload

logger = logging.getLogger("tvm_einweld.auto_scheduler_ext")

RoundCallback = Callable[[str, RoundOutcome], None]
REJECTED = "rejected"  # workload tag of deployable programs that failed the check


@dataclass(frozen=True)
class TaskTuningResult:
    """Summary of one task's tuning run (the records themselves are in the database)."""

    task_name: str
    selector: str
    deployed: Strategy  # the program form committed under the task's workload
    trials: int  # sampled candidates, including those of a resumed earlier run
    measurements: int  # programs built and run by this call
    rounds: tuple  # RoundOutcome of every round: the `history` given, then this call's
    best_secs: Optional[float]
    best_trace: Optional[s_tir.Trace]
    wall_secs: float


def default_builder(max_workers: Optional[int] = None) -> ms.builder.Builder:
    """A local builder running `build_fn.build_cpu_kernel` in worker processes kept across
    rounds (see `measure.PooledBuilder`)."""
    return PooledBuilder(max_workers=max_workers)


# MetaSchedule's defaults evolve a population of 2048 programs for 64 measured per round: the
# ratio is kept for smaller rounds (a 4-trial round spent 23 s of a 2-core machine evolving
# 2048), within [128, 2048].
POPULATION_PER_TRIAL = 2048 // 64


def default_search(trials_per_round: int) -> ms.search_strategy.EvolutionarySearch:
    """MetaSchedule's evolutionary search with its population scaled to the round."""
    population = min(2048, max(128, POPULATION_PER_TRIAL * trials_per_round))
    return ms.search_strategy.EvolutionarySearch(population_size=population)


def _space_generator(target: Target) -> ms.space_generator.PostOrderApply:
    """MetaSchedule's default CPU space, minus RewriteLayout: the loop derives P itself."""
    if target.kind.name != "llvm":
        raise NotImplementedError(
            f"adaptive layout tuning supports CPU (llvm) targets only, not {target.kind.name!r}: "
            "MetaSchedule's RewriteLayout postproc is a CPU-only postproc"
        )
    postprocs = [
        p for p in ms.postproc.Postproc.create("llvm") if not isinstance(p, ms.postproc.RewriteLayout)
    ]
    return ms.space_generator.PostOrderApply(
        sch_rules=ms.schedule_rule.ScheduleRule.create("llvm"),
        postprocs=postprocs,
        mutator_probs=ms.mutator.Mutator.create("llvm"),
    )


def _tune_context(mod, target, space, search, task_name, seed, num_threads) -> ms.TuneContext:
    """`ms.TuneContext(...)` without its `import tvm.s_tir.tensor_intrin`: that import
    registers every target's tensor intrinsics (30-80 s here) and CPU float32 tuning never
    tensorizes. Same constructor call and initialisation as `TuneContext.__init__`."""
    if isinstance(num_threads, str):
        num_threads = ms.utils.cpu_count(logical=num_threads == "logical")
    log = logging.getLogger("tvm_einweld.auto_scheduler_ext.search")
    ctx = ms.TuneContext.__new__(ms.TuneContext)
    ctx.__init_handle_by_constructor__(
        ms._ffi_api.TuneContext,  # pylint: disable=protected-access
        mod, target, space, search, task_name, num_threads, seed, get_logging_func(log),
    )
    ms._ffi_api.TuneContextInitialize(ctx)  # pylint: disable=protected-access
    return ctx


def _records_of(database: ms.database.Database, mod: tvm.IRModule) -> list:
    if not database.has_workload(mod):
        return []
    workload = database.commit_workload(mod)
    return [
        r
        for r in database.get_all_tuning_records()
        if tvm_ffi.structural_equal(r.workload.mod, workload.mod)
    ]


def _replay(record) -> MeasureCandidate:
    sch = s_tir.Schedule(record.workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return MeasureCandidate(sch, args_info(sch))


def _commit(database, workload, sch: s_tir.Schedule, result: RunnerResult, target) -> None:
    secs = run_seconds(result)
    run_secs = [float(s) for s in result.run_secs] if secs is not None else [FAILED_SECS]
    database.commit_tuning_record(
        ms.database.TuningRecord(sch.trace, workload, run_secs, target, args_info(sch))
    )


def _resume(database, ctx, model, extractor, task_name: str):
    """What an earlier (possibly interrupted) run left in the database: the number of trials
    done, the best deployable record, and the cost model retrained on every measurement."""
    deployed_records = _records_of(database, ctx.mod)
    training_records = [r for s in Strategy for r in _records_of(database, tagged_workload(ctx.mod, s))]
    done = len(deployed_records) + len(_records_of(database, tagged_workload(ctx.mod, REJECTED)))
    best_secs, best_trace = None, None
    for r in deployed_records:
        secs = run_seconds(RunnerResult(r.run_secs, None))
        if secs is not None and (best_secs is None or secs < best_secs):
            best_secs, best_trace = secs, r.trace
    measured = deployed_records + training_records
    if measured:
        extractor.score_as = Strategy.NL  # replayed A programs are NL samples
        model.update(ctx, [_replay(r) for r in measured], [RunnerResult(r.run_secs, None) for r in measured])
        logger.info("[%s] resumed: %d trials already in the database, best %s", task_name, done, _ms(best_secs))
    return done, best_secs, best_trace


def _rounds_in(history: Sequence[RoundOutcome], done: int) -> list:
    """The rounds of `history` whose trials the database holds (`done`): a history kept
    apart from a database that was since cleared, or a round recorded before the process
    stopped, must not count rounds that are not there."""
    kept, trials = [], 0
    for outcome in history:
        trials += outcome.trials
        if trials > done:
            break
        kept.append(outcome)
    return kept


def _new_best(deployable, best_secs, best_trace, checker: ProgramChecker, task_name: str):
    """The round's fastest deployable program that beats the best so far and computes what the
    task computes becomes the best; faster ones that do not are rejected (their indices)."""
    rejected = set()
    for i in sorted(range(len(deployable)), key=lambda i: deployable[i][0] or FAILED_SECS):
        secs, sch = deployable[i]
        if secs is None or (best_secs is not None and secs >= best_secs):
            break
        verdict = checker.check(sch)
        if verdict.equal:
            return secs, sch.trace, rejected
        rejected.add(i)
        logger.error("[%s] rejected a tuned program: %s", task_name, verdict)
    return best_secs, best_trace, rejected


@dataclass(frozen=True)
class _Task:
    """What stays fixed while one task is tuned: its tune context (space, search), where
    programs are built, run and committed, the one cost model, and the program form that is
    deployed (`deployed`: the fixed strategy's, or P for an adaptive selector)."""

    name: str
    ctx: ms.TuneContext
    target: Target
    database: ms.database.Database
    builder: ms.builder.Builder
    runner: ms.runner.Runner
    model: ms.cost_model.XGBModel
    extractor: StrategyFeatureExtractor
    checker: ProgramChecker
    deployed: Strategy
    workload: ms.database.Workload  # the task's own: deployable records
    tagged: Dict[Strategy, tvm.IRModule]  # per strategy: the other measurements
    rejected: tvm.IRModule  # deployable programs that failed the check


@dataclass(frozen=True)
class _Round:
    """One round's candidates A, the programs derived from them, and the results of the
    programs built: `results[kind][i]` is candidate i's program of strategy `kind`."""

    strategy: Strategy
    candidates: list
    derived: list
    results: Dict[Strategy, list]

    @property
    def kinds(self) -> Tuple[Strategy, ...]:
        """The strategies built this round: the round's, then the deployed one if another."""
        return tuple(self.results)

    @property
    def measurements(self) -> int:
        """Programs built and run: one per candidate and kind."""
        return len(self.kinds) * len(self.derived)

    @property
    def failures(self) -> int:
        """Programs that failed to build or run."""
        return sum(run_seconds(r) is None for kind in self.kinds for r in self.results[kind])


def _cost_model(extractor: StrategyFeatureExtractor, num_warmup_samples: int,
                early_stopping_rounds: int, threads: int) -> ms.cost_model.XGBModel:
    """The XGBModel shared by every strategy (its features carry the strategy)."""
    return ms.cost_model.XGBModel(
        extractor=extractor,
        num_warmup_samples=num_warmup_samples,
        early_stopping_rounds=early_stopping_rounds,
        # One XGBoost thread: the data are a few thousand rows at most, and on a busy 2-core
        # machine two threads made training ~15x slower (thread hand-offs under contention).
        config=ms.cost_model.xgb_model.XGBConfig(nthread=threads),
        num_tuning_cores=threads,
    )


def _generate(task: _Task, strategy: Strategy, limit: int) -> Optional[Tuple[list, list]]:
    """MetaSchedule's generate step, then ours: the evolutionary search samples candidates A
    (at most `limit`), scored by the cost model as programs of `strategy`, and P and L+P are
    derived from every A (`strategies.derive_programs`). None when the space is exhausted."""
    task.extractor.score_as = strategy
    candidates = task.ctx.search_strategy.generate_measure_candidates()
    if not candidates:
        return None
    candidates = list(candidates)[:limit]
    return candidates, [derive_programs(c.sch) for c in candidates]


def _measure(task: _Task, strategy: Strategy, candidates: list, derived: list) -> _Round:
    """The measure step: the round's strategy program of every candidate is built and run
    (NL: A, LR: L+P, LC: P), plus the deployed form when that is another one, in one batch
    (one builder and one runner round trip per round)."""
    kinds = [strategy] if strategy is task.deployed else [strategy, task.deployed]
    programs = [d.for_strategy(kind) for kind in kinds for d in derived]
    measured = build_and_run(programs, task.target, task.builder, task.runner)
    results = {kind: measured[k * len(derived) : (k + 1) * len(derived)] for k, kind in enumerate(kinds)}
    return _Round(strategy, candidates, derived, results)


def _update(task: _Task, done: _Round) -> None:
    """The update step: the cost model is trained on the strategy's measurements and the
    search is told their results."""
    train = [d.for_strategy(done.strategy) for d in done.derived]
    task.model.update(task.ctx, [MeasureCandidate(s, args_info(s)) for s in train], done.results[done.strategy])
    task.ctx.search_strategy.notify_runner_results(done.candidates, done.results[done.strategy])


def _record(task: _Task, done: _Round, best_secs: Optional[float], best_trace: Optional[s_tir.Trace]):
    """The database step: the best deployable program so far (checked, `_new_best`), and
    every measurement committed: deployable programs under the task's workload (or the
    rejected one), the others under their strategy's. Returns the best seconds and trace and
    the round's best deployable seconds."""
    deployed = task.deployed
    deployable = [(run_seconds(r), d.for_strategy(deployed)) for d, r in zip(done.derived, done.results[deployed])]
    best_secs, best_trace, rejected = _new_best(deployable, best_secs, best_trace, task.checker, task.name)
    database = task.database
    for kind in done.kinds:
        wl = task.workload if kind is deployed else database.commit_workload(task.tagged[kind])
        for i, (d, res) in enumerate(zip(done.derived, done.results[kind])):
            target_wl = database.commit_workload(task.rejected) if (kind is deployed and i in rejected) else wl
            _commit(database, target_wl, d.for_strategy(kind), res, task.target)
    round_best = min(
        (s for i, (s, _) in enumerate(deployable) if s is not None and i not in rejected), default=None
    )
    return best_secs, best_trace, round_best


def _prepare(
    mod: tvm.IRModule,
    target: Target,
    database: ms.database.Database,
    deployed: Strategy,
    builder: ms.builder.Builder,
    runner: ms.runner.Runner,
    search: Optional[ms.search_strategy.EvolutionarySearch],
    num_warmup_samples: int,
    early_stopping_rounds: int,
    cost_model_threads: int,
    task_name: str,
    seed: int,
) -> _Task:
    """The tune context, cost model and workloads of one task."""
    extractor = StrategyFeatureExtractor()
    model = _cost_model(extractor, num_warmup_samples, early_stopping_rounds, cost_model_threads)
    num_threads = int(target.attrs.get("num-cores", 0)) or "physical"
    ctx = _tune_context(
        mod,
        target,
        _space_generator(target),
        search.clone() if search is not None else ms.search_strategy.EvolutionarySearch(),
        task_name,
        seed,
        num_threads,
    )
    workload = database.commit_workload(ctx.mod)
    tagged = {s: tagged_workload(ctx.mod, s) for s in Strategy}
    rejected = tagged_workload(ctx.mod, REJECTED)
    checker = ProgramChecker(ctx.mod, target)
    if "layout_free_buffers" not in ctx.mod["main"].attrs:
        logger.warning("[%s] no layout_free_buffers attribute: nothing to rewrite, so NL, LR and "
                       "LC programs coincide", task_name)
    return _Task(task_name, ctx, target, database, builder, runner, model, extractor, checker,
                 deployed, workload, tagged, rejected)


def tune_task(
    mod: tvm.IRModule,
    target: Target,
    database: ms.database.Database,
    *,
    max_trials: int,
    num_trials_per_iter: int = 16,
    selector: StrategySelector,
    builder: Optional[ms.builder.Builder] = None,
    runner: Optional[ms.runner.Runner] = None,
    search: Optional[ms.search_strategy.EvolutionarySearch] = None,
    num_warmup_samples: Optional[int] = None,
    early_stopping_rounds: int = 50,
    cost_model_threads: int = 1,
    task_name: str = "main",
    seed: int = -1,
    on_round: Optional[RoundCallback] = None,
    history: Sequence[RoundOutcome] = (),
    planned_rounds: Optional[int] = None,
) -> TaskTuningResult:
    """Tune one TIR task (an IRModule with a `main` PrimFunc) with layout-strategy selection.

    `selector` is a `FixedStrategy` for a single-strategy run (the deployed program is that
    strategy's program) or an adaptive selector (the deployed program is always P). The XGBModel
    starts training after `num_warmup_samples` measurements (default: one round), not
    MetaSchedule's 100, which a short run would never reach. Each round is MetaSchedule's
    cycle with the strategy chosen first: `_generate`, `_measure`, `_update`, then `_record`.
    `history`: the task's earlier rounds (a resumed or round-by-round run), which the selector
    sees and the result's `rounds` begins with; `planned_rounds`: the horizon the selector's
    shares refer to (default: this call's `max_trials` in rounds).
    """
    start = time.time()
    if isinstance(mod, tvm.tirx.PrimFunc):
        mod = tvm.IRModule({"main": mod})
    if max_trials <= 0:
        raise ValueError("max_trials must be positive")
    target = Target(target) if not isinstance(target, Target) else target
    deployed = selector.strategy if isinstance(selector, FixedStrategy) else Strategy.LC
    task = _prepare(
        mod, target, database, deployed, builder or default_builder(), runner or ms.runner.LocalRunner(),
        search or default_search(min(num_trials_per_iter, max_trials)),
        num_warmup_samples if num_warmup_samples is not None else num_trials_per_iter,
        early_stopping_rounds, cost_model_threads, task_name, seed,
    )
    ctx = task.ctx

    done, best_secs, best_trace = _resume(database, ctx, task.model, task.extractor, task_name)
    # The rule's horizon and the rounds it has seen: a task tuned a round at a time (the
    # pipeline's budget scheduler) or resumed passes both, so that the 5:5:6 shares and the
    # bandit's and leader's statistics span all its rounds rather than this call's.
    total_rounds = planned_rounds or math.ceil(max_trials / num_trials_per_iter)
    rounds: list[RoundOutcome] = _rounds_in(history, done)
    measurements = 0
    trials = done
    started = trials < max_trials
    if started:
        ctx.pre_tuning(
            max_trials=max_trials - trials,
            num_trials_per_iter=num_trials_per_iter,
            design_spaces=ctx.generate_design_space(),
            database=database,
            cost_model=task.model,
        )
    round_index = len(rounds) if rounds else done // num_trials_per_iter
    while trials < max_trials:
        round_start = time.time()
        strategy = selector.select(round_index, total_rounds, task.model, rounds)
        generated = _generate(task, strategy, max_trials - trials)
        if generated is None:
            logger.info("[%s] search space exhausted after %d trials", task_name, trials)
            break
        this_round = _measure(task, strategy, *generated)
        measurements += this_round.measurements
        _update(task, this_round)
        best_secs, best_trace, round_best = _record(task, this_round, best_secs, best_trace)
        failures = this_round.failures
        trials += len(this_round.candidates)
        outcome = RoundOutcome(round_index, strategy, len(this_round.candidates), round_best, best_secs,
                               failures, this_round.measurements, time.time() - round_start)
        rounds.append(outcome)
        logger.info(
            "[%s] round %d/%d %s  trials %d/%d  round best %s  best %s%s",
            task_name, round_index + 1, total_rounds, strategy.value, trials, max_trials,
            _ms(round_best), _ms(best_secs), f"  ({failures} failed)" if failures else "",
        )
        if on_round is not None:
            on_round(task_name, outcome)
        round_index += 1
    if started:
        ctx.post_tuning()
    return TaskTuningResult(
        task_name=task_name,
        selector=selector.name,
        deployed=deployed,
        trials=trials,
        measurements=measurements,
        rounds=tuple(rounds),
        best_secs=best_secs,
        best_trace=best_trace,
        wall_secs=time.time() - start,
    )


def _ms(secs: Optional[float]) -> str:
    return "n/a" if secs is None else f"{secs * 1e3:.4f} ms"
