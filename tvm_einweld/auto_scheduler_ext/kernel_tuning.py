"""Tuning every kernel of a module with the budget where the latency is, never ending a kernel
slower than its analytic schedule (what `EinweldOptimize(trials > 0)` runs on a CPU).

    module, report = tune_kernels(base, target, work_dir, trials)

`base` is a Relax module after legalisation and fusion, before the analytic schedules;
TileGraphFusion's kernels are already scheduled there, and `tile_groups` pairs each with its
group's merged function before tiling (`FusionReport.unscheduled`).

1. Tasks: MetaSchedule's task extraction on `prepare_relax(base)`, the module the analytic
   rules also schedule: structurally equal kernels are one task (`weight` = its calls). A tile
   kernel's task is its group's merged function: MetaSchedule searches the fused computation
   (its own design space: inlining, tiling, compute-at), not the tile program.
2. Baseline: each task's kernel as the 0-trial pipeline schedules it (`rules.cpu.schedule_cpu`,
   TVM's default lowering where no rule claims it; a tile kernel as TileGraphFusion scheduled
   it), timed alone (`measure.time_func`: called
   from Relax with its weights as constants, so their packing is folded at compile time and
   charged to no one). It is the baseline and the fallback, not a seed of MetaSchedule's
   population: the analytic schedules use a post-pass (fast math) and primitives outside
   MetaSchedule's design space, so their traces could not be mutated.
3. Budget (`BudgetScheduler`): trials go out in rounds of `num_trials_per_iter`, each to the
   task whose next round is expected to save the most of the module's latency: its share of
   the module's time (weight x its best time so far) times its recent relative gain (the last
   round's improvement; an untried task counts as gaining `PRIOR_GAIN`, 100 %, so tasks are
   tried largest share first, before a round goes to a task whose expected saving is less).
   A task that stops improving loses its rounds to the others, and a task too small to matter
   gets none; MetaSchedule's gradient task scheduler makes the same trade with a
   backward-window gradient. Each round of a task is one `tune_task` call; the task's
   earlier rounds and a horizon (its even share of the budget, in rounds) go with it, so the
   layout-strategy selector (5:5:6, bandit, leader) follows its rule over the task's rounds
   (without them every call looked like a task's last round: the 5:5:6 rule ran LR once and
   then LC only, the bandit NL only).
4. Choice: per task, the database's best tuned program and the analytic kernel are timed
   again, in alternating rounds (`measure.compare_modules`), and the tuned one is used only
   when faster by `MIN_KERNEL_GAIN` in nearly every round (6 of 7, more rounds when the
   medians say faster and the rounds cannot decide yet); otherwise the analytic kernel stays
   (on a 2-vCPU VM the same kernel's 2-thread time varied up to 2x between moments, so one
   timing of each picked by chance). So no kernel ends slower than at 0 trials.
5. Assembly: the chosen tuned programs go in through `MetaScheduleApplyDatabase` (a memory
   database holding just them), a chosen tuned tile-group program in place of its tile kernel
   (same parameters: both schedule the same merged function), every other kernel through
   `prepack_weights` (the analytic rules and compile-time weight packing of the 0-trial
   pipeline).

6. Variants (`tune_variants`): modules that compute the same (the einweld pipeline passes its
   module with and without the derivation's rewrites) are tuned with one budget: a kernel
   they share is one task, each module is assembled from the same choices, and the caller
   times the assembled modules whole, so a derivation chosen on 0-trial times is revisited
   on tuned ones.

Why the result computes what `base` computes: every tuned program was checked against its task
on random inputs before it was recorded (`task_loop`'s ProgramChecker; a tile group's against
its merged function, which TileGraphFusion checked against the group's operators); the analytic
kernels are the 0-trial pipeline's; the caller checks the assembled module whole against the
0-trial module and keeps it only if it is equal and measurably faster.

Not tasks: kernels another pass scheduled without leaving their unscheduled form, and kernels
with symbolic shapes; both keep what the 0-trial pipeline gives them, and the report says so.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tvm
from tvm import relax, s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.target import Target
from tvm_ffi import structural_hash

from ..tir_passes.measure import Comparison, compare_modules, kernel_module, time_func
from ..tir_passes.rules import SCHEDULED_ATTR, is_scheduled, same_code
from ..tir_passes.rules.cpu import schedule_cpu
from ..tir_passes.rules.cpu.apply import prepack_weights
from .entry_points import prepare_relax
from .selectors import make_selector
from .task_loop import default_builder, tune_task

logger = logging.getLogger("tvm_einweld.auto_scheduler_ext")

# A tuned kernel replaces the analytic one only when this much faster in nearly every round.
MIN_KERNEL_GAIN = 1.03
# The relative gain an untried task is assumed to offer (its whole time): tasks are tried
# largest latency share first.
PRIOR_GAIN = 1.0
# The least relative gain a round is assumed to offer, so a stalled task still gets a round
# when every task has stalled (they then go by latency share).
FLOOR_GAIN = 0.01


@dataclass
class TaskState:
    """One task's tuning so far: `best` is the fastest of its analytic time and its tuned
    programs (MetaSchedule's measurements), `gain` the relative improvement of its last round."""

    name: str
    mod: tvm.IRModule
    weight: int
    analytic_secs: float
    tile: bool = False  # a tile group's merged function (its baseline: the tile kernel)
    trials: int = 0
    rounds: int = 0
    best: float = 0.0
    gain: float = PRIOR_GAIN
    exhausted: bool = False
    history: tuple = ()  # its RoundOutcomes so far: what the layout-strategy selector sees

    def __post_init__(self) -> None:
        self.best = self.best or self.analytic_secs

    @property
    def latency(self) -> float:
        return self.weight * self.best


class BudgetScheduler:
    """Hands out `total` trials in rounds of `per_round` (the last may be shorter) to the task
    with the largest expected saving: latency share x recent gain (see the module docstring).
    `run(state, trials)` tunes a task up to `trials` in all and returns (trials done, best
    seconds or None)."""

    def __init__(self, states: List[TaskState], total: int, per_round: int) -> None:
        self.states = states
        self.left = total
        self.per_round = per_round

    def next_task(self) -> Optional[TaskState]:
        live = [s for s in self.states if not s.exhausted]
        if self.left <= 0 or not live:
            return None
        module = sum(s.latency for s in self.states) or 1.0
        return max(live, key=lambda s: (s.latency / module) * max(s.gain, FLOOR_GAIN))

    def run(self, tune: Callable[[TaskState, int], Tuple[int, Optional[float]]]) -> None:
        while (state := self.next_task()) is not None:
            chunk = min(self.per_round, self.left)
            done, best = tune(state, state.trials + chunk)
            spent = done - state.trials
            if spent <= 0:
                state.exhausted = True  # its search space has nothing new
                continue
            self.left -= spent
            state.trials, state.rounds = done, state.rounds + 1
            before = state.best
            if best is not None and best < state.best:
                state.best = best
            state.gain = (before - state.best) / before if before > 0 else 0.0


@dataclass(frozen=True)
class KernelChoice:
    """What one task ended with: `used` "tuned" or "analytic", with both times (seconds, timed
    alike; `tuned_secs` None when no tuned program exists) and why."""

    name: str
    weight: int
    trials: int
    analytic_secs: float
    tuned_secs: Optional[float]
    used: str
    why: str
    tile: bool = False  # a tile group: "analytic" is its tile kernel


@dataclass(frozen=True)
class TuningReport:
    """Tasks, trials spent, each task's choice, the kernels that were not tasks, and per
    variant (`tune_variants`) how many of its kernels tuned programs replaced."""

    choices: Tuple[KernelChoice, ...]
    trials: int
    budget: int
    not_tasks: Tuple[str, ...] = field(default_factory=tuple)
    applied: Tuple[int, ...] = field(default_factory=tuple)

    @property
    def tuned_kernels(self) -> int:
        return sum(c.used == "tuned" for c in self.choices)

    def describe(self) -> str:
        lines = [f"tuning: {len(self.choices)} tasks, {self.trials} of {self.budget} trials "
                 f"spent; tuned programs used for {self.tuned_kernels} "
                 f"(a tuned kernel must be {MIN_KERNEL_GAIN}x faster than the analytic one)"]
        for c in sorted(self.choices, key=lambda c: -c.weight * c.analytic_secs):
            tuned = "-" if c.tuned_secs is None else f"{c.tuned_secs * 1e6:.1f} us"
            base = "tile kernel" if c.tile else "analytic"
            lines.append(f"  {c.name} x{c.weight}: {c.trials} trials, {base} "
                         f"{c.analytic_secs * 1e6:.1f} us, tuned {tuned}: {c.used} ({c.why})")
        if self.not_tasks:
            lines.append(f"  not tasks (kept as scheduled): {', '.join(self.not_tasks)}")
        return "\n".join(lines)


def _analytic(func: tvm.tirx.PrimFunc, target: Target) -> tvm.tirx.PrimFunc:
    result = schedule_cpu(func, target)
    return func if result is None else result[1]


@dataclass(frozen=True)
class _Timer:
    """Times a task's kernels alike (`measure.time_func`): its layout-free params (weights) as
    constants, its written params as the outputs."""

    target: Target
    constants: Tuple[int, ...]
    outputs: int

    @staticmethod
    def of(func: tvm.tirx.PrimFunc, target: Target) -> "_Timer":
        from tvm import s_tir

        sch = s_tir.Schedule(func)
        written = {w.source for rv in sch.get_child_blocks(sch.get_sblock("root"))
                   for w in sch.get(rv).writes}
        outputs = sum(1 for buf in func.params if buf in written)
        free = func.attrs.get("layout_free_buffers", ()) if func.attrs is not None else ()
        return _Timer(target, tuple(int(i) for i in free), max(outputs, 1))

    def __call__(self, func: tvm.tirx.PrimFunc) -> float:
        return time_func(func, self.target, self.constants, self.outputs)

    def compare(self, before: tvm.tirx.PrimFunc, after: tvm.tirx.PrimFunc) -> Comparison:
        """Two schedules of the task's kernel in alternating rounds, `after` needing
        MIN_KERNEL_GAIN in nearly every round (`measure.compare_modules`)."""
        return compare_modules(kernel_module(before, self.constants, self.outputs),
                               kernel_module(after, self.constants, self.outputs),
                               self.target, MIN_KERNEL_GAIN)


def tune_kernels(base: tvm.IRModule, target: Target, work_dir: str, trials: int,
                 **options) -> Tuple[tvm.IRModule, TuningReport]:
    """Tune the kernels of `base` with `trials` trials in all (see the module docstring);
    `options` as for `tune_variants`. Returns the assembled module (kernels chosen, weights
    packed at compile time) and the report. Records go to a JSONDatabase in `work_dir`, so a
    cut-short run resumes."""
    modules, report = tune_variants([base], target, work_dir, trials, **options)
    return modules[0], report


def tune_variants(bases: Sequence[tvm.IRModule], target: Target, work_dir: str, trials: int,
                  *, tile_groups: Sequence[Tuple[tvm.tirx.PrimFunc, tvm.tirx.PrimFunc]] = (),
                  layout_strategy: str = "adaptive", selector=None,
                  num_trials_per_iter: int = 16, builder: Optional[ms.builder.Builder] = None,
                  runner: Optional[ms.runner.Runner] = None, seed: int = -1,
                  early_stopping_rounds: int = 50
                  ) -> Tuple[List[tvm.IRModule], TuningReport]:
    """Tune the kernels of several modules computing the same (`bases`: variants, e.g. with
    and without a derivation) with one budget of `trials`: a kernel in several variants is one
    task (its weight the most calls any variant makes), so the budget goes where the latency
    of any variant is, and the caller can compare the variants tuned. `tile_groups`: (tile
    kernel, its group's merged function) pairs of every variant. Returns one assembled module
    per variant and one report."""
    os.makedirs(work_dir, exist_ok=True)
    database = ms.database.JSONDatabase(work_dir=work_dir)
    prepared = [prepare_relax(base, None, target) for base in bases]
    states: List[TaskState] = []
    not_tasks: List[str] = []
    kernels: Dict[int, Tuple[_Timer, tvm.tirx.PrimFunc]] = {}  # id(state) -> (timer, baseline)
    by_hash: Dict[int, List[TaskState]] = {}
    for module in prepared:
        for task in ms.relax_integration.extract_tasks(module, target):
            mod, tile = task.dispatched[0], False
            if is_scheduled(mod):
                merged = _merged_of(mod["main"], tile_groups)
                if merged is None:
                    not_tasks.append(task.task_name)
                    continue
                mod, tile = tvm.IRModule({"main": _tile_task(mod["main"], merged)}), True
            same = _same_task(by_hash, mod)
            if same is not None:  # met in an earlier variant
                same.weight = max(same.weight, int(task.weight))
                continue
            try:
                timer = _Timer.of(mod["main"], target)
                baseline = task.dispatched[0]["main"] if tile else _analytic(mod["main"], target)
                baseline_secs = timer(baseline)
            except Exception as err:  # pylint: disable=broad-except  # e.g. a symbolic shape
                logger.info("%s: not a task (%s)", task.task_name, err)
                not_tasks.append(task.task_name)
                continue
            state = TaskState(task.task_name, mod, int(task.weight), baseline_secs, tile)
            states.append(state)
            by_hash.setdefault(structural_hash(mod), []).append(state)
            kernels[id(state)] = (timer, baseline)
    chosen = make_selector(layout_strategy, selector)
    builder = builder or default_builder()
    runner = runner or ms.runner.LocalRunner()

    # The selector's horizon: each task is tuned a round at a time, as the scheduler picks
    # it, so its rounds in all are not known in advance; its even share of the budget stands
    # for them (rounds beyond it count as the rule's last phase).
    horizon = max(1, math.ceil(trials / max(1, len(states)) / num_trials_per_iter))

    def tune(state: TaskState, upto: int) -> Tuple[int, Optional[float]]:
        try:
            result = tune_task(state.mod, target, database, max_trials=upto,
                               num_trials_per_iter=min(num_trials_per_iter, upto - state.trials),
                               selector=chosen, builder=builder, runner=runner,
                               early_stopping_rounds=early_stopping_rounds,
                               task_name=state.name, seed=seed, history=state.history,
                               planned_rounds=horizon)
        except Exception as err:  # pylint: disable=broad-except  # e.g. no design space
            logger.warning("%s: MetaSchedule could not tune it (%s); it keeps its kernel",
                           state.name, err)
            return state.trials, None  # nothing spent: the scheduler sets it aside
        state.history = result.rounds
        return result.trials, result.best_secs

    BudgetScheduler(states, trials, num_trials_per_iter).run(tune)

    winners = ms.database.MemoryDatabase()
    choices, tile_programs = [], []
    for state in states:
        best = _best_record(state, database)
        tuned = _scheduled(state.mod, best)
        choice = _choose(state, tuned, *kernels[id(state)])
        choices.append(choice)
        if choice.used != "tuned":
            continue
        if state.tile:
            tile_programs.append((kernels[id(state)][1], tuned))
        else:
            winners.commit_tuning_record(ms.database.TuningRecord(
                best.trace, winners.commit_workload(state.mod), best.run_secs, target,
                best.args_info))
    modules, changed = [], []
    for module in prepared:
        with target, winners:
            assembled = relax.transform.MetaScheduleApplyDatabase()(module)
        assembled = _replace_tile_kernels(assembled, tile_programs)
        changed.append(_changed_kernels(module, assembled))
        modules.append(prepack_weights(target)(assembled))
    applied = set().union(*changed)
    choices = [c if c.used != "tuned" or c.name in applied else
               KernelChoice(c.name, c.weight, c.trials, c.analytic_secs, c.tuned_secs,
                            "analytic", "the tuned program did not apply to the module",
                            c.tile)
               for c in choices]
    report = TuningReport(tuple(choices), sum(s.trials for s in states), trials,
                          tuple(dict.fromkeys(not_tasks)), tuple(map(len, changed)))
    logger.info("%s", report.describe())
    return modules, report


def _same_task(by_hash: Dict[int, List[TaskState]], mod: tvm.IRModule) -> Optional[TaskState]:
    """The task already made of a module structurally equal to `mod`, or None."""
    from tvm_ffi import structural_equal

    return next((s for s in by_hash.get(structural_hash(mod), ())
                 if structural_equal(s.mod, mod)), None)


def _merged_of(kernel: tvm.tirx.PrimFunc, tile_groups) -> Optional[tvm.tirx.PrimFunc]:
    """The merged function of the tile group whose kernel is `kernel`, or None."""
    return next((merged for tile, merged in tile_groups if same_code(tile, kernel)), None)


def _tile_task(kernel: tvm.tirx.PrimFunc, merged: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """A tile kernel's task: its group's merged function with the kernel's attributes (its
    name in the task, its layout-free parameters: TileGraphFusion scheduled that function
    into the kernel, so the parameters are the same) but not its scheduled mark."""
    attrs = {k: v for k, v in dict(kernel.attrs or {}).items() if k != SCHEDULED_ATTR}
    return merged.with_attrs(attrs)


def _replace_tile_kernels(module: tvm.IRModule, programs) -> tvm.IRModule:
    """`module` with every kernel structurally equal to the tile kernel of a (tile kernel,
    tuned program) pair of `programs` replaced by the tuned program, which takes the kernel's
    attributes (its scheduled mark, its layout-free parameters, no global symbol)."""
    programs = list(programs)
    if not programs:
        return module
    functions = dict(module.functions_items())
    for gvar, func in functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            tuned = next((t for kernel, t in programs if same_code(func, kernel)), None)
            if tuned is not None:
                functions[gvar] = _with_attrs_of(tuned, func)
    return tvm.IRModule(functions, attrs=module.attrs, global_infos=module.global_infos)


def _with_attrs_of(program: tvm.tirx.PrimFunc, kernel: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """`program` with exactly `kernel`'s attributes: a task's program carries the task's
    (its global symbol is "main", which must not reach the model's module)."""
    attrs = dict(kernel.attrs or {})
    for key in list(dict(program.attrs or {})):
        if key not in attrs:
            program = program.without_attr(key)
    return program.with_attrs(attrs) if attrs else program


def _changed_kernels(before: tvm.IRModule, after: tvm.IRModule) -> set:
    """Names of the kernels (GlobalVars) `after` replaced; extract_tasks names a task after its
    kernel (the first, for structurally equal kernels)."""
    from tvm_ffi import structural_equal

    changed = set()
    for gvar, func in after.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and not structural_equal(func, before[gvar]):
            changed.add(gvar.name_hint)
    return changed


def _best_record(state: TaskState, database: ms.database.Database
                 ) -> Optional[ms.database.TuningRecord]:
    """The task's fastest measured record, or None (no trials, or none built and ran)."""
    if state.trials == 0 or not database.has_workload(state.mod):
        return None
    top = database.get_top_k(database.commit_workload(state.mod), 1)
    return top[0] if top else None


def _scheduled(mod: tvm.IRModule, record: Optional[ms.database.TuningRecord]
               ) -> Optional[tvm.tirx.PrimFunc]:
    """The task's kernel as `record` schedules it (None without a record)."""
    if record is None:
        return None
    sch = s_tir.Schedule(mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod["main"]


def _choose(state: TaskState, tuned: Optional[tvm.tirx.PrimFunc],
            timer: _Timer, analytic: tvm.tirx.PrimFunc) -> KernelChoice:
    """The task's tuned program against its analytic kernel, both timed now in
    alternating rounds (the baseline taken before tuning only apportioned the budget): the
    tuned one must win by MIN_KERNEL_GAIN in nearly every round (a sign test), or the
    analytic one stays."""
    def made(used: str, tuned: Optional[float], why: str, analytic_secs=None) -> KernelChoice:
        return KernelChoice(state.name, state.weight, state.trials,
                            analytic_secs or state.analytic_secs, tuned, used, why, state.tile)

    if state.trials == 0:
        return made("analytic", None, "no trials: its share of the latency was too small")
    if tuned is None:
        return made("analytic", None, "no tuned program built and checked")
    try:
        verdict = timer.compare(analytic, tuned)
    except Exception as err:  # pylint: disable=broad-except  # unusable means unused
        return made("analytic", None, f"the tuned program did not run: {err}")
    if verdict.faster:
        return made("tuned", verdict.after, "faster", verdict.before)
    return made("analytic", verdict.after, f"not faster: {verdict.describe()}", verdict.before)


__all__ = ["tune_kernels", "tune_variants", "TuningReport", "KernelChoice", "BudgetScheduler", "TaskState",
           "MIN_KERNEL_GAIN"]
