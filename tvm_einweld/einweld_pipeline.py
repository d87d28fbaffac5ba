"""The whole tvm_einweld flow as one Relax pipeline, registered as "einweld".

    import tvm_einweld                      # registers the pipeline
    ex = tvm.compile(mod, "llvm", relax_pipeline="einweld")
    # or, with options:
    ex = tvm.compile(mod, target, relax_pipeline=tvm_einweld.pipeline(target, trials=64,
                                                                     work_dir="tune"))

Stages, in order:
  1. DerivationTransform (EinNet): verified rewrites of operators into cheaper programs;
  2. stock legalisation and fusion (LegalizeOps, FuseOps, FuseTIR: `tir_passes.prepare`);
  3. TileGraphFusion (Welder): fused groups with intermediates in per-tile buffers, each
     checked against the unfused kernels before it replaces them; a group is formed only when
     it beats its members' own analytic kernels;
  3b. the analytic CPU schedule rules (`tir_passes.rules.cpu`: convolutions, the GEMM class,
     memory-bound kernels) on every kernel left, constant weights packed into the kernels'
     layouts at compile time; on a GPU, TVM's default GPU schedules (DLight) on every kernel
     left (`gpu_schedules`);
  4. when `trials > 0`, adaptive-layout tuning (AL-Ansor) of every kernel (a tile group's
     as its merged function), the budget where the latency is, a tuned kernel used only where
     it beats its 0-trial one (`auto_scheduler_ext.kernel_tuning`), applied with the
     compile-time weight layout transform, and kept only when the whole tuned module equals
     the untuned one and runs faster. The derivation chose on 0-trial times, so the module
     without its rewrites (stages 2-3b on the input) is tuned with the same budget, and of
     the two tuned modules the faster one is used (`revisited` says which and why);
  5. TVM's default Relax lowering (`relax.pipeline.default_build_pipeline`), then the kernels
     linked as built (`parallel_build.PrebuiltKernels`): the final check built every kernel
     of the final module moments before, and `tvm.compile` links those instead of compiling
     them again (`lowering()`).
Every stage leaves what it cannot prove or check unchanged, so the pipeline computes what the
input module computes. Parts are checked where they are made (each rewritten subprogram, each
fused group, each tuned kernel), and the final module is run whole against the user's
(`verify.module_check`: compiled for the target, the module's own constants, random / constant /
zero / large inputs). Only if that check fails are the stages run again with the module each
returns checked whole against the one it was given: a stage whose module disagrees is dropped
with a warning naming it (the analytic schedules, one per kernel, are bisected instead: only
the kernels whose schedules make the module disagree go to stock lowering,
`verify.module_check.checked_parts`), and the final check falls back to the user's module if
the result still disagrees. (Checking every stage whole each time cost one build of the whole
model per stage: 12 s each on GCN.) `EinweldOptimize` is stages 1–4 alone, for
`tvm.transform.Sequential`; `checks` lists every whole-module check with its cost.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import tvm
from tvm import relax

from .parallel_build import PrebuiltKernels
from .threads import blas_threads
from .tir_passes.measure import compare_modules
from .verify.module_check import ModuleCheck, check_if_runnable, checked, checked_parts

# Tuned records are kept only when the whole tuned module is this much faster than the untuned
# one in nearly every one of alternating rounds (a sign test, `tir_passes.measure.compare_modules`).
MIN_TUNED_GAIN = 1.05

TargetLike = Union[str, dict, tvm.target.Target, None]
_LOG = logging.getLogger("tvm_einweld.progress")


def _resolve_target(target: TargetLike) -> tvm.target.Target:
    if target is None:
        current = tvm.target.Target.current(allow_none=True)
        if current is None:
            raise ValueError("no target given and none is current (use `with target:`)")
        target = current
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    _warn_if_generic(target)
    return target


_WARNED_GENERIC = []


def _warn_if_generic(target: tvm.target.Target) -> None:
    """Plain "llvm" is generic x86-64 (128-bit vectors): say once per process when this CPU
    has wider ones, and which target uses them (measured: a U-Net block 1.31 ms as "llvm",
    0.37 ms with the host's -mcpu)."""
    from tvm.target import codegen

    from .tir_passes.device import host_target
    from .tir_passes.rules.cpu.isa import vector_isa

    attrs = target.attrs
    if _WARNED_GENERIC or target.kind.name != "llvm" or attrs.get("mcpu") or \
            attrs.get("mattr") or attrs.get("mtriple") not in (None, "",
                                                               codegen.llvm_get_system_triple()):
        return  # a CPU was named, or another machine is compiled for
    host = host_target()
    if vector_isa(host).bits > vector_isa(target).bits:
        _WARNED_GENERIC.append(True)
        warnings.warn(f'einweld: target "llvm" is generic x86-64 ({vector_isa(target).bits}-bit '
                      f'vectors); this CPU has {vector_isa(host).bits}-bit ones. For faster '
                      f'code compile for tvm_einweld.tir_passes.device.host_target() '
                      f'(-mcpu={host.attrs["mcpu"]})', stacklevel=3)


@tvm.transform.module_pass(opt_level=0, name="EinweldOptimize")
class EinweldOptimize:
    """Stages 1–4 of the module docstring. After a run, `derivation` and `fusion` hold the
    stage objects (with their reports), `tuned` says whether tuned kernels are used,
    `tuning_check` holds the check of the tuned module against the untuned one,
    `revisited` how the derivation's rewrites fared tuned (`tuned_variant` 1: dropped),
    `tuning_report` the tasks, their trials and each kernel's choice (CPU targets),
    `tuning_seconds` the measured (untuned, tuned) module times, and `checks` every
    whole-module check of the run (stage, verdict, evidence, seconds).

    Parameters: `target` (default: the current target), `trials` (MetaSchedule trials for
    adaptive-layout tuning; 0 = no tuning), `work_dir` (tuning database; a temporary folder
    when not given), `derive` / `fuse` (turn stages off), `layout_strategy` ("adaptive",
    "NL", "LR", "LC"), `measure` (False: every choice by the cost model at the target's
    nominal peaks, nothing timed while compiling, so the same model and target always give
    the same program; see `cost_model`. Tuning, when trials > 0, is measurement by nature:
    the tuned module is still timed against the untuned one), and option dicts passed to
    DerivationTransform / TileGraphFusion / the tuner.
    """

    def __init__(self, target: TargetLike = None, trials: int = 0, work_dir: Optional[str] = None,
                 derive: bool = True, fuse: bool = True, layout_strategy: str = "adaptive",
                 derive_options: Optional[Dict[str, Any]] = None,
                 fuse_options: Optional[Dict[str, Any]] = None,
                 tune_options: Optional[Dict[str, Any]] = None, measure: bool = True) -> None:
        self.target = target
        self.measure = measure
        self.trials = int(trials)
        self.work_dir = work_dir
        self.derive = derive
        self.fuse = fuse
        self.layout_strategy = layout_strategy
        self.derive_options = dict(derive_options or {})
        self.fuse_options = dict(fuse_options or {})
        self.tune_options = dict(tune_options or {})
        self.derivation = None
        self.fusion = None
        self.rules = None  # the analytic CPU rules pass of the last run (`.scheduled`)
        self.tuned = False
        self.tuned_variant = 0  # 1: the tuned module without the derivation's rewrites won
        self.revisited: Optional[str] = None  # how the derivation fared tuned (trials > 0)
        self.tuning_check: Optional[ModuleCheck] = None
        self.tuning_seconds = None  # (untuned, tuned) seconds of the whole module
        self.tuning_report = None  # per task: trials, analytic vs tuned time, the choice
        self.checks: List[ModuleCheck] = []
        self.stage_seconds: Dict[str, float] = {}  # wall time of each stage of the last run

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        target = _resolve_target(self.target)
        self.checks = []
        self.stage_seconds = {}
        self.tuned, self.tuning_check, self.tuning_seconds, self.tuning_report = (False, None,
                                                                                 None, None)
        self.tuned_variant, self.revisited = 0, None
        clock = _StageClock(self.stage_seconds)
        # The stages time kernels on TVM's pool between numpy calls of their own (references,
        # checks): OpenBLAS's spinning threads would stall those timings (threads.py).
        with target, blas_threads(1):
            # Optimistic: the stages check their parts, the final module is checked whole
            # against the user's (two builds instead of one per stage). Only when that check
            # fails are the stages run again, each checked whole, so that the one at fault is
            # found and dropped (its input kept) and the rest still apply.
            out = self._stages(mod, target, clock, check_stages=False)
            if out is mod:
                return out
            with clock("final check"):
                result = check_if_runnable("einweld pipeline", mod, out, target)
            if result.equal:  # (a check that could not run here counts as equal, not run)
                self.checks.append(result)
                return out
            warnings.warn(f"einweld pipeline: the optimised module disagrees with the given one "
                          f"({result.evidence}); running the stages again, each checked whole, "
                          f"to drop the one at fault")
            self.checks = [result]
            out = self._stages(mod, target, clock, check_stages=True)
            with clock("final check"):
                # Stage by stage each module agreed with its input within tolerance; the errors
                # of several stages add up, so the result is held against the user's too.
                return checked("einweld pipeline", mod, out, target, self.checks)

    def _stages(self, mod: tvm.IRModule, target: tvm.target.Target, clock: "_StageClock",
                check_stages: bool) -> tvm.IRModule:
        """Stages 1-4 on `mod`; with `check_stages`, the module each returns is checked whole
        against its input (a stage that disagrees is dropped), else only their parts are."""
        from .relay_passes.derivation_transform import DerivationTransform

        if self.derive:
            with clock("derivation"):
                options = {"target": target, "measure": self.measure,
                           "check_whole": check_stages, **self.derive_options}
                self.derivation = DerivationTransform(**options)
                derived = self.derivation(mod)
                self.checks += self.derivation.checks
        else:
            derived = mod
        lowered = self._lower(derived, target, clock, check_stages)
        self.fusion, self.rules = lowered.fusion, lowered.rules
        if self.trials <= 0:
            return lowered.scheduled
        variants = [lowered]
        if not derived.same_as(mod) and target.kind.name == "llvm":
            # The derivation chose on 0-trial times; the module without its rewrites is
            # tuned with the same budget and the two compared tuned (`_tune`). (`same_as`: a
            # pass returns a new Python object even for the module it was given.)
            variants.append(self._lower(mod, target, clock, check_stages,
                                        " (without the derivation)"))
        with clock("tuning"):
            return self._tune(variants, target)

    def _lower(self, mod: tvm.IRModule, target: tvm.target.Target, clock: "_StageClock",
               check_stages: bool, label: str = "") -> "_Lowered":
        """Stages 2-3b on `mod` (`label` names them in the stage times)."""
        from .cost_model import nominal_device
        from .tir_passes import TileGraphFusion, prepare
        from .tir_passes.rules.cpu import ApplyCPURules
        from .tir_passes.rules.cpu.apply import prepack_weights

        given, fusion, rules = mod, None, None
        with clock("legalize and fuse (stock)" + label):
            mod = tvm.transform.Sequential([
                relax.transform.DecomposeOpsForInference(),
                relax.transform.CanonicalizeBindings(),
                prepare(),
            ])(mod)
        if self.fuse:
            with clock("tile-graph fusion" + label):
                # Fused groups are checked against the module before stock legalisation,
                # whose build and outputs the derivation's check (or the final one) uses.
                options = {"reference": given, "check_whole": check_stages}
                if not self.measure:
                    options.update(measure=False, device=nominal_device(target))
                fusion = TileGraphFusion(target, **{**options, **self.fuse_options})
                mod = fusion(mod)
                self.checks += fusion.checks
        unscheduled = mod  # the tuning tasks (a tile group's: `fusion.report.unscheduled`)
        if "gpu" in target.keys:
            with clock("default GPU schedules" + label):
                mod = gpu_schedules(target)(mod)
        if target.kind.name == "llvm":
            with clock("analytic schedules" + label):
                # Constant weights are packed into the kernels' layouts at compile time.
                made = {}  # kernels left out -> (the rules pass, its module), each made once

                def schedule(skip=frozenset()):
                    if skip not in made:
                        rules = ApplyCPURules(target, skip=skip)
                        made[skip] = rules, prepack_weights(target, scheduler=rules)(unscheduled)
                    return made[skip][1]

                mod = schedule()
                rules = made[frozenset()][0]
                if check_stages:
                    # A kernel whose schedule makes the module disagree is left to stock
                    # lowering; the other kernels keep theirs.
                    mod, skipped = checked_parts("analytic CPU schedules", unscheduled,
                                                 schedule, sorted(rules.scheduled), target,
                                                 self.checks)
                    rules = made[frozenset(skipped)][0]
        return _Lowered(unscheduled, mod, fusion, rules)

    def _tune(self, variants: List["_Lowered"], target: tvm.target.Target) -> tvm.IRModule:
        """On a CPU every kernel of every variant's `unscheduled` module is a task, tuned with
        the budget where the latency is and kept only where faster than its 0-trial kernel
        (`auto_scheduler_ext.kernel_tuning.tune_variants`); elsewhere (no analytic rules) the
        kernels of the first variant are tuned with equal shares
        (`adaptive_layout_tuning_pass`). Each tuned variant is checked whole against the
        0-trial module (the first variant's); the faster of two tuned variants (the second
        needing MIN_TUNED_GAIN: the derivation's own choice stands unless clearly beaten) is
        then kept only if it beats the 0-trial module by MIN_TUNED_GAIN."""
        from .auto_scheduler_ext import entry_points, kernel_tuning
        from .machine import cpu_cores

        spec = dict(target.export())
        if spec["kind"] == "llvm" and "num-cores" not in spec:
            # MetaSchedule needs the core count; plain "llvm" means this machine.
            target = tvm.target.Target({**spec, "num-cores": cpu_cores()})
        work_dir = self.work_dir or tempfile.mkdtemp(prefix="einweld_tune_")
        os.makedirs(work_dir, exist_ok=True)  # MetaSchedule's database does not create it
        untuned = variants[0].scheduled
        if target.kind.name == "llvm":
            tiles = [pair for v in variants if v.fusion is not None and v.fusion.report
                     for pair in v.fusion.report.unscheduled]
            tuned, self.tuning_report = kernel_tuning.tune_variants(
                [v.unscheduled for v in variants], target, work_dir, self.trials,
                tile_groups=tiles, layout_strategy=self.layout_strategy,
                **self.tune_options)
            tuned = [(i, m) for i, m in enumerate(tuned) if self.tuning_report.applied[i]]
        else:
            stage = entry_points.adaptive_layout_tuning_pass(
                target, work_dir, self.trials, layout_strategy=self.layout_strategy,
                **self.tune_options)
            # The tasks are the kernels before the default GPU schedules; those left untuned
            # get them after (`gpu_schedules`).
            tuned_mod = stage(variants[0].unscheduled)
            if "gpu" in target.keys:
                tuned_mod = gpu_schedules(target)(tuned_mod)
            tuned = [(0, tuned_mod)]
        # Each record was checked alone; each whole tuned module (with its compile-time weight
        # layout transforms, which stock TVM 0.27 gets wrong for some tuned ConvTranspose
        # kernels) is checked against the untuned one before it is used.
        kept = []
        for index, module in tuned:
            before = len(self.checks)
            if checked("tuning", untuned, module, target, self.checks) is module:
                kept.append((index, module))
            self.tuning_check = self.checks[-1] if len(self.checks) > before else None
        if not kept:
            return untuned
        pipeline = relax.pipeline.default_build_pipeline()
        index, best = kept[0]
        variants_compared = None
        if len(kept) == 2:
            variants_compared = compare_modules(best, kept[1][1], target, MIN_TUNED_GAIN,
                                                pipeline=pipeline)
            if variants_compared.faster:
                index, best = kept[1]
        # A small budget spread over many tasks can leave kernels worse than the untuned
        # (tile-scheduled) ones: the records are kept only when the whole module gains.
        verdict = compare_modules(untuned, best, target, MIN_TUNED_GAIN, pipeline=pipeline)
        self.tuning_seconds = (verdict.before, verdict.after)
        if len(variants) == 2:
            self.revisited = _revisited(verdict.faster and index == 1, variants_compared)
        if not verdict.faster:
            warnings.warn(f"EinweldOptimize: the tuned module is not faster ({verdict.describe()}"
                          f" needed); the tuning records are not used")
            return untuned
        self.tuned, self.tuned_variant = True, index
        return best


def gpu_schedules(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's default GPU schedules (DLight, the rules of TVM's own CUDA pipeline) for every
    kernel not scheduled yet (tile kernels keep theirs), then a check that none is left
    without one: TVM 0.27 builds a kernel without thread bindings for a GPU target as host
    code, which reads device memory from the CPU, and the library segfaults when run (FSRCNN
    and DCGAN on an H200, where a phase-interleave kernel was left unfused). A kernel no rule
    schedules raises here instead of being emitted."""
    from tvm.s_tir import dlight as dl

    from .tir_passes.rules import is_scheduled

    @tvm.transform.module_pass(opt_level=0, name="EinweldGPUSchedules")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                          dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
        left = sorted(gv.name_hint for gv, f in mod.functions.items()
                      if isinstance(f, tvm.tirx.PrimFunc) and not is_scheduled(f))
        if left:
            raise RuntimeError(f"no GPU schedule for kernels {left}: built for {target.kind.name}"
                               f" they would run on the host over device memory")
        return mod

    return _pass


def _revisited(dropped: bool, compared) -> str:
    """What became of the derivation's rewrites after tuning (`EinweldOptimize.revisited`):
    `dropped` when the module used is the one without them; `compared`, the two tuned
    modules timed whole (None when only one of them had tuned kernels that passed)."""
    line = f"the derivation's rewrites were {'dropped' if dropped else 'kept'}"
    if compared is None:
        return line + " (only one of the two modules gained tuned kernels)"
    return line + (f" (tuned with them {compared.before * 1e3:.3f} ms, without "
                   f"{compared.after * 1e3:.3f} ms)")


@dataclass(frozen=True)
class _Lowered:
    """One module through stages 2-3b: before the analytic schedules (the tuning tasks), after
    them, and the stage objects (their reports)."""

    unscheduled: tvm.IRModule
    scheduled: tvm.IRModule
    fusion: Any
    rules: Any


class _StageClock:
    """`with clock(name):` adds the wall time of the block to `seconds[name]` and logs
    (logger "tvm_einweld.progress", INFO: the CLI shows it on stderr) that the stage started
    and how long it took, so a long compile is not silent."""

    def __init__(self, seconds: Dict[str, float]) -> None:
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        _LOG.info("%s ...", name)
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + spent
            _LOG.info("%s: %.1f s", name, spent)


def tuning_summary(stages: "EinweldOptimize") -> str:
    """One line that says whether `stages` used tuned kernels, and why not (the demo prints it,
    the benchmark runner records it)."""
    if stages.trials <= 0:
        return "off (0 trials)"
    head = f"{stages.trials} trials, {stages.layout_strategy}: "
    report = stages.tuning_report
    if report is not None:
        tiles = sum(c.tile for c in report.choices)
        head += (f"{len(report.choices)} tasks ({tiles} of them tile groups), {report.trials} "
                 f"trials spent, {report.tuned_kernels} tuned kernels faster than their "
                 f"0-trial ones; ")
        if not report.choices:
            return head + (f"tuned kernels NOT used: no kernel to tune (kernels that keep "
                           f"their schedules: {', '.join(report.not_tasks) or 'none'})")
        if report.tuned_kernels == 0:
            return head + "tuned kernels NOT used: none beat its 0-trial kernel"
    if getattr(stages, "revisited", None):
        head += stages.revisited + "; "
    if stages.tuned:
        untuned, tuned = stages.tuning_seconds
        return head + (f"tuned kernels used ({tuned * 1e3:.3f} ms vs {untuned * 1e3:.3f} ms "
                       f"untuned)")
    check = stages.tuning_check
    if check is not None and not check.equal:
        return head + f"tuned kernels NOT used: the tuned module disagreed ({check.evidence})"
    if stages.tuning_seconds is not None:
        untuned, tuned = stages.tuning_seconds
        return head + (f"tuned kernels NOT used: not faster ({tuned * 1e3:.3f} ms vs "
                       f"{untuned * 1e3:.3f} ms untuned)")
    return head + "tuned kernels NOT used (tuning produced no change)"


def lowering() -> tvm.transform.Pass:
    """What follows `EinweldOptimize` in a `relax_pipeline`: TVM's default Relax lowering, then
    the kernels linked from those already built in this process (`PrebuiltKernels`; any not
    built yet are built there, in parallel)."""
    return tvm.transform.Sequential([relax.pipeline.default_build_pipeline(),
                                     PrebuiltKernels()], name="einweld_lowering")


def pipeline(target: TargetLike = None, bind_outputs: bool = False,
             **options: Any) -> tvm.transform.Pass:
    """The "einweld" Relax pipeline: `EinweldOptimize(target, **options)` then `lowering()`,
    ready for `tvm.compile(mod, target, relax_pipeline=...)`. With `bind_outputs`, `main`
    takes a buffer for each of its results after its inputs and writes them there
    (`relay_passes.output_buffers.BindOutputs`): `vm["main"](x, out)`, no allocation per call."""
    from .relay_passes.output_buffers import BindOutputs

    stages = [EinweldOptimize(target, **options)] + ([BindOutputs()] if bind_outputs else [])
    return tvm.transform.Sequential(stages + [lowering()], name="einweld")


def register() -> None:
    """Register `pipeline` as "einweld" (idempotent)."""
    if "einweld" not in relax.pipeline.PIPELINE_MAP:
        relax.pipeline.register_pipeline("einweld")(pipeline)
