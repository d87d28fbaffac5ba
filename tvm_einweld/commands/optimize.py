"""`python -m tvm_einweld optimize MODEL.onnx`: the einweld pipeline on the user's model.

Imports the ONNX file, compiles it through the "einweld" pipeline for `--target`, checks the
result against onnxruntime on random inputs (on the CPU), and exports the compiled library
with `-o`. Operators the derivation search does not support are left to stock TVM with a note.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "optimize an ONNX model with the einweld pipeline and export the compiled library"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="path to an .onnx file")
    parser.add_argument("--target", default="host",
                        help='TVM target: "host" (this CPU with its -mcpu, e.g. AVX-512; the '
                             'default), "llvm" (generic x86-64), "cuda", or a JSON target')
    parser.add_argument("--cross-compile", action="store_true",
                        help="the target need not run on this machine: compile and export "
                             "without running or checking the model")
    parser.add_argument("--trials", type=int, default=0,
                        help="MetaSchedule trials for adaptive layout tuning (default 0: none)")
    parser.add_argument("--strategy", default="adaptive", choices=("adaptive", "NL", "LR", "LC"),
                        help="layout strategy of the tuning (default adaptive)")
    parser.add_argument("--work-dir", default=None, help="tuning database folder")
    parser.add_argument("-o", "--output", default=None,
                        help="write the compiled library here (e.g. model.so)")
    parser.add_argument("--no-derive", action="store_true", help="skip the derivation search")
    parser.add_argument("--no-fuse", action="store_true", help="skip tile-graph fusion")
    parser.add_argument("--log", default=None, metavar="FILE",
                        help="append one JSON line per subprogram the derivation search saw "
                             "(rules, verification, estimated and measured times)")


def _target(text: str):
    import tvm

    from ..cli import UserError
    from ..tir_passes.device import host_target

    if text == "host":
        return host_target()
    try:
        return tvm.target.Target(json.loads(text) if text.lstrip().startswith("{") else text)
    except Exception as err:
        raise UserError(f"invalid target {text!r}: {err}") from err


def _runs_here(target) -> bool:
    import tvm

    return bool(tvm.device(target.get_target_device_type(), 0).exist)


def run(args: argparse.Namespace) -> int:
    import tvm
    from tvm import relax

    from ..cli import UserError
    from ..einweld_pipeline import EinweldOptimize
    from ..expr.from_relax import SUPPORTED_OPS
    from ..relay_passes.rewrite_log import RewriteLog
    from .demo import operator_calls, show_stages
    from .derive import load_onnx_as_relax

    if args.trials < 0:
        raise UserError("--trials must be >= 0")
    target = _target(args.target)
    if not _runs_here(target) and not args.cross_compile:
        print(f"error: no {target.kind.name} device on this machine: the compiled model could "
              f"not be checked or run here. Pass --cross-compile to compile and export it "
              f"anyway (every check that needs the device is then skipped).")
        return 2
    mod = load_onnx_as_relax(args.model)
    kinds = {str(call.op.name) for _, call, _ in operator_calls(mod)}
    unsupported = sorted(kinds - set(SUPPORTED_OPS))
    if unsupported:
        print(f"note: no expression form for {', '.join(unsupported)}: these operators are "
              "left to stock TVM (tile-graph fusion and tuning still apply)")
    stages = EinweldOptimize(target, trials=args.trials, work_dir=args.work_dir,
                             derive=not args.no_derive, fuse=not args.no_fuse,
                             layout_strategy=args.strategy)
    print(f"compiling {args.model} for {target.kind.name} ...", flush=True)
    start = time.perf_counter()
    instruments = [RewriteLog(args.log)] if args.log else []
    with tvm.transform.PassContext(instruments=instruments):
        executable = tvm.compile(mod, target, relax_pipeline=tvm.transform.Sequential(
            [stages, relax.pipeline.default_build_pipeline()]))
    print(f"compiled in {time.perf_counter() - start:.1f} s\n")
    show_stages(stages)
    if not _runs_here(target):
        print(f"\nnot checked: no {target.kind.name} device here (--cross-compile); skipped: "
              f"the whole-module checks and the check against onnxruntime")
    elif target.kind.name == "llvm":
        ok = _check_against_onnxruntime(args.model, executable)
        if not ok:
            print("error: the compiled model disagrees with onnxruntime; nothing exported")
            return 1
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        executable.export_library(args.output)
        print(f"\nwrote {args.output}: load it with tvm.runtime.load_module and run it on "
              f"relax.VirtualMachine(lib, tvm.cpu())['main'](*inputs), inputs in the order of "
              f"the model's graph inputs: {', '.join(_graph_inputs(args.model))}")
    return 0


def _graph_inputs(path: str) -> list:
    import onnx

    from ..bench.runners import graph_input_names

    return list(graph_input_names(onnx.load(path)))


def _check_against_onnxruntime(path: str, executable) -> bool:
    import onnx

    from ..bench.check import compare_outputs
    from ..bench.runners import graph_input_names, reference_outputs, vm_runner
    from ..models import random_inputs

    model = onnx.load(path)
    inputs = random_inputs(model)
    run = vm_runner(executable, graph_input_names(model))
    agreement = compare_outputs(run(inputs), reference_outputs(model, inputs))
    print(f"\ncheck against onnxruntime on random inputs: "
          f"{'ok' if agreement.ok else 'MISMATCH'}: {agreement.detail}")
    return agreement.ok
