"""The "einweld" Relax pipeline: registered on import, and equal to the stock build."""
import numpy as np
import pytest
import tvm
from tvm import relax

from conftest import run_vm
import tvm_einweld
from tvm_einweld.commands.demo import builtin_model


def test_pipeline_is_registered_under_its_name():
    assert "einweld" in relax.pipeline.PIPELINE_MAP
    assert isinstance(relax.get_pipeline("einweld"), tvm.transform.Pass)


def test_pipeline_matches_the_stock_build(rng):
    mod = builtin_model(channels=8, size=10)
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    expected = run_vm(mod, x)
    ex = tvm.compile(mod, "llvm", relax_pipeline=tvm_einweld.pipeline(fuse_options={"topk": 2}))
    np.testing.assert_allclose(run_vm(ex, x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_pipeline_with_tuning_matches_the_stock_build(tmp_path, rng):
    """trials > 0: the kernels are tuned with layout strategies (fusion off, so every kernel
    is a task, its analytic kernel the baseline) and the build, tuned kernels where they won,
    weights prepacked, still equals the stock build."""
    mod = builtin_model(channels=8, size=10)
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    expected = run_vm(mod, x)
    stages = tvm_einweld.EinweldOptimize(trials=8, work_dir=str(tmp_path), derive=False,
                                         fuse=False)
    ex = tvm.compile(mod, "llvm", relax_pipeline=tvm.transform.Sequential(
        [stages, relax.pipeline.default_build_pipeline()]))
    report = stages.tuning_report
    assert report.trials <= 8 and any(tmp_path.iterdir())
    # Every kernel is a task (no tile groups here), each with its analytic time and a choice.
    assert {c.used for c in report.choices} <= {"tuned", "analytic"} and report.choices
    assert report.tuned_kernels == 0 or stages.tuning_check.equal
    if stages.tuned:  # used only when faster by the margin (in nearly every round)
        before, after = stages.tuning_seconds
        assert after * tvm_einweld.einweld_pipeline.MIN_TUNED_GAIN < before
    np.testing.assert_allclose(run_vm(ex, x), expected, rtol=1e-4, atol=1e-4)


# A rewrite forced whatever the machine: the cheapest derived candidate is taken
# (min_speedup=0, no measured confirmation) from a search bounded by states, not seconds
# (measure=False), so a slow or busy machine finds the same candidates (CI's once chose an
# eOperator that the time-bounded search here never reached).
FORCED_REWRITE = {"min_speedup": 0.0, "confirm_by_measurement": False, "measure": False}


def test_derived_kernels_survive_the_tuning_stage_preparation(rng, fresh_decisions):
    """The tuning stage legalises and fuses the derived module again (FuseTIR copies a
    kernel's global symbol into the kernel it makes): the result must still build and equal
    the stock build. A rewrite is forced (min_speedup=0, no measured confirmation) so
    eOperators are in the module."""
    from tvm_einweld.auto_scheduler_ext.entry_points import prepare_relax

    mod = builtin_model(channels=8, size=10)
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    expected = run_vm(mod, x)
    stages = tvm_einweld.EinweldOptimize("llvm", fuse=False,
                                         derive_options=FORCED_REWRITE)
    derived = stages(mod)
    assert any(r.applied for r in stages.derivation.last_results)
    target = tvm.target.Target("llvm")
    ex = tvm.compile(prepare_relax(derived, None, target), target)
    np.testing.assert_allclose(run_vm(ex, x), expected, rtol=1e-4, atol=1e-4)


def _doubled(mod):
    """`mod` whose main returns twice what it did."""
    funcs = {gv: f for gv, f in mod.functions_items() if gv.name_hint != "main"}
    bb = relax.BlockBuilder(tvm.IRModule(funcs))
    inner = bb.add_func(mod["main"].without_attr("global_symbol"), "inner")
    x = relax.Var("x", mod["main"].params[0].ty)
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.Call(inner, [x]))
            out = bb.emit_output(relax.op.multiply(y, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def test_only_the_final_module_is_checked_whole_when_it_agrees(rng):
    """The stages check their parts; the module the pipeline returns is built and run whole
    against the user's once (not once per stage)."""
    mod = builtin_model(channels=8, size=10)
    stages = tvm_einweld.EinweldOptimize("llvm", fuse_options={"topk": 2})
    stages(mod)
    assert [c.stage for c in stages.checks] == ["einweld pipeline"]
    assert stages.checks[0].equal


def test_a_wrong_stage_is_found_and_dropped_when_the_final_check_fails(monkeypatch, rng):
    """Planted fault: the analytic-schedules stage returns a module computing twice the
    result. The final check catches it, the stages run again each checked whole, that stage
    is dropped (its input kept) and the module returned computes what the user's does."""
    from tvm_einweld.tir_passes.rules.cpu import apply

    real = apply.prepack_weights

    def planted(target, rules=None, scheduler=None):
        stage = real(target, rules, scheduler)
        return tvm.transform.module_pass(lambda m, _ctx: _doubled(stage(m)), opt_level=0,
                                         name="PlantedWrongSchedules")

    monkeypatch.setattr(apply, "prepack_weights", planted)
    mod = builtin_model(channels=8, size=10)
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    stages = tvm_einweld.EinweldOptimize("llvm", derive=False, fuse_options={"topk": 2})
    with pytest.warns(UserWarning, match="running the stages again"):
        out = stages(mod)
    verdicts = [(c.stage, c.equal) for c in stages.checks]
    assert verdicts[0] == ("einweld pipeline", False)
    assert ("analytic CPU schedules", False) in verdicts
    assert verdicts[-1] == ("einweld pipeline", True)
    np.testing.assert_allclose(run_vm(out, x), run_vm(mod, x), rtol=1e-4, atol=1e-4)


def _zero_inits_to_one(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """`func` with every float constant 0 stored as 1 (a reduction's init: each output off)."""
    text = func.script()
    assert "T.float32(0.0)" in text
    return tvm.script.from_source(text.replace("T.float32(0.0)", "T.float32(1.0)"))


def test_a_wrong_kernel_schedule_is_left_out_alone(monkeypatch, rng):
    """Planted fault in one kernel: the analytic schedule of the GEMM rule starts its
    reduction at 1 instead of 0 in one kernel. The final check catches it; the stages run
    again, the analytic stage's kernels are bisected, that kernel alone is left to stock
    lowering (named in a warning) and every other kernel keeps its schedule."""
    from tvm_einweld.tir_passes.rules import cpu

    real, planted_in = cpu.schedule_cpu, []

    def planted(func, target, families=None):
        result = real(func, target, families)
        if result is None or result[0] != "gemm" or "matmul" not in str(func):
            return result
        planted_in.append(True)
        return result[0], _zero_inits_to_one(result[1])

    monkeypatch.setattr(cpu, "schedule_cpu", planted)
    mod = builtin_model(channels=8, size=10)
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    stages = tvm_einweld.EinweldOptimize("llvm", derive=False, fuse=False)
    with pytest.warns(UserWarning, match=r"left out the parts at fault \(matmul"):
        out = stages(mod)
    assert planted_in
    scheduled = stages.rules.scheduled
    assert not any(name.startswith("matmul") for name in scheduled)
    assert {"conv", "gemm"} <= set(scheduled.values())  # the other kernels keep theirs
    assert stages.checks[-1].stage == "einweld pipeline" and stages.checks[-1].equal
    np.testing.assert_allclose(run_vm(out, x), run_vm(mod, x), rtol=1e-4, atol=1e-4)


def _planted_tuning(monkeypatch, module_of):
    """Replace the CPU tuning stage by one returning `module_of(untuned analytic module)` for
    each variant and a report that claims one tuned kernel in each (nothing is tuned: the
    planted modules are what the pipeline's own checks must judge). Returns the list of the
    variant counts it was called with."""
    from tvm_einweld.auto_scheduler_ext import kernel_tuning
    from tvm_einweld.auto_scheduler_ext.kernel_tuning import KernelChoice, TuningReport
    from tvm_einweld.tir_passes.rules.cpu.apply import prepack_weights

    calls = []

    def planted(bases, target, work_dir, trials, **kwargs):
        calls.append(len(bases))
        choice = KernelChoice("k", 1, trials, 2e-6, 1e-6, "tuned", "faster")
        return ([module_of(prepack_weights(target)(base)) for base in bases],
                TuningReport((choice,), trials, trials, (), (1,) * len(bases)))

    monkeypatch.setattr(kernel_tuning, "tune_variants", planted)
    return calls


def _planted_comparisons(monkeypatch, *faster):
    """Planted timings: the n-th whole-module comparison of the tuning stage finds its second
    module twice as fast in every round when `faster[n]`, twice as slow otherwise."""
    from tvm_einweld import einweld_pipeline
    from tvm_einweld.tir_passes.measure import Comparison

    verdicts = iter(faster)
    monkeypatch.setattr(einweld_pipeline, "compare_modules",
                        lambda before, after, target, ratio, rounds=7, **kw: Comparison(
                            2.0, 1.0, rounds, rounds, ratio) if next(verdicts) else
                        Comparison(1.0, 2.0, rounds, 0, ratio))


@pytest.mark.parametrize("without_wins", [True, False], ids=["dropped", "kept"])
def test_the_derivation_is_revisited_with_tuned_times(tmp_path, monkeypatch, rng, without_wins,
                                                      fresh_decisions):
    """trials > 0 after a derivation rewrote the model: the module without its rewrites is
    lowered and tuned too (one tuning call, two variants), the two tuned modules are compared
    whole, and the faster is used: planted timings make the one without the rewrites win (or
    lose); either way the module computes what the model computes and the summary says
    which."""
    from tvm_einweld.einweld_pipeline import tuning_summary

    calls = _planted_tuning(monkeypatch, lambda m: m)
    _planted_comparisons(monkeypatch, without_wins, True)  # then: it beats 0 trials
    mod = builtin_model(channels=8, size=10)
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    stages = tvm_einweld.EinweldOptimize("llvm", trials=4, work_dir=str(tmp_path), fuse=False,
                                         derive_options=FORCED_REWRITE)
    out = stages(mod)
    assert any(r.applied for r in stages.derivation.last_results)
    assert calls == [2] and stages.tuned
    assert stages.tuned_variant == (1 if without_wins else 0)
    word = "dropped" if without_wins else "kept"
    assert f"the derivation's rewrites were {word}" in tuning_summary(stages)
    np.testing.assert_allclose(run_vm(out, x), run_vm(mod, x), rtol=1e-4, atol=1e-4)


def test_a_wrong_tuned_module_is_not_used(tmp_path, monkeypatch, rng):
    """Planted fault: the tuning stage returns a module that computes something else (as stock
    TVM's weight pre-packing does for some tuned ConvTranspose kernels). The pipeline must
    notice, warn and keep the untuned module."""
    _planted_tuning(monkeypatch, _doubled)
    mod = builtin_model(channels=8, size=10)
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    expected = run_vm(mod, x)
    stages = tvm_einweld.EinweldOptimize(trials=8, work_dir=str(tmp_path), derive=False,
                                         fuse=False)
    with pytest.warns(UserWarning, match="disagrees"):
        ex = tvm.compile(mod, "llvm", relax_pipeline=tvm.transform.Sequential(
            [stages, relax.pipeline.default_build_pipeline()]))
    assert not stages.tuned and not stages.tuning_check.equal
    np.testing.assert_allclose(run_vm(ex, x), expected, rtol=1e-4, atol=1e-4)


def test_a_slower_tuned_module_is_not_used(tmp_path, monkeypatch):
    """Planted timings: the tuned module measures slower than the untuned one in all rounds
    but one, so the pipeline keeps the untuned kernels (and says so)."""

    from tvm_einweld.einweld_pipeline import tuning_summary
    from tvm_einweld.tir_passes import measure

    _planted_tuning(monkeypatch, lambda m: tvm.IRModule(dict(m.functions_items()), attrs=m.attrs))
    rounds = [[1.0, 2.0]] * 6 + [[2.0, 1.0]]  # one lucky round of the tuned module
    monkeypatch.setattr(measure, "module_rounds", lambda mods, target, rounds_=7, **kw: rounds)
    mod = builtin_model(channels=8, size=10)
    stages = tvm_einweld.EinweldOptimize("llvm", trials=4, work_dir=str(tmp_path),
                                         derive=False, fuse=False)
    with pytest.warns(UserWarning, match="not faster"):
        stages(mod)
    assert stages.tuning_check.equal and not stages.tuned
    assert stages.tuning_seconds == (1.0, 2.0)
    assert "1 tasks (0 of them tile groups), 4 trials spent" in tuning_summary(stages)
    assert "NOT used: not faster" in tuning_summary(stages)


def test_a_noisy_gain_is_not_a_gain():
    """`Comparison.faster` needs the medians apart by the ratio and a win in every round but
    at most one: a 10 % median gain that loses 2 of 7 rounds is noise, not a gain."""
    from tvm_einweld.tir_passes.measure import Comparison

    assert Comparison(1.0, 0.9, rounds=7, wins=6, min_ratio=1.05).faster
    assert not Comparison(1.0, 0.9, rounds=7, wins=5, min_ratio=1.05).faster
    assert not Comparison(1.0, 0.97, rounds=7, wins=7, min_ratio=1.05).faster


_COMPILE_AND_HASH = """
import sys, tvm, tvm_einweld
from tvm_ffi import structural_hash
from tvm_einweld.commands.demo import builtin_model
from tvm_einweld.tir_passes.device import host_target
mod = builtin_model(channels=8, size=10)
stages = tvm_einweld.EinweldOptimize(host_target(), fuse_options={"topk": 2})
print(structural_hash(stages(mod)))
"""


def test_the_same_model_compiles_to_the_same_program_in_fresh_processes(tmp_path):
    """Decisions are measured once and cached on disk (keyed by the operator or subprogram,
    target and package version), so a second compile in a fresh process, with the first's
    cache, makes every choice the same way: the optimised modules are identical."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TVM_EINWELD_CACHE=str(tmp_path / "cache"))
    hashes = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COMPILE_AND_HASH], env=env,
                             capture_output=True, text=True, timeout=900, check=True)
        hashes.append(out.stdout.strip().splitlines()[-1])
    assert hashes[0] == hashes[1]


_COMPILE_WITHOUT_MEASURING = """
import tvm, tvm_einweld
from tvm_ffi import structural_hash
from tvm_einweld import machine
from tvm_einweld.commands.demo import builtin_model
from tvm_einweld.relay_passes import op_cost
from tvm_einweld.tir_passes import device
from tvm_einweld.tir_passes.device import host_target

timed = []  # every way the package times anything, counted instead of run
def count(name):
    def timer(*args, **kwargs):
        timed.append(name)
        raise RuntimeError("timed")
    return timer
machine.best_seconds = op_cost.best_seconds = count("best_seconds")
machine.measure_machine = count("measure_machine")
device._copy_bandwidth = count("copy_bandwidth")
tvm.runtime.Module.time_evaluator = count("time_evaluator")

mod = builtin_model(channels=8, size=10)
stages = tvm_einweld.EinweldOptimize(host_target(), measure=False)
out = stages(mod)
changed = sum(r.applied for r in stages.derivation.last_results) + len(stages.fusion.report.replaced)
print(len(timed), changed, all(c.equal for c in stages.checks if c.ran), structural_hash(out))
"""


def test_measure_false_compiles_the_same_program_without_timing_anything(tmp_path):
    """`measure=False`: every choice by the cost model at the target's nominal peaks. Two
    compiles in fresh processes, each with its own empty cache, time nothing at all (every
    timer of the package is replaced by a counter) and return the same program, which still
    made choices (rewrites or fused groups) and passed its whole-module checks."""
    import os
    import subprocess
    import sys

    results = []
    for run_ in range(2):
        env = dict(os.environ, TVM_EINWELD_CACHE=str(tmp_path / f"cache{run_}"))
        out = subprocess.run([sys.executable, "-c", _COMPILE_WITHOUT_MEASURING], env=env,
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-2000:]
        results.append(out.stdout.strip().splitlines()[-1].split())
    for timed, changed, checked, _ in results:
        assert timed == "0", f"{timed} timings"
        assert int(changed) > 0 and checked == "True"
    assert results[0][3] == results[1][3]


def test_plain_llvm_on_a_wider_host_says_so_once(monkeypatch):
    """`tvm.compile(mod, "llvm", relax_pipeline="einweld")` names the faster host target once
    per process when this CPU has wider vectors than generic x86-64; a target with -mcpu or
    another machine's triple is taken as meant."""
    import warnings

    from tvm_einweld import einweld_pipeline
    from tvm_einweld.tir_passes.device import host_target
    from tvm_einweld.tir_passes.rules.cpu.isa import vector_isa

    monkeypatch.setattr(einweld_pipeline, "_WARNED_GENERIC", [])
    wider = vector_isa(host_target()).bits > vector_isa(tvm.target.Target("llvm")).bits
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for target in ("llvm", "llvm", host_target(),
                       tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})):
            einweld_pipeline._resolve_target(target)
    said = [str(w.message) for w in seen if "generic x86-64" in str(w.message)]
    assert len(said) == (1 if wider else 0)
    if wider:
        assert host_target().attrs["mcpu"] in said[0]


def test_without_a_rewrite_one_module_is_tuned(tmp_path, monkeypatch, fresh_decisions):
    """No rewrite applied (a speedup no candidate reaches): nothing to revisit, so the tuning
    stage gets one module, not the same module twice."""
    calls = _planted_tuning(monkeypatch, lambda m: m)
    _planted_comparisons(monkeypatch, True)
    stages = tvm_einweld.EinweldOptimize("llvm", trials=4, work_dir=str(tmp_path), fuse=False,
                                         derive_options={"min_speedup": 1e9})
    stages(builtin_model(channels=8, size=10))
    assert not any(r.applied for r in stages.derivation.last_results)
    assert calls == [1] and stages.revisited is None and stages.tuned_variant == 0


def test_an_undecided_comparison_takes_more_rounds():
    """Planted round times: the medians say 10 % faster but 5 of 7 rounds won, so 7 more
    rounds are timed; the gain is kept when 14 rounds decide it (12 wins), dropped when 21
    still do not (13 wins); a clear win or loss stops at 7."""
    from tvm_einweld.tir_passes import measure

    def compare(afters):
        times = iter(afters)  # the second module's seconds, round by round; the first's: 1.0
        calls = [lambda: 1.0, lambda: next(times)]
        samples = measure.alternate(calls, 7, lambda call: call(),
                                    lambda s: measure.paired(s, 1.05).undecided,
                                    measure.MAX_ROUNDS)
        return measure.paired(samples, 1.05)

    win, lose = 0.9, 1.0
    first = [win] * 5 + [lose] * 2
    decided = compare(first + [win] * 7)
    assert (decided.rounds, decided.wins, decided.faster) == (14, 12, True)
    noisy = compare(first + ([win] * 4 + [lose] * 3) * 2)
    assert (noisy.rounds, noisy.wins, noisy.faster) == (21, 13, False)
    clear = compare([win] * 7)
    assert (clear.rounds, clear.faster) == (7, True)
    slower = compare([1.1] * 7)
    assert (slower.rounds, slower.faster, slower.undecided) == (7, False, False)
