"""The adaptive tuning loop: rule-following rounds, surviving failures, resuming, Relax apply."""
import dataclasses
import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import PyBuilder
from tvm.s_tir.meta_schedule.runner import PyRunner

from conftest import compile_vm
from tvm_einweld.auto_scheduler_ext import comparison, entry_points, tune_tir
from tvm_einweld.auto_scheduler_ext.build_fn import build_cpu_kernel
from tvm_einweld.auto_scheduler_ext.strategies import Strategy, strategy_of, tagged_workload
from tvm_einweld.auto_scheduler_ext.task_loop import default_builder, tune_task
from tvm_einweld.auto_scheduler_ext.workloads import Conv2dBlock

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
BLOCK = Conv2dBlock(1, 8, 8, 8, 8, 3, 1, 1)
# Small search: tests check behaviour, not the quality of the schedules.
SEARCH = ms.search_strategy.EvolutionarySearch(population_size=16, init_min_unmeasured=4, genetic_num_iters=1)
FAST = dict(search=SEARCH, early_stopping_rounds=5, seed=7)


@derived_object
class FlakyBuilder(PyBuilder):
    """Raises on the chosen calls, builds normally otherwise."""

    def __init__(self, fail_calls):
        super().__init__()
        self.inner = default_builder(max_workers=1)
        self.fail_calls = set(fail_calls)
        self.calls = 0

    def build(self, build_inputs):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError("planted builder crash")
        return self.inner.build(build_inputs)


@derived_object
class FlakyRunner(PyRunner):
    """Raises on the chosen calls, runs normally otherwise."""

    def __init__(self, fail_calls):
        super().__init__()
        self.inner = ms.runner.LocalRunner()
        self.fail_calls = set(fail_calls)
        self.calls = 0

    def run(self, runner_inputs):
        self.calls += 1
        if self.calls in self.fail_calls:
            raise RuntimeError("planted runner crash")
        return self.inner.run(runner_inputs)


def records(db, mod):
    if not db.has_workload(mod):
        return []
    wl = db.commit_workload(mod)
    return [r for r in db.get_all_tuning_records() if tvm_ffi.structural_equal(r.workload.mod, wl.mod)]


@pytest.fixture(scope="module")
def flaky_run(tmp_path_factory):
    work_dir = str(tmp_path_factory.mktemp("flaky"))
    rounds, tasks = [], []
    # round 1: the builder crashes; round 2: the runner crashes (its 1st call); round 3 is normal
    builder, runner = FlakyBuilder(fail_calls=[1]), FlakyRunner(fail_calls=[1])
    db = tune_tir(BLOCK.module(), TARGET, work_dir, max_trials_global=6, num_trials_per_iter=2,
                  builder=builder, runner=runner, on_round=lambda name, o: rounds.append(o),
                  on_task=tasks.append, **FAST)
    return db, rounds, tasks[0], work_dir


def test_rounds_follow_the_predefined_rule(flaky_run):
    _, rounds, result, _ = flaky_run
    # 3 rounds, shares 5:5:6 -> NL, LR, LC
    assert [o.strategy for o in rounds] == [Strategy.NL, Strategy.LR, Strategy.LC]
    assert result.trials == 6 and result.deployed is Strategy.LC and result.selector == "predefined"


def test_failed_rounds_do_not_stop_tuning(flaky_run):
    db, rounds, result, _ = flaky_run
    # rounds 1 (builder crash) and 2 (runner crash) failed entirely, round 3 still ran
    assert [o.failures for o in rounds] == [4, 4, 0]
    assert rounds[1].round_best_secs is None and rounds[2].round_best_secs is not None
    assert result.best_secs is not None
    mod = BLOCK.module()
    # every trial's deployable P is recorded under the task, the rest under tagged workloads
    assert len(records(db, mod)) == 6
    assert len(records(db, tagged_workload(mod, Strategy.NL))) == 2
    assert len(records(db, tagged_workload(mod, Strategy.LR))) == 2


def test_best_record_is_a_correct_post_layout_program(flaky_run):
    db, _, result, _ = flaky_run
    sch = db.query_schedule(BLOCK.module(), TARGET, workload_name="main")
    assert sch is not None and strategy_of(sch) is Strategy.LC
    top = db.get_top_k(db.commit_workload(BLOCK.module()), 1)[0]
    assert abs(float(np.median([float(s) for s in top.run_secs])) - result.best_secs) < 1e-12
    inputs = BLOCK.random_inputs(seed=5)
    out = tvm.runtime.tensor(np.zeros(BLOCK.shapes()["out"], "float32"))
    kernel = tvm.tirx.build(sch.mod, target=TARGET)  # transform block kept: original weights
    kernel["main"](*(tvm.runtime.tensor(inputs[k]) for k in ("data", "weight", "bias")), out)
    np.testing.assert_allclose(out.numpy(), BLOCK.reference(**inputs), rtol=1e-4, atol=1e-4)


class Interrupt(Exception):
    pass


def test_interrupted_run_resumes_without_losing_records(tmp_path):
    work_dir = str(tmp_path)
    mod = BLOCK.module()

    def stop_after_first(name, outcome):
        raise Interrupt()

    with pytest.raises(Interrupt):
        tune_tir(mod, TARGET, work_dir, max_trials_global=4, num_trials_per_iter=2,
                 layout_strategy="LC", on_round=stop_after_first, **FAST)
    first = ms.database.JSONDatabase(work_dir=work_dir)
    before = {str(r.trace) for r in records(first, mod)}
    assert len(before) == 2
    done = []
    db = tune_tir(mod, TARGET, work_dir, max_trials_global=4, num_trials_per_iter=2,
                  layout_strategy="LC", on_task=done.append, **FAST)
    after = [str(r.trace) for r in records(ms.database.JSONDatabase(work_dir=work_dir), mod)]
    assert len(after) == 4 and before <= set(after)
    assert done[0].trials == 4 and len(done[0].rounds) == 1  # only the missing round ran
    assert done[0].rounds[0].round_index == 1


def conv_relax_module(block, weight, bias):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(block.shapes()["data"], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), strides=block.s, padding=block.p))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(bias))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def test_tuned_record_applies_in_relax_and_matches_untuned(tmp_path):
    inputs = BLOCK.random_inputs(seed=6)
    mod = conv_relax_module(BLOCK, inputs["weight"], inputs["bias"])
    untuned = compile_vm(mod, TARGET)
    # LC: every record carries a compile-time weight layout (with "adaptive" and 2 trials,
    # which strategy's record measures best, and so whether the weight is rewritten at all,
    # depended on the machine's load)
    stage = entry_points.adaptive_layout_tuning_pass(TARGET, str(tmp_path), max_trials_global=2,
                                                     num_trials_per_iter=2, layout_strategy="LC",
                                                     **FAST)
    tuned_mod = stage(mod)
    # the conv kernel now reads a weight whose layout was rewritten at compile time: the
    # same elements in another shape than the model's (8, 8, 3, 3)-style OIHW weight
    original = tuple(inputs["weight"].shape)
    layouts = [
        [tuple(int(d) for d in info.shape) for info in ms.arg_info.ArgInfo.from_prim_func(f)]
        for _, f in tuned_mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)
    ]
    assert any(len(shapes) > 1 and shapes[1] != original and
               np.prod(shapes[1]) == np.prod(original) for shapes in layouts), layouts
    tuned = compile_vm(tuned_mod, TARGET)
    x = inputs["data"]
    expect = untuned(x)
    np.testing.assert_allclose(tuned(x), expect, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(expect, BLOCK.reference(**inputs), rtol=1e-4, atol=1e-4)


def test_wrong_programs_never_become_the_best(tmp_path, monkeypatch):
    """Plant a fault: every derived P computes relu(conv - bias) instead of relu(conv + bias)."""
    from tvm import te, topi
    from tvm.s_tir import Schedule

    from tvm_einweld.auto_scheduler_ext import task_loop
    from tvm_einweld.auto_scheduler_ext.strategies import LayoutPrograms, derive_programs

    sh = BLOCK.shapes()
    data, weight = te.placeholder(sh["data"], name="data"), te.placeholder(sh["weight"], name="weight")
    bias = te.placeholder(sh["bias"], name="bias")
    padded = topi.nn.pad(data, [0, 0, 1, 1], [0, 0, 1, 1])
    wrong = topi.nn.relu(topi.subtract(topi.nn.conv2d_nchw(padded, weight, 1, 0, 1), bias))
    wrong_mod = tvm.IRModule({"main": te.create_prim_func([data, weight, bias, wrong])})

    def faulty(candidate):
        good = derive_programs(candidate)
        return LayoutPrograms(good.no_layout, good.run_time, Schedule(wrong_mod), good.rewritten)

    monkeypatch.setattr(task_loop, "derive_programs", faulty)
    done = []
    db = tune_tir(BLOCK.module(), TARGET, str(tmp_path), max_trials_global=2, num_trials_per_iter=2,
                  layout_strategy="LC", on_task=done.append, **FAST)
    assert done[0].best_secs is None and done[0].rounds[0].failures == 0
    assert db.get_top_k(db.commit_workload(BLOCK.module()), 1) == []  # nothing deployable
    assert len(records(db, tagged_workload(BLOCK.module(), "rejected"))) == 2


@dataclasses.dataclass(frozen=True)
class RecordingSelector:
    """NL, LR, LC in turn by round index; notes what each call saw."""

    seen: list
    name: str = "recording"

    def select(self, round_index, total_rounds, cost_model, history):
        self.seen.append((round_index, total_rounds, [o.strategy for o in history]))
        return (Strategy.NL, Strategy.LR, Strategy.LC)[round_index % 3]


def test_a_task_tuned_round_by_round_shows_the_selector_all_its_rounds(tmp_path):
    """The pipeline's budget scheduler tunes a task one round per call: the selector must see
    the task's earlier rounds and the planned horizon, not a fresh one-round run."""
    seen = []
    selector = RecordingSelector(seen)
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    first = tune_task(BLOCK.module(), TARGET, db, max_trials=2, num_trials_per_iter=2,
                      selector=selector, planned_rounds=5, **FAST)
    second = tune_task(BLOCK.module(), TARGET, db, max_trials=4, num_trials_per_iter=2,
                       selector=selector, history=first.rounds, planned_rounds=5, **FAST)
    assert seen == [(0, 5, []), (1, 5, [Strategy.NL])]
    assert [o.strategy for o in second.rounds] == [Strategy.NL, Strategy.LR]
    # A history the database does not hold (cleared since) is not counted.
    (tmp_path / "fresh").mkdir()
    fresh = ms.database.JSONDatabase(work_dir=str(tmp_path / "fresh"))
    seen.clear()
    tune_task(BLOCK.module(), TARGET, fresh, max_trials=2, num_trials_per_iter=2,
              selector=selector, history=second.rounds, **FAST)
    assert seen == [(0, 1, [])]


def test_a_cut_comparison_resumes_with_its_rounds(tmp_path):
    """tune_variants keeps each variant's rounds beside its database: a run stopped after
    its first round resumes at round 1 with round 0 in the selector's history."""
    seen = []
    variant = comparison.Variant("rec", "adaptive", RecordingSelector(seen))

    def stop(name, outcome):
        raise Interrupt()

    with pytest.raises(Interrupt):
        comparison.tune_variants(BLOCK.module(), TARGET, str(tmp_path), 4, [variant],
                                 on_round=stop, num_trials_per_iter=2, **FAST)
    results = comparison.tune_variants(BLOCK.module(), TARGET, str(tmp_path), 4, [variant],
                                       num_trials_per_iter=2, **FAST)
    assert seen == [(0, 2, []), (1, 2, [Strategy.NL])]
    assert [o.round_index for o in results[0].tuning.rounds] == [0, 1]
    # What each round cost is kept with it (the report's tuning time survives the cut).
    assert all(o.wall_secs > 0 and o.measurements >= o.trials for o in results[0].tuning.rounds)


def _layout_benchmark():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "layout_tuning.py"
    spec = importlib.util.spec_from_file_location("layout_tuning_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_merges_seeds_and_refuses_other_settings(tmp_path):
    """`layout_tuning.py --merge`: every (task, seed) is a row, the gains average over all of
    them; runs whose settings differ in more than the seed are not put together."""
    bench = _layout_benchmark()
    settings = dict(trials=8, per_round=4, population=64, early_stopping_rounds=5,
                    variants=["NL", "LC", "adaptive"])
    where = dict(machine="m", target="llvm")

    def run(seed, adaptive_secs, **changed):
        row = [dict(label=l, layout_strategy="adaptive" if l == "adaptive" else l, secs=s,
                    wall_secs=1.0, measurements=8, rounds=[], best_so_far=[])
               for l, s in (("NL", 1e-3), ("LC", 2e-3), ("adaptive", adaptive_secs))]
        path = tmp_path / f"seed{seed}.json"
        path.write_text(json.dumps(dict(settings=dict(settings, seed=seed, **changed),
                                        tasks=[["t", row, where]], wall_secs=60.0)))
        return str(path)

    out = tmp_path / "merged.md"
    bench.main(["--merge", run(1, 0.8e-3), run(2, 1.25e-3), "-o", str(out)])
    text = out.read_text()
    assert "| t (seed 1) | 1.000 | 2.000 | 0.800 |" in text
    assert "| t (seed 2) | 1.000 | 2.000 | 1.250 |" in text
    # vs NL: (1/0.8 - 1 + 1/1.25 - 1) / 2 = +2.5 %, vs LC (2/0.8 - 1 + 2/1.25 - 1) / 2 =
    # +105 %; at least as fast as the best single strategy (NL) in 1 of the 2 rows.
    assert "| adaptive | +2.5% | +105.0% | +2.5% | 1 of 2 |" in text
    with pytest.raises(SystemExit, match="only the seed may differ"):
        bench.main(["--merge", run(1, 0.8e-3), run(3, 0.9e-3, trials=16)])
