"""Side-by-side benchmarking of ONNX models: runners, timing, roofline and reports.

- `runners`: how a model is executed (stock TVM untuned / tuned, tvm_einweld, onnxruntime,
  OpenVINO, PyTorch); add one with `register_runner(Runner(name, prepare, description))`.
- `isolation`: each runner in its own worker process, every runtime given the physical cores.
- `check`: agreement of a runner's outputs with the onnxruntime reference.
- `timing`: the one alternating-rounds / median loop (`alternate_rounds`, `time_alternating`),
  for the harness and any other benchmark.
- `machine`, `roofline`: the measured GEMM / copy peaks and each model's distance from them.
- `harness`: one model through all runners; `suite`: the zoo presets; `report`: Markdown,
  JSON and a PNG chart.
"""
from .harness import ModelResult, RunnerResult, TimingPlan, benchmark_model
from .runners import RUNNERS, Runner, register_runner
from .suite import FULL, QUICK, BenchConfig, run_suite
from .timing import Timing, alternate_rounds, time_alternating

__all__ = ["ModelResult", "RunnerResult", "TimingPlan", "benchmark_model", "RUNNERS", "Runner",
           "register_runner", "FULL", "QUICK", "BenchConfig", "run_suite", "Timing",
           "alternate_rounds", "time_alternating"]
