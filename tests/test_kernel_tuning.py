"""Tuning every kernel (auto_scheduler_ext/kernel_tuning): the budget goes where the latency is
(planted tasks and gains), a tuned program is used only when it beats its analytic kernel
(planted timings), and a real tuning of a small module equals the stock build."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from conftest import run_vm
from tvm_einweld.auto_scheduler_ext import kernel_tuning
from tvm_einweld.auto_scheduler_ext.kernel_tuning import BudgetScheduler, TaskState


def _states(*latencies):
    return [TaskState(f"t{i}", None, 1, secs) for i, secs in enumerate(latencies)]


def _run(states, total, per_round, improve):
    """Run the scheduler with a fake tuner: `improve(state)` is the factor the round applies
    to the task's best time (1.0: no gain). Returns the order in which tasks got rounds."""
    order = []

    def tune(state, upto):
        order.append(state.name)
        return upto, state.best * improve(state)

    BudgetScheduler(states, total, per_round).run(tune)
    return order


def test_every_task_is_tried_largest_share_first():
    order = _run(_states(1.0, 9.0, 3.0), total=48, per_round=16, improve=lambda s: 0.9)
    assert order == ["t1", "t2", "t0"]


def test_rounds_follow_the_latency_that_keeps_improving():
    # t0 holds 90 % of the latency and gains 30 % a round; t1 (10 %) gains nothing once tried.
    # A round goes to the larger expected saving (share x gain): t0 until its share x 30 %
    # drops below t1's untried share x 100 %, then t1 once, then t0 again.
    states = _states(9.0, 1.0)
    order = _run(states, total=16 * 6, per_round=16,
                 improve=lambda s: 0.7 if s.name == "t0" else 1.0)
    assert order == ["t0", "t0", "t0", "t1", "t0", "t0"]
    assert states[0].trials == 80 and states[1].trials == 16


def test_a_stalled_task_gives_its_rounds_away():
    # t0 is 90 % of the latency but stops gaining after its first round; t1 (10 %) keeps
    # gaining 50 %: once t0's expected saving (0.9 x 1 %) is below t1's, t1 gets the rounds.
    states = _states(9.0, 1.0)
    order = _run(states, total=16 * 5, per_round=16,
                 improve=lambda s: (0.8 if s.rounds == 0 else 1.0) if s.name == "t0" else 0.5)
    assert order[0] == "t0" and order.count("t1") >= 3


def test_an_exhausted_space_costs_no_budget():
    states = _states(5.0, 1.0)
    calls = []

    def tune(state, upto):
        calls.append(state.name)
        return (state.trials, None) if state.name == "t0" else (upto, state.best)

    BudgetScheduler(states, 32, 16).run(tune)
    assert states[0].exhausted and states[0].trials == 0 and states[1].trials == 32


def test_the_last_round_is_cut_to_the_budget():
    states = _states(1.0)
    _run(states, total=40, per_round=16, improve=lambda s: 0.9)
    assert states[0].trials == 40


def test_a_tuned_program_is_used_only_when_faster():
    """Planted timings: a tuned program that does not win by MIN_KERNEL_GAIN in all rounds but
    one is not used (a better median alone is noise); one that does, is."""
    from tvm_einweld.tir_passes.measure import Comparison

    state = TaskState("k", None, 1, 1e-3, trials=16)

    class FakeTimer:
        def __init__(self, after, wins):
            self.verdict = Comparison(1e-3, after, 7, wins, kernel_tuning.MIN_KERNEL_GAIN)

        def compare(self, before, after):
            return self.verdict

    for after, wins, used in ((0.99e-3, 7, "analytic"), (0.5e-3, 5, "analytic"),
                              (0.5e-3, 6, "tuned")):
        choice = kernel_tuning._choose(state, "tuned", FakeTimer(after, wins), "analytic")
        assert choice.used == used and choice.tuned_secs == after, (after, wins)
    untried = kernel_tuning._choose(TaskState("k", None, 1, 1e-3), "tuned",
                                    FakeTimer(0.0, 7), "analytic")
    assert untried.used == "analytic" and "no trials" in untried.why


@pytest.mark.slow
def test_tuned_kernels_equal_the_stock_build(tmp_path, rng, monkeypatch):
    """A real (short) tuning of a small conv + matmul module: every kernel a task, the
    assembled module (tuned kernels where they won, analytic elsewhere, weights packed at
    compile time) computes what the stock build computes."""
    from tvm_einweld.commands.demo import builtin_model
    from tvm_einweld.tir_passes import prepare
    from tvm_einweld.tir_passes.device import host_target

    target = host_target()
    mod = builtin_model(channels=8, size=10)
    with target:
        base = prepare()(mod)
    calls = []  # (task, rounds the selector was given, horizon, rounds after)
    real_tune_task = kernel_tuning.tune_task

    def spy(*args, **kwargs):
        result = real_tune_task(*args, **kwargs)
        calls.append((kwargs["task_name"], len(kwargs["history"]), kwargs["planned_rounds"],
                      len(result.rounds)))
        return result

    monkeypatch.setattr(kernel_tuning, "tune_task", spy)
    tuned, report = kernel_tuning.tune_kernels(base, target, str(tmp_path), 32,
                                               num_trials_per_iter=8)
    assert report.trials <= 32 and len(report.choices) >= 3
    # Every round of a task is one call, given the task's earlier rounds and one horizon.
    horizon = -(-32 // (len(report.choices) * 8))
    for i, (name, given, planned, after) in enumerate(calls):
        earlier = [c for c in calls[:i] if c[0] == name]
        assert planned == horizon and given == len(earlier) and after == given + 1
    x = rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32")
    got = run_vm(tvm.compile(tuned, target), x)
    np.testing.assert_allclose(got, run_vm(mod, x), rtol=1e-4, atol=1e-4)


def test_a_tile_group_is_a_task_whose_program_replaces_its_kernel(host_target, rng):
    """TileGraphFusion pairs each tile kernel with its group's merged function; the tuner finds
    the pair from the kernel as task extraction hands it out (renamed, with added attributes),
    tunes the merged function, and a chosen program takes the kernel's place. The merged
    function itself stands in for a tuned program here (same parameters, unscheduled): the
    assembled module still computes what the model computes."""
    from tvm.s_tir import meta_schedule as ms
    from tvm_einweld.auto_scheduler_ext.entry_points import prepare_relax
    from tvm_einweld.tir_passes import TileGraphFusion, prepare, workloads
    from tvm_einweld.tir_passes.rules import is_scheduled

    mod = workloads.matmul_softmax(64, 16, 48)
    with host_target:  # (rules off: with them the pair is gemm_rows's kernel, no tile kernel)
        fuse = TileGraphFusion(host_target, measure=False, rules=False)
        fused = fuse(prepare()(mod))
    (kernel, merged), = fuse.report.unscheduled
    assert is_scheduled(kernel) and not is_scheduled(merged)
    prepared = prepare_relax(fused, None, host_target)
    tiles = [t for t in ms.relax_integration.extract_tasks(prepared, host_target)
             if is_scheduled(t.dispatched[0])]
    assert len(tiles) == 1
    task_kernel = tiles[0].dispatched[0]["main"]
    assert kernel_tuning._merged_of(task_kernel, fuse.report.unscheduled).same_as(merged)
    task = kernel_tuning._tile_task(task_kernel, merged)
    assert not is_scheduled(task) and task.body.same_as(merged.body)
    assert task.attrs["global_symbol"] == "main"  # a task's name, not the model's

    assembled = kernel_tuning._replace_tile_kernels(prepared, [(kernel, task)])
    assert kernel_tuning._changed_kernels(prepared, assembled) == {tiles[0].task_name}
    (program,) = [f for f in assembled.functions.values()
                  if isinstance(f, tvm.tirx.PrimFunc) and f.body.same_as(merged.body)]
    assert dict(program.attrs) == dict(prepared[tiles[0].task_name].attrs)
    x, w = (rng.uniform(-1, 1, [int(d) for d in p.ty.shape]).astype("float32")
            for p in mod["main"].params)
    np.testing.assert_allclose(run_vm(assembled, x, w), run_vm(mod, x, w),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_tile_group_is_tuned(tmp_path, rng):
    """A real (short) tuning of a tile-fused matmul + softmax: the group is a task that gets
    trials, and the module computes what the model computes, whichever program won."""
    from tvm_einweld.tir_passes import TileGraphFusion, prepare, workloads
    from tvm_einweld.tir_passes.device import host_target

    target = tvm.target.Target({**dict(host_target().export()), "num-cores": 2})
    mod = workloads.matmul_softmax(128, 32, 64)
    with target:  # (rules off: with them the pair is gemm_rows's kernel, no tile kernel)
        fuse = TileGraphFusion(target, measure=False, rules=False)
        fused = fuse(prepare()(mod))
    tuned, report = kernel_tuning.tune_kernels(fused, target, str(tmp_path), 16,
                                               tile_groups=fuse.report.unscheduled,
                                               num_trials_per_iter=8)
    (choice,) = report.choices
    assert choice.tile and choice.trials == 16 and not report.not_tasks
    x, w = (rng.uniform(-1, 1, [int(d) for d in p.ty.shape]).astype("float32")
            for p in mod["main"].params)
    np.testing.assert_allclose(run_vm(tvm.compile(tuned, target), x, w), run_vm(mod, x, w),
                               rtol=1e-5, atol=1e-6)
