"""`python -m tvm_einweld optimize MODEL.onnx`: the einweld pipeline on the user's model.

Imports the ONNX file, compiles it through the "einweld" pipeline for `--target`, checks the
result against onnxruntime on random inputs (on the CPU), and exports the compiled library
with `-o`. Operators the derivation search does not support are left to stock TVM with a note.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .model_input import add_input_shape_argument

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
    parser.add_argument("--no-measure", action="store_true",
                        help="choose by the cost model alone, timing nothing while compiling "
                             "(the same program on every run and machine load)")
    parser.add_argument("--log", default=None, metavar="FILE",
                        help="append one JSON line per subprogram the derivation search saw "
                             "(rules, verification, estimated and measured times)")
    add_input_shape_argument(parser)


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

    from ..cli import UserError
    from ..einweld_pipeline import EinweldOptimize, lowering
    from ..relay_passes.rewrite_log import RewriteLog
    from .demo import show_stages
    from .model_input import load, read_onnx

    if args.trials < 0:
        raise UserError("--trials must be >= 0")
    target = _target(args.target)
    if not _runs_here(target) and not args.cross_compile:
        print(f"error: no {target.kind.name} device on this machine: the compiled model could "
              f"not be checked or run here. Pass --cross-compile to compile and export it "
              f"anyway (every check that needs the device is then skipped).")
        return 2
    model, mod = load(read_onnx(args.model), args.model, args.input_shape)
    note = unsupported_note(mod)
    if note:
        print(note)
    stages = EinweldOptimize(target, trials=args.trials, work_dir=args.work_dir,
                             derive=not args.no_derive, fuse=not args.no_fuse,
                             layout_strategy=args.strategy, measure=not args.no_measure)
    print(f"compiling {args.model} for {target.kind.name} ...", flush=True)
    start = time.perf_counter()
    instruments = [RewriteLog(args.log)] if args.log else []
    with tvm.transform.PassContext(instruments=instruments):
        executable = tvm.compile(mod, target,
                                 relax_pipeline=tvm.transform.Sequential([stages, lowering()]))
    print(f"compiled in {time.perf_counter() - start:.1f} s\n")
    show_stages(stages)
    staged = None
    if args.output:
        # Export before anything runs the executable: running a Relax VM executable records an
        # empty memory scope per constant (TVM 0.27, vm.cc), which export_library then saves
        # and load_module reports as "Scope Saving:/Scope Loaded:" warnings on stderr. The
        # check below then runs the exported library itself, as the user will load it.
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        staged = f"{args.output}.partial{Path(args.output).suffix}"
        executable.export_library(staged)
        executable = tvm.runtime.load_module(staged)
    if not _runs_here(target):
        print(f"\nnot checked: no {target.kind.name} device here (--cross-compile); skipped: "
              f"the whole-module checks and the check against onnxruntime")
    elif target.kind.name == "llvm" and not _check_against_onnxruntime(model, executable):
        print("error: the compiled model disagrees with onnxruntime; nothing exported")
        if staged:
            os.remove(staged)
        return 1
    if staged:
        os.replace(staged, args.output)
        print(f"\nwrote {args.output}: load it with tvm.runtime.load_module and run it on "
              f"relax.VirtualMachine(lib, tvm.cpu())['main'](*inputs), inputs in the order of "
              f"the model's graph inputs: {', '.join(_graph_inputs(model))}")
    return 0


def unsupported_note(mod) -> str:
    """The note naming the operators of `mod` without an expression form ("" when none):
    Relax operators by name, and the TIR functions TVM's ONNX import produced directly by
    their names (never internals such as relax.call_tir, nor import artefacts on constants
    that constant folding removes)."""
    from tvm import relax

    from ..expr.from_relax import SUPPORTED_OPS
    from .demo import operator_calls

    kinds, lowered = set(), set()
    for _, call, _ in operator_calls(relax.transform.FoldConstant()(mod)):
        name = str(call.op.name)
        if name == "relax.call_tir":
            lowered.add(call.args[0].name_hint)
        elif not name.startswith("relax.call_") and name not in SUPPORTED_OPS:
            kinds.add(name)
    parts = []
    if kinds:
        parts.append(f"no expression form for {', '.join(sorted(kinds))}")
    if lowered:
        parts.append(f"TVM's ONNX import lowered {', '.join(sorted(lowered))} to TIR "
                     f"directly, out of the derivation search's reach")
    if not parts:
        return ""
    return (f"note: {'; '.join(parts)}: these operators are left to stock TVM (tile-graph "
            f"fusion and tuning still apply)")


def _graph_inputs(model) -> list:
    from ..bench.runners import graph_input_names

    return list(graph_input_names(model))


def _check_against_onnxruntime(model, executable) -> bool:
    from ..bench.check import compare_outputs
    from ..bench.runners import graph_input_names, reference_outputs, vm_runner
    from ..models import random_inputs

    inputs = random_inputs(model)  # the model's input shapes are bound (static) by now
    run = vm_runner(executable, graph_input_names(model))
    agreement = compare_outputs(run(inputs), reference_outputs(model, inputs))
    print(f"\ncheck against onnxruntime on random inputs: "
          f"{'ok' if agreement.ok else 'MISMATCH'}: {agreement.detail}")
    return agreement.ok
