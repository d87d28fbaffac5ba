"""The tvm_einweld runner of the benchmark harness: the "einweld" pipeline at a trial budget.

`prepare_einweld` compiles an ONNX model through `EinweldOptimize` (derivations, tile-graph
fusion, adaptive-layout tuning when `trials > 0`) and TVM's default lowering. The stage object
is kept on the returned function (`run.stages`) so callers can report what each stage found.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from .runners import RunFn, Runner, graph_input_names, host_target, measurement_timeouts, vm_runner


def prepare_einweld(model: onnx.ModelProto, trials: int, work_dir: Path) -> RunFn:
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    from ..einweld_pipeline import EinweldOptimize

    target = host_target()
    work_dir.mkdir(parents=True, exist_ok=True)
    stages = EinweldOptimize(target, trials=trials, work_dir=str(work_dir))
    with measurement_timeouts():
        executable = tvm.compile(from_onnx(model), target, relax_pipeline=tvm.transform.Sequential(
            [stages, relax.pipeline.default_build_pipeline()]))
    run = vm_runner(executable, graph_input_names(model))
    run.stages = stages
    return run


EINWELD = Runner("tvm_einweld", prepare_einweld,
                 "tvm_einweld pipeline: derivations + tile-graph fusion + adaptive layout tuning")
