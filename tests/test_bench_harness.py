"""The benchmark harness: output checks (planted faults), runners, roofline counts, machine."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest

from tvm_einweld import machine as machine_mod
from tvm_einweld.bench.check import compare_outputs
from tvm_einweld.bench.harness import (FAILED, OK, REFERENCE, SKIPPED, WRONG, TimingPlan,
                                       benchmark_model)
from tvm_einweld.bench.roofline import graph_cost
from tvm_einweld.bench.runners import (ONNXRUNTIME, TVM_TUNED, TVM_TUNED_NO_PREPACK, Runner,
                                       _prepare_onnxruntime, reference_outputs)
from tvm_einweld.models import build_model, random_inputs
from tvm_einweld.models.graph_builder import GraphBuilder

PLAN = TimingPlan(repeats=3, warmup=1, min_sample_seconds=0.0)

# These tests count a runner's calls (see the `no_retiming` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("no_retiming")


# ---- compare_outputs ------------------------------------------------------------------------
def test_compare_accepts_fp32_rounding_and_rejects_real_errors(rng) -> None:
    ref = rng.standard_normal((64, 64)).astype(np.float32)
    assert compare_outputs([ref * (1 + 1e-6)], [ref]).ok
    bad = ref.copy()
    bad[3, 5] += 0.01 * np.abs(ref).max()
    result = compare_outputs([bad], [ref])
    assert not result.ok and "1/4096 elements" in result.detail


@pytest.mark.parametrize("actual", [[np.zeros((2, 3))], [np.zeros((3, 2))],
                                    [np.full((2, 2), np.nan)], []])
def test_compare_rejects_shape_nan_and_count_mismatch(actual) -> None:
    assert not compare_outputs(actual, [np.zeros((2, 2))]).ok


# ---- harness: planted faults ------------------------------------------------------------------
def _perturbed(model: onnx.ModelProto, trials, work_dir):
    run = _prepare_onnxruntime(model, trials, work_dir)
    return lambda inputs: [o + 0.05 * np.abs(o).max() for o in run(inputs)]


def _crashing(model, trials, work_dir):
    raise RuntimeError("codegen exploded\nsecond line")


def _counted(model, trials, work_dir):
    """onnxruntime, counting its calls in a file (it runs in a worker process)."""
    run = _prepare_onnxruntime(model, trials, work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)

    def counted(inputs):
        with open(work_dir / "calls.log", "a") as f:
            f.write("call\n")
        return run(inputs)
    return counted


def test_wrong_failed_and_skipped_runners_are_reported_not_timed(tmp_path) -> None:
    model = build_model("fsrcnn")
    runners = [
        Runner("good", _counted, "onnxruntime, counted"),
        Runner("off-by-5%", _perturbed, "planted fault: wrong output"),
        Runner("crash", _crashing, "planted fault: raises"),
        Runner("absent", _crashing, "not installed", unavailable=lambda: "not installed: x"),
    ]
    result = benchmark_model("fsrcnn", model, 1, runners, 0, tmp_path, PLAN, log=lambda s: None)
    by_name = {r.runner: r for r in result.results}
    assert by_name["good"].status == OK and len(by_name["good"].timing.samples) == 3
    # check call + calls_per_sample probe + warm-up + 3 timed rounds (1 call each) + the
    # check after timing
    calls = (tmp_path / "fsrcnn_b1" / "good" / "calls.log").read_text().split()
    assert len(calls) == 1 + 1 + 1 + 3 + 1
    assert by_name["off-by-5%"].status == WRONG and by_name["off-by-5%"].timing is None
    assert "out of tolerance" in by_name["off-by-5%"].detail
    assert by_name["crash"].status == FAILED
    assert by_name["crash"].detail == "RuntimeError: codegen exploded"
    assert by_name["absent"].status == SKIPPED and by_name["absent"].detail == "not installed: x"
    assert result.latency("good") > 0 and result.latency("crash") is None
    # The machine's reference loop ran in the same rounds (and is not a runner).
    assert len(result.reference.samples) == 3 and result.reference.median > 0
    assert all(r.runner != REFERENCE for r in result.results)


def test_a_failed_runner_has_its_stand_in_timed_in_its_place(tmp_path, monkeypatch) -> None:
    from tvm_einweld.bench import report
    from tvm_einweld.bench.runners import RUNNERS

    model = build_model("fsrcnn")
    monkeypatch.setitem(RUNNERS, "fallback", Runner("fallback", _prepare_onnxruntime, "ort"))
    runners = [Runner("crash", _crashing, "planted fault", stand_in="fallback"),
               Runner("good", _prepare_onnxruntime, "onnxruntime")]
    result = benchmark_model("fsrcnn", model, 1, runners, 0, tmp_path, PLAN, log=lambda s: None)
    assert [r.runner for r in result.results] == ["crash", "fallback", "good"]
    assert result.stand_ins == (("crash", "fallback"),)
    assert result.latency("crash") is None
    assert result.latency_or_stand_in("crash") == result.latency("fallback") > 0
    # The report's ratios use the stand-in where the baseline failed, and say so.
    suite = report.SuiteResult("cmd", "t", 1.0, machine_mod.describe_machine(), None, 0,
                               ("crash", "good"), "crash", (result,))
    table = report.latency_table(suite)
    assert "| model | batch | crash | good | fallback |" in table
    assert "failed (→ fallback)" in table and "(1.00×) |" in table.splitlines()[2]


def test_reference_is_unoptimised_onnxruntime_and_optimised_one_agrees() -> None:
    model = build_model("mobilenetv2")
    inputs = random_inputs(model)
    ref = reference_outputs(model, inputs)
    assert compare_outputs(ONNXRUNTIME.prepare(model, 0, None)(inputs), ref).ok


@pytest.mark.parametrize("runner", [TVM_TUNED, TVM_TUNED_NO_PREPACK], ids=lambda r: r.name)
def test_stock_tvm_tuned_paths_run_correctly(tmp_path, runner) -> None:
    """static_shape_tuning_pipeline with and without cpu_weight_prepack at 0 trials: the
    prepack / main_transform_params plumbing, checked against onnxruntime."""
    model = build_model("fsrcnn")
    inputs = random_inputs(model)
    run = runner.prepare(model, 0, tmp_path)
    assert compare_outputs(run(inputs), reference_outputs(model, inputs)).ok


@pytest.mark.slow
def test_stock_tvm_tuned_with_trials_is_correct_and_writes_records(tmp_path) -> None:
    """A real (tiny) MetaSchedule budget on one ConvTranspose, without weight pre-packing
    (with it, TVM 0.27's tuned conv2d_transpose reads a mis-packed weight: RESULTS.md)."""
    g = GraphBuilder("one_convt", seed=0)
    model = g.build([g.conv_transpose(g.input("x", [1, 64, 8, 8]), 64, 32, 4, 2, 1)])
    inputs = random_inputs(model)
    run = TVM_TUNED_NO_PREPACK.prepare(model, 4, tmp_path)
    assert compare_outputs(run(inputs), reference_outputs(model, inputs)).ok
    records = tmp_path / "database_tuning_record.json"
    assert records.stat().st_size > 0
    # A resumed benchmark applies the finished database again instead of searching anew.
    saved = records.read_bytes()
    run = TVM_TUNED_NO_PREPACK.prepare(model, 4, tmp_path)
    assert compare_outputs(run(inputs), reference_outputs(model, inputs)).ok
    assert records.read_bytes() == saved


# ---- roofline ----------------------------------------------------------------------------------
def _single_op_model(build) -> onnx.ModelProto:
    g = GraphBuilder("one", seed=0)
    return g.build([build(g)])


def test_conv_and_conv_transpose_flops_and_bytes() -> None:
    conv = _single_op_model(lambda g: g.conv(g.input("x", [2, 8, 10, 10]), 8, 16, 3, bias=False))
    cost = graph_cost(conv)
    assert cost.flops == 2 * (2 * 16 * 10 * 10) * (8 * 3 * 3)
    assert cost.min_bytes == 4 * (2 * 8 * 100 + 16 * 8 * 9 + 2 * 16 * 100)
    assert cost.unfused_bytes == cost.min_bytes  # one operator: nothing to fuse
    convt = _single_op_model(lambda g: g.conv_transpose(g.input("x", [1, 4, 5, 5]), 4, 6, 4, 2,
                                                        1, bias=False))
    assert graph_cost(convt).flops == 2 * (4 * 5 * 5) * (6 * 4 * 4)


def test_matmul_einsum_and_elementwise_flops() -> None:
    def build(g):
        a = g.input("a", [3, 4, 5])
        y = g.node("MatMul", [a, g.weight([5, 7], 5)])            # 2*3*4*7*5
        y = g.node("Relu", [y])                                     # 3*4*7
        y = g.node("Einsum", [y, g.weight([3, 7, 2], 7)],
                   equation="bik,bkj->bij")                         # 2*3*4*7*2
        return g.reshape(y, [24])                                   # data movement: 0
    cost = graph_cost(_single_op_model(build))
    assert cost.flops == 2 * 3 * 4 * 7 * 5 + 3 * 4 * 7 + 2 * 3 * 4 * 7 * 2
    assert cost.unfused_bytes > cost.min_bytes


def test_roofline_bound_uses_the_binding_resource() -> None:
    m = machine_mod.MachineInfo("cpu", 2, 8.0, sgemm_gflops=100.0, copy_gbs=10.0,
                                numpy_version="x", measured_at="t")
    cost = graph_cost(build_model("infogan"))
    expected = max(cost.flops / 100e9, cost.min_bytes / 10e9)
    assert cost.bound_seconds(m) == pytest.approx(expected)
    # InfoGAN's weights dominate: a generator at batch 1 is memory-bound.
    assert cost.bound_seconds(m) == pytest.approx(cost.min_bytes / 10e9)


def test_the_compute_ceiling_is_the_fma_peak_where_measured() -> None:
    """numpy's sgemm is no ceiling (its OpenBLAS reached 45 % of a Zen 5's FMA peak, which
    our GEMMs pass): the roofline and the derivation's peaks use the FMA probe's figure, and
    numpy's only where no compiler ran the probe."""
    probed = machine_mod.MachineInfo("cpu", 2, 8.0, sgemm_gflops=100.0, copy_gbs=1e6,
                                     numpy_version="x", measured_at="t", fma_gflops=400.0)
    cost = graph_cost(build_model("nerf"))  # compute-bound at any of these bandwidths
    assert cost.bound_seconds(probed) == pytest.approx(cost.flops / 400e9)
    assert "FMA 400 GFLOP/s" in probed.describe()
    unprobed = dataclasses.replace(probed, fma_gflops=None)
    assert cost.bound_seconds(unprobed) == pytest.approx(cost.flops / 100e9)
    assert "FMA not measured" in unprobed.describe()


def test_a_description_from_before_the_fma_probe_is_measured_again(tmp_path, monkeypatch
                                                                    ) -> None:
    fresh = machine_mod.MachineInfo(machine_mod.cpu_model(), 2, 8.0, 100.0, 10.0,
                                    np.__version__, "now", fma_gflops=400.0)
    old = {k: v for k, v in dataclasses.asdict(fresh).items() if k != "fma_gflops"}
    (tmp_path / "machine.json").write_text(json.dumps(old))
    monkeypatch.setattr(machine_mod.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine_mod, "measure_machine", lambda: fresh)
    assert machine_mod.describe_machine(tmp_path).fma_gflops == 400.0


# ---- machine description --------------------------------------------------------------------------
def test_machine_measurements_are_positive_and_cached(tmp_path, monkeypatch) -> None:
    assert machine_mod.measure_sgemm_gflops(n=128, repeats=1) > 0
    assert machine_mod.measure_copy_gbs(mib=4, repeats=1) > 0
    calls = []

    def fake_measure(load: float):
        def measure():
            calls.append(load)
            return machine_mod.MachineInfo(machine_mod.cpu_model(), 2, 8.0, 100.0, 10.0,
                                           np.__version__, "now", load_at_measurement=load)
        return measure

    monkeypatch.setattr(machine_mod.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine_mod, "measure_machine", fake_measure(3.0))  # busy machine
    busy = machine_mod.describe_machine(tmp_path)
    assert busy.measured_under_load and "under load" in busy.describe()
    # Remembered all the same (a figure that moved between processes would move the choices
    # made with it); refresh=True measures again.
    assert (tmp_path / "machine.json").exists()
    monkeypatch.setattr(machine_mod, "measure_machine", fake_measure(0.1))
    assert machine_mod.describe_machine(tmp_path) == busy and calls == [3.0]
    first = machine_mod.describe_machine(tmp_path, refresh=True)
    second = machine_mod.describe_machine(tmp_path)
    assert first == second and not first.measured_under_load and calls == [3.0, 0.1]
    assert json.loads((tmp_path / "machine.json").read_text())["sgemm_gflops"] == 100.0
    machine_mod.describe_machine(tmp_path, refresh=True)
    assert calls == [3.0, 0.1, 0.1]



def test_measurement_settings_apply_inside_the_block_only() -> None:
    """The defaults MetaSchedule's `Builder.create("local")` / `Runner.create("local")` use.
    (Creating them spawns worker processes, seconds each: read the defaults instead.)"""
    import inspect

    from tvm.s_tir.meta_schedule.builder import LocalBuilder
    from tvm.s_tir.meta_schedule.runner import LocalRunner

    from tvm_einweld.bench.runners import measurement_settings

    from tvm_einweld.auto_scheduler_ext.build_fn import build_cpu_kernel

    def defaults() -> tuple:
        return tuple(inspect.signature(c._cls.__init__).parameters[p].default
                     for c, p in [(LocalBuilder, "timeout_sec"), (LocalRunner, "timeout_sec"),
                                  (LocalBuilder, "f_build")])

    before = defaults()
    with measurement_settings(123.0):
        assert defaults() == (123.0, 123.0, build_cpu_kernel)
    assert defaults() == before == (30.0, 30, None)


def test_the_einweld_runner_says_whether_tuned_kernels_were_used(tmp_path, monkeypatch) -> None:
    """With trials > 0 the runner's settings line carries the pipeline's tuning summary (the
    stage is stubbed: a pass that changes nothing and reports that no kernel beat its
    0-trial one)."""
    import tvm

    from tvm_einweld import einweld_pipeline
    from tvm_einweld.auto_scheduler_ext.kernel_tuning import TuningReport
    from tvm_einweld.bench.runners import prepare_einweld

    @tvm.transform.module_pass(opt_level=0, name="StubOptimize")
    class Stub:
        def __init__(self, target, trials=0, work_dir=None):
            self.trials, self.layout_strategy = trials, "adaptive"
            self.tuning_report = TuningReport(choices=(), trials=0, budget=trials)
            self.tuned, self.tuning_check, self.tuning_seconds = False, None, None

        def transform_module(self, mod, _ctx):
            return mod

    monkeypatch.setattr(einweld_pipeline, "EinweldOptimize", Stub)
    model = build_model("infogan")
    run = prepare_einweld(model, 8, tmp_path)
    assert "tuned kernels NOT used: no kernel to tune" in run.settings["tuning"]
    assert "tuning" not in prepare_einweld(model, 0, tmp_path).settings
