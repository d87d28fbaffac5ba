"""Runners in their own worker processes: the pipe protocol, failures, alternation, settings.

Planted runners are module-level functions, so a worker imports them from this module as the
parent does; they log every call (pid, clock) to a file in their work directory, which is how
a test sees what happened in the other process. No timing is asserted.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tvm_einweld.bench.harness import FAILED, OK, SKIPPED, WRONG, TimingPlan, benchmark_model
from tvm_einweld.bench.isolation import THREAD_VARS, WorkerError, WorkerProcess
from tvm_einweld.machine import _parse_cpu_list, physical_cores, usable_cpus
from tvm_einweld.bench.runners import (ONNXRUNTIME, OPENVINO, OPENVINO_DEFAULT, Runner,
                                       _prepare_onnxruntime, with_settings)

PLAN = TimingPlan(repeats=3, warmup=1, min_sample_seconds=0.0, threads=1)

# These tests count a runner's calls (see the `no_retiming` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("no_retiming")


def tiny_model() -> onnx.ModelProto:
    """y = relu(x @ w): one input, one output, microseconds per call."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8],
                           rng.standard_normal(64).astype(np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


# ---- planted runners (run inside the workers) ------------------------------------------------------
def _logged(model, trials, work_dir: Path):
    """onnxruntime, logging each call and reporting the environment it found."""
    run = _prepare_onnxruntime(model, trials, work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    log = work_dir / "calls.log"

    def logged(inputs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {time.monotonic()}\n")
        return run(inputs)

    return with_settings(logged, seen_tvm_threads=os.environ.get("TVM_NUM_THREADS"),
                         seen_cpus=len(os.sched_getaffinity(0)))


def _perturbed(model, trials, work_dir):
    run = _prepare_onnxruntime(model, trials, work_dir)
    return lambda inputs: [o + 0.05 * np.abs(o).max() + 0.1 for o in run(inputs)]


def _wrong_after_first_call(model, trials, work_dir):
    run, calls = _prepare_onnxruntime(model, trials, work_dir), []

    def drifting(inputs):
        calls.append(1)
        return [o + (len(calls) > 1) for o in run(inputs)]
    return drifting


def _crashing(model, trials, work_dir):
    raise RuntimeError("codegen exploded\nsecond line")


def _crashing_in_round_two(model, trials, work_dir):
    run, calls = _prepare_onnxruntime(model, trials, work_dir), []

    def crash(inputs):
        calls.append(1)
        if len(calls) > 4:  # check, calibrate, warm-up, first round: then fail
            raise ValueError("kernel fault on call 5")
        return run(inputs)
    return crash


def _dying(model, trials, work_dir):
    print("about to die", flush=True)
    os._exit(3)


def _hanging(model, trials, work_dir):
    time.sleep(120)


def _calls(work_dir: Path, runner: str) -> list[tuple[int, float]]:
    lines = (work_dir / "tiny_b1" / runner / "calls.log").read_text().split()
    return [(int(p), float(t)) for p, t in zip(lines[::2], lines[1::2])]


def _bench(tmp_path, runners, plan=PLAN):
    return benchmark_model("tiny", tiny_model(), 1, runners, 0, tmp_path, plan,
                           log=lambda s: None)


# ---- the protocol ------------------------------------------------------------------------------------
def test_each_runner_runs_in_its_own_process_with_the_given_threads(tmp_path) -> None:
    own = Runner("a", _logged, "logged", environment=(("OMP_NUM_THREADS", "3"),))
    result = _bench(tmp_path, [own, ONNXRUNTIME])
    a, ort = result.result("a"), result.result("onnxruntime")
    assert a.status == ort.status == OK and a.latency > 0 and ort.latency > 0
    assert len({os.getpid(), a.pid, ort.pid}) == 3
    assert {pid for pid, _ in _calls(tmp_path, "a")} == {a.pid}
    settings, ort_settings = dict(a.settings), dict(ort.settings)
    # PLAN.threads for every runtime, then the runner's own environment on top
    assert {var: settings[var] for var in THREAD_VARS} == {
        "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1"}
    assert ort_settings["OMP_NUM_THREADS"] == "1"
    assert settings["seen_tvm_threads"] == "1"  # set in the worker before anything ran
    assert ort_settings["intra_op_num_threads"] == "1"
    assert result.load_before is not None and result.load_after is not None


def test_rounds_alternate_across_the_worker_processes(tmp_path) -> None:
    _bench(tmp_path, [Runner("a", _logged, "logged"), Runner("b", _logged, "logged")])
    calls = sorted([(t, "a") for _, t in _calls(tmp_path, "a")] +
                   [(t, "b") for _, t in _calls(tmp_path, "b")])
    # check, calibration probe, warm-up round, 3 timed rounds, check after timing: 1 call
    # each (min_sample_seconds=0), a then b every time.
    assert [name for _, name in calls] == ["a", "b"] * 7


def test_in_process_mode_runs_in_this_process(tmp_path) -> None:
    plan = TimingPlan(repeats=2, warmup=0, min_sample_seconds=0.0, isolate=False)
    result = _bench(tmp_path, [Runner("a", _logged, "logged")], plan)
    assert result.result("a").status == OK and result.result("a").pid == os.getpid()
    assert len(_calls(tmp_path, "a")) == 1 + 1 + 2 + 1


def test_failures_become_error_rows_not_hangs(tmp_path) -> None:
    plan = TimingPlan(repeats=3, warmup=1, min_sample_seconds=0.0, threads=1, prepare_timeout=3)
    runners = [Runner("good", _logged, "logged"),
               Runner("crash", _crashing, "raises while preparing"),
               Runner("crash-later", _crashing_in_round_two, "raises in the second round"),
               Runner("dies", _dying, "exits while preparing"),
               Runner("hangs", _hanging, "never finishes preparing"),
               Runner("absent", _crashing, "not installed", unavailable=lambda: "not here")]
    start = time.monotonic()
    result = _bench(tmp_path, runners, plan)
    assert time.monotonic() - start < 60
    by = {r.runner: r for r in result.results}
    assert by["good"].status == OK and len(by["good"].timing.samples) == 3
    assert (by["crash"].status, by["crash"].detail) == (FAILED, "RuntimeError: codegen exploded")
    assert by["crash-later"].status == FAILED and by["crash-later"].timing is None
    assert by["crash-later"].detail == "timing: ValueError: kernel fault on call 5"
    assert by["dies"].status == FAILED
    assert by["dies"].detail == "worker exited with code 3 during prepare; log: about to die"
    assert by["hangs"].status == FAILED and "timed out after 3 s during prepare" in \
        by["hangs"].detail
    assert by["absent"].status == SKIPPED and by["absent"].detail == "not here"
    # The failed runners' logs hold their tracebacks.
    assert "codegen exploded" in (tmp_path / "tiny_b1" / "crash.log").read_text()


def test_wrong_outputs_are_flagged_before_and_after_timing(tmp_path) -> None:
    result = _bench(tmp_path, [Runner("off", _perturbed, "wrong from the start"),
                               Runner("drift", _wrong_after_first_call, "wrong later"),
                               Runner("a", _logged, "right")])
    off, drift = result.result("off"), result.result("drift")
    assert off.status == WRONG and "out of tolerance" in off.detail and off.timing is None
    assert drift.status == WRONG and drift.detail.startswith("after timing: ")
    assert drift.timing is None and result.result("a").latency > 0


def test_worker_errors_are_raised_with_the_workers_message(tmp_path) -> None:
    worker = WorkerProcess(_crashing, 1, tmp_path / "w.log")
    try:
        with pytest.raises(WorkerError, match="^RuntimeError: codegen exploded$"):
            worker.prepare(tiny_model().SerializeToString(), 0, tmp_path, {})
        with pytest.raises(WorkerError, match="not prepared"):
            worker.sample(1)  # still answering after a failure
    finally:
        worker.close()
    assert worker._proc.returncode == 0  # quit cleanly


@pytest.mark.skipif(len(usable_cpus()) < 2 or not hasattr(os, "sched_setaffinity"),
                    reason="needs two CPUs")
def test_worker_widens_a_cpu_pin_it_would_inherit(tmp_path) -> None:
    """TVM pins the thread that starts its pool to CPU 0; a worker started afterwards must
    still get every CPU."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        result = _bench(tmp_path, [Runner("a", _logged, "logged")])
    finally:
        os.sched_setaffinity(0, saved)
    settings = dict(result.result("a").settings)
    assert settings["seen_cpus"] == str(len(usable_cpus()))
    assert settings["cpus"] == ",".join(map(str, usable_cpus()))


def test_openvino_f32_and_default_precision(tmp_path) -> None:
    pytest.importorskip("openvino")
    plan = TimingPlan(repeats=2, warmup=0, min_sample_seconds=0.0, threads=2)
    result = _bench(tmp_path, [OPENVINO, OPENVINO_DEFAULT], plan)
    f32, default = result.result("openvino"), result.result("openvino-default")
    assert f32.status == default.status == OK
    f32_settings, default_settings = dict(f32.settings), dict(default.settings)
    assert f32_settings["INFERENCE_PRECISION_HINT"] == "f32"
    assert f32_settings["INFERENCE_NUM_THREADS"] == "2"
    assert default_settings["INFERENCE_PRECISION_HINT"] in ("bf16", "f16", "f32")
    assert f32.error < 1e-5 and default.error is not None


def test_unavailable_openvino_is_skipped(tmp_path, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openvino" else real(name, *a))
    result = _bench(tmp_path, [OPENVINO])
    assert result.result("openvino").status == SKIPPED
    assert "pip install 'tvm_einweld[bench]'" in result.result("openvino").detail


# ---- the machine's cores ----------------------------------------------------------------------
def test_cpu_lists_and_physical_cores() -> None:
    assert _parse_cpu_list("0-3,6,8-9\n") == [0, 1, 2, 3, 6, 8, 9]
    assert 1 <= physical_cores() <= len(usable_cpus())
    assert physical_cores([]) == 1


@pytest.mark.parametrize("shape,dtype", [((1, 3, 7, 5), "float32"), ((13,), "int64"),
                                         ((2, 1, 3), "float64"), ((0, 4), "float32"),
                                         ((), "float32")])
def test_inputs_are_aligned_copies(shape, dtype):
    """Every runner's inputs start 64-byte aligned (`aligned`), equal to what was sent, from
    an unaligned or non-contiguous source too."""
    from tvm_einweld.runtime_io import BUFFER_ALIGNMENT, aligned, vm_input

    raw = np.arange(int(np.prod(shape)) * 2 + 1).astype(dtype)
    source = raw[1::2].reshape(shape)  # strided and (for most dtypes) unaligned; 0-d too
    assert tuple(vm_input(source).shape) == source.shape  # the copy keeps the shape
    out = aligned(source)
    assert out.flags.c_contiguous
    assert out.ctypes.data % BUFFER_ALIGNMENT == 0 or out.size == 0  # no data to align
    assert out.dtype == source.dtype and out.shape == source.shape
    np.testing.assert_array_equal(out, source)


def test_guarded_copies_keep_shape_and_sit_aligned_between_their_guards():
    """The kernel checks' guard-zoned copy (`tir_passes.measure._guarded`, placed by
    `runtime_io.place_aligned`): same shape (0-d too) and values, aligned, and a write just
    outside it is seen."""
    from tvm_einweld.runtime_io import BUFFER_ALIGNMENT
    from tvm_einweld.tir_passes.measure import _guarded

    for source in (np.array(2.5, "float32"), np.arange(7, dtype="float64").reshape(7, 1)):
        view, intact = _guarded(source)
        assert view.shape == source.shape and view.ctypes.data % BUFFER_ALIGNMENT == 0
        np.testing.assert_array_equal(view, source)
        assert intact()
        raw = view
        while raw.base is not None:  # the allocation the copy sits in (bytes)
            raw = raw.base
        raw[view.ctypes.data - raw.ctypes.data - 1] ^= 0xFF  # the byte just before the copy
        assert not intact()


def test_vm_input_reads_aligned_arrays_in_place_and_copies_others():
    """`vm_input` hands TVM the array itself where it can (a later write to the array shows
    through), a copy elsewhere (unaligned, strided); a module run on either gives numpy's
    answer and leaves the input unchanged."""
    import tvm
    from tvm import relax
    from tvm_einweld.bench.runners import host_target
    from tvm_einweld.runtime_io import aligned, vm_input

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 37), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.relu(relax.op.add(x, x))))
        bb.emit_func_output(out)
    main = relax.VirtualMachine(tvm.compile(bb.get(), host_target()), tvm.cpu())["main"]
    rng = np.random.default_rng(3)
    inplace = aligned(rng.standard_normal((3, 37)).astype("float32"))
    tensor = vm_input(inplace)
    inplace[0, 0] = 5.0
    assert tensor.numpy()[0, 0] == 5.0  # the same memory
    unaligned = np.empty(3 * 37 + 1, "float32")[1:].reshape(3, 37)
    unaligned[...] = rng.standard_normal((3, 37))
    strided = rng.standard_normal((3, 74)).astype("float32")[:, ::2]
    readonly = aligned(rng.standard_normal((3, 37)).astype("float32"))
    readonly.flags.writeable = False  # numpy exports no read-only array through DLPack
    for array in (inplace, unaligned, strided, readonly):
        before = array.copy()
        np.testing.assert_allclose(main(vm_input(array)).numpy(), np.maximum(2 * array, 0),
                                   rtol=1e-6)
        np.testing.assert_array_equal(array, before)
