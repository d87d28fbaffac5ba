"""Baseline runners: ways to execute an ONNX model that a benchmark compares side by side.

A runner is a name plus `prepare(model, trials, work_dir) -> run`, where `run` maps a dict of
numpy inputs (graph input name -> array) to the list of numpy outputs. Preparing may tune
(within `trials` measurement trials) and compile; `run` only executes. To add a runner, make
one more `Runner` and pass it to the harness, or `register_runner` it for the CLI.

The harness prepares each runner in its own worker process (`isolation`), whose environment
gives every runtime the physical cores; the runtime options below take the same count from
`bench_threads()`. A `run` may carry a `settings` dict of what it runs with, read back from
the runtime after preparing (e.g. TVM's pool size, OpenVINO's precision): the report lists it.
"""
from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import onnx

from .check import BF16, FP32, Tolerance
from ..runtime_io import flatten_outputs, vm_input
from .isolation import bench_threads

Inputs = Mapping[str, np.ndarray]
RunFn = Callable[[Inputs], list[np.ndarray]]
PrepareFn = Callable[[onnx.ModelProto, int, Path], RunFn]


@dataclass(frozen=True)
class Runner:
    name: str
    prepare: PrepareFn
    description: str
    # Returns why the runner cannot run here (missing package), or None when it can.
    unavailable: Callable[[], Optional[str]] = lambda: None
    # A runner measured in this one's place on a model where this one fails or is wrong.
    stand_in: Optional[str] = None
    # How close its outputs must be to the reference: FP32, or looser for a runner that
    # computes in reduced precision by design (its error is then shown beside its latency).
    tolerance: Tolerance = FP32
    # Environment variables for its worker process on top of the harness's thread counts
    # (e.g. ("OPENBLAS_NUM_THREADS", "1") for a runner whose BLAS must not compete with
    # TVM's pool); the report's settings line shows what the worker ran with.
    environment: tuple[tuple[str, str], ...] = ()


def with_settings(run: RunFn, **settings: object) -> RunFn:
    """Attach the settings a runtime reports after preparing to its run function."""
    run.settings = {**getattr(run, "settings", {}), **{k: str(v) for k, v in settings.items()}}
    return run


# ---- onnxruntime ----------------------------------------------------------------------------
def onnxruntime_session(model: onnx.ModelProto, optimize: bool = True, threads: int = 0,
                        spinning: bool = True):
    """An onnxruntime CPU session; `threads` 0 lets onnxruntime choose. Without `spinning`
    its pool sleeps right after a call instead of busy-waiting for the next one."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1  # sequential execution: one model, one request at a time
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


def reference_outputs(model: onnx.ModelProto, inputs: Inputs) -> list[np.ndarray]:
    """onnxruntime with graph optimisations off: the ground truth every runner is checked on.
    (Its pool does not spin: the reference is computed beside the benchmark's processes.)"""
    return onnxruntime_session(model, optimize=False, spinning=False).run(None, dict(inputs))


def _prepare_onnxruntime(model: onnx.ModelProto, trials: int, work_dir: Path) -> RunFn:
    threads = bench_threads()
    session = onnxruntime_session(model, optimize=True, threads=threads)
    return with_settings(lambda inputs: session.run(None, dict(inputs)),
                         intra_op_num_threads=threads, inter_op_num_threads=1,
                         allow_spinning="1 (default)", graph_optimization="all")


# ---- TVM ------------------------------------------------------------------------------------
def host_target():
    """The llvm target for this CPU: its -mcpu (vector ISA) and core count, for every TVM runner."""
    from ..tir_passes.device import host_target as device_host_target

    return device_host_target()


def graph_input_names(model: onnx.ModelProto) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def vm_runner(executable, input_names: Sequence[str], extra_args: Sequence = ()) -> RunFn:
    """Wrap a compiled Relax executable's `main` as a RunFn (inputs by graph order)."""
    import tvm
    from tvm import relax

    main = relax.VirtualMachine(executable, tvm.cpu())["main"]  # holds its VM alive

    def run(inputs: Inputs) -> list[np.ndarray]:
        args = [vm_input(inputs[n]) for n in input_names]
        return flatten_outputs(main(*args, *extra_args))

    # The pool size TVM's runtime chose (TVM_NUM_THREADS, else half the logical CPUs).
    return with_settings(run, tvm_pool_threads=tvm.get_global_func("runtime.NumThreads")())


def _prepare_tvm_untuned(model: onnx.ModelProto, trials: int, work_dir: Path) -> RunFn:
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    return vm_runner(tvm.compile(from_onnx(model), host_target()), graph_input_names(model))


# MetaSchedule's local builder and runner give each candidate 30 s, counted from the start
# of a fresh worker process (the builder restarts its pool every batch). On a busy shared
# machine importing TVM alone can take that long, and every candidate then fails as a
# timeout; a generous limit keeps the measurement about the kernels.
MEASURE_TIMEOUT_SECONDS = 300.0


@contextlib.contextmanager
def measurement_settings(seconds: float = MEASURE_TIMEOUT_SECONDS):
    """Within the block, MetaSchedule's default local builder/runner wait `seconds` per
    candidate (the tuning pipelines create them with defaults and expose no timeout), and the
    builder builds with `build_cpu_kernel`: MetaSchedule's default build without importing
    every target's tensor intrinsics in each fresh worker (30-80 s per batch on 2 cores;
    CPU float32 kernels never tensorize), so the same candidates build in a fraction of the
    time."""
    from tvm.s_tir.meta_schedule.builder import LocalBuilder
    from tvm.s_tir.meta_schedule.runner import LocalRunner

    from ..auto_scheduler_ext.build_fn import build_cpu_kernel

    # The classes are wrapped by `derived_object`; `_cls` is the Python class it wraps.
    build_init, run_init = LocalBuilder._cls.__init__, LocalRunner._cls.__init__
    saved = dict(build_init.__kwdefaults__), run_init.__defaults__
    build_init.__kwdefaults__["timeout_sec"] = seconds
    build_init.__kwdefaults__["f_build"] = build_cpu_kernel
    run_init.__defaults__ = (seconds, *run_init.__defaults__[1:])
    try:
        yield
    finally:
        build_init.__kwdefaults__, run_init.__defaults__ = saved


def count_tuning_tasks(mod, target) -> int:
    """How many MetaSchedule tasks `static_shape_tuning_pipeline` will extract from `mod`
    (the same passes it runs before tuning, then MetaSchedule's own task extraction)."""
    import tvm
    from tvm import relax
    from tvm.s_tir.meta_schedule.relax_integration import extract_tasks

    with target:
        lowered = tvm.transform.Sequential([
            relax.transform.DecomposeOpsForInference(),
            relax.transform.CanonicalizeBindings(),
            relax.pipeline.zero_pipeline(),
            relax.transform.AttachAttrLayoutFreeBuffers(),
        ])(mod)
    return len(extract_tasks(lowered, target))


def _tvm_tuned(prepack: bool) -> PrepareFn:
    """Stock TVM's tuned CPU path: MetaSchedule within `trials`, optionally weight pre-packing.

    The budget is spread evenly over the tasks (the pipeline's `max_trials_per_task`, which
    its docstring asks to set): left unset, MetaSchedule's rounds of 64 candidates spend a
    small budget on the first few tasks and leave the rest unscheduled.
    With `prepack`, the weights become parameters and `cpu_weight_prepack=True` moves the
    layout rewrites the tuned kernels want into a separate `main_transform_params`
    function, run once here (not timed) as a deployment would at load time. Without it the
    weights stay constants in their ONNX layout.
    A `tuned_<trials>.done` file in `work_dir` marks finished tuning: a resumed benchmark
    applies that database again instead of searching anew (MetaSchedule itself would spend the
    whole budget again, seeded by the records).
    """

    def prepare(model: onnx.ModelProto, trials: int, work_dir: Path) -> RunFn:
        import tvm
        from tvm import relax
        from tvm.relax.frontend.onnx import from_onnx

        target = host_target()
        mod, params = relax.frontend.detach_params(
            from_onnx(model, keep_params_in_input=prepack))
        finished = work_dir / f"tuned_{trials}.done"
        search = trials if trials > 0 and not finished.exists() else 0
        per_task = -(-search // count_tuning_tasks(mod, target)) if search > 0 else None
        work_dir.mkdir(parents=True, exist_ok=True)
        with measurement_settings():
            mod = relax.pipeline.static_shape_tuning_pipeline(
                total_trials=search, target=target, work_dir=str(work_dir),
                cpu_weight_prepack=prepack, max_trials_per_task=per_task,
            )(mod)
        if search > 0:
            finished.write_text(f"{trials} trials\n")
        executable = tvm.compile(mod, target)
        weights = []
        if prepack and "main" in params:
            vm = relax.VirtualMachine(executable, tvm.cpu())
            weights = list(vm["main_transform_params"](params["main"]))
        return vm_runner(executable, graph_input_names(model), weights)

    return prepare


# ---- PyTorch ---------------------------------------------------------------------------------
def _pytorch_unavailable() -> Optional[str]:
    missing = [m for m in ("torch", "onnx2torch") if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def _prepare_pytorch(model: onnx.ModelProto, trials: int, work_dir: Path) -> RunFn:
    import onnx2torch
    import torch

    torch.set_num_threads(bench_threads())
    net = onnx2torch.convert(model).eval()
    names = graph_input_names(model)

    def run(inputs: Inputs) -> list[np.ndarray]:
        with torch.inference_mode():
            out = net(*[torch.from_numpy(np.require(inputs[n], requirements="C")) for n in names])
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [o.numpy() for o in outs]

    return with_settings(run, torch_threads=torch.get_num_threads(),
                         torch_interop_threads=torch.get_num_interop_threads())


# ---- OpenVINO ------------------------------------------------------------------------------
def _openvino_unavailable() -> Optional[str]:
    if importlib.util.find_spec("openvino") is None:
        return "not installed: openvino (pip install 'tvm_einweld[bench]')"
    return None


OPENVINO_SETTINGS = ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "PERFORMANCE_HINT",
                     "NUM_STREAMS", "ENABLE_HYPER_THREADING", "ENABLE_CPU_PINNING")


def _openvino(precision: Optional[str]) -> PrepareFn:
    """OpenVINO's CPU plugin, latency mode, `bench_threads()` threads; `precision` "f32"
    fixes the inference precision, None keeps the plugin's default (bf16 on CPUs with
    AVX512-BF16 / AMX)."""

    def prepare(model: onnx.ModelProto, trials: int, work_dir: Path) -> RunFn:
        import openvino as ov

        core = ov.Core()
        config = {"INFERENCE_NUM_THREADS": bench_threads(), "PERFORMANCE_HINT": "LATENCY"}
        if precision:
            config["INFERENCE_PRECISION_HINT"] = precision
        # An ONNX model in memory: the bytes, with an empty weights tensor.
        network = core.read_model(model=model.SerializeToString(),
                                  weights=ov.Tensor(np.empty(0, np.uint8)))
        compiled = core.compile_model(network, "CPU", config)
        request = compiled.create_infer_request()
        names = graph_input_names(model)
        wanted = [o.name for o in model.graph.output]
        ports = [next((p for p in compiled.outputs if name in p.get_names()), None)
                 for name in wanted]
        if any(p is None for p in ports):
            ports = list(compiled.outputs)  # outputs renamed: keep OpenVINO's (ONNX) order

        def run(inputs: Inputs) -> list[np.ndarray]:
            result = request.infer({n: np.require(inputs[n], requirements="C") for n in names})
            # The request reuses its output buffers: copy before the next call.
            return [np.array(result[p], copy=True) for p in ports]

        readback = {}
        for key in OPENVINO_SETTINGS:
            try:
                value = compiled.get_property(key)
            except RuntimeError:
                continue  # not a property of this plugin version
            # An element type prints as "<Type: 'bfloat16'>"; its short name is "bf16".
            readback[key] = value.get_type_name() if hasattr(value, "get_type_name") else value
        return with_settings(run, openvino=ov.__version__, **readback)

    return prepare


# ---- tvm_einweld ---------------------------------------------------------------------------
def prepare_einweld(model: onnx.ModelProto, trials: int, work_dir: Path) -> RunFn:
    """The "einweld" pipeline (derivations, tile-graph fusion, adaptive-layout tuning when
    `trials > 0`) then TVM's default lowering. The stage object is kept on the returned
    function (`run.stages`) so callers can report what each stage found."""
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    from ..einweld_pipeline import EinweldOptimize, lowering, tuning_summary

    work_dir.mkdir(parents=True, exist_ok=True)
    stages = EinweldOptimize(host_target(), trials=trials, work_dir=str(work_dir))
    with measurement_settings():
        executable = tvm.compile(from_onnx(model), host_target(),
                                 relax_pipeline=tvm.transform.Sequential([stages, lowering()]))
    run = vm_runner(executable, graph_input_names(model))
    run.stages = stages
    if trials > 0:  # whether tuned kernels were used, in the report's settings line
        run = with_settings(run, tuning=tuning_summary(stages))
    return run


# ---- registry ------------------------------------------------------------------------------
# In a TVM process the cores belong to TVM's pool. numpy's OpenBLAS (tvm_einweld's GEMM
# provider, called from a TVM thread) must not start a pool of its own beside it: its
# threads spin after every GEMM while TVM's spin after every kernel. Measured on fsrcnn
# (tvm_einweld, 2 cores): 10-19 ms per call with OPENBLAS_NUM_THREADS=2, 0.6 ms with 1.
TVM_ENVIRONMENT = (("OPENBLAS_NUM_THREADS", "1"),)
TVM_UNTUNED = Runner("tvm-untuned", _prepare_tvm_untuned,
                     "stock TVM, tvm.compile(mod, llvm) without tuning",
                     environment=TVM_ENVIRONMENT)
# In TVM 0.27 the pre-packed layout rewrite of tuned ConvTranspose kernels gives wrong results
# and fails to schedule some depthwise convolutions (see benchmarks/RESULTS.md); there the
# same tuning without weight pre-packing stands in, so every model keeps a tuned TVM peer.
TVM_TUNED = Runner("tvm-tuned", _tvm_tuned(prepack=True),
                   "stock TVM, relax.pipeline.static_shape_tuning_pipeline(trials, "
                   "cpu_weight_prepack=True)", stand_in="tvm-tuned-noprepack",
                   environment=TVM_ENVIRONMENT)
TVM_TUNED_NO_PREPACK = Runner("tvm-tuned-noprepack", _tvm_tuned(prepack=False),
                              "stock TVM, static_shape_tuning_pipeline(trials, "
                              "cpu_weight_prepack=False)", environment=TVM_ENVIRONMENT)
ONNXRUNTIME = Runner("onnxruntime", _prepare_onnxruntime,
                     "onnxruntime CPUExecutionProvider, all graph optimisations")
EINWELD = Runner("tvm_einweld", prepare_einweld,
                 "tvm_einweld pipeline: derivations + tile-graph fusion + adaptive layout tuning",
                 environment=TVM_ENVIRONMENT)
PYTORCH = Runner("pytorch", _prepare_pytorch, "PyTorch CPU eager via onnx2torch",
                 unavailable=_pytorch_unavailable)
OPENVINO = Runner("openvino", _openvino("f32"),
                  "OpenVINO CPU plugin, INFERENCE_PRECISION_HINT=f32, latency hint",
                  unavailable=_openvino_unavailable)
OPENVINO_DEFAULT = Runner("openvino-default", _openvino(None),
                          "OpenVINO CPU plugin at its default precision (bf16 where the CPU "
                          "has it), latency hint; checked at bf16 tolerance",
                          unavailable=_openvino_unavailable, tolerance=BF16)

RUNNERS: dict[str, Runner] = {
    r.name: r for r in [TVM_UNTUNED, TVM_TUNED, TVM_TUNED_NO_PREPACK, ONNXRUNTIME, EINWELD,
                         OPENVINO, OPENVINO_DEFAULT, PYTORCH]
}


def register_runner(runner: Runner) -> None:
    """Add a runner (e.g. the tvm_einweld pipeline) to the ones the CLI can select."""
    RUNNERS[runner.name] = runner
