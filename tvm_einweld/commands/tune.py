"""`python -m tvm_einweld tune MODEL.onnx | --task conv2d:N,C,H,W,F,K,S,P`: adaptive layout tuning.

Prints every round's strategy and the best time so far, then a final comparison measured side
by side: for a task, the tuned kernel against the untuned one (and, with --compare, against
single-strategy tuning at the same trials); for a model, the tuned build against the untuned one.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile

from .model_input import add_input_shape_argument

_LOG = logging.getLogger("tvm_einweld.progress")

HELP = "tune with adaptive layout strategies (AL-Ansor on MetaSchedule): an ONNX model or one conv2d task"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="ONNX model to tune (dynamic dimensions bound by "
                        "--input-shape, 1 otherwise)")
    parser.add_argument("--task", help="tune one conv block instead: conv2d:N,C,H,W,F,K,S,P "
                        "(pad P, KxK conv with F filters and stride S, bias, ReLU)")
    parser.add_argument("--trials", type=int, default=64,
                        help="trials per task (a model's budget is trials x tasks; default 64)")
    parser.add_argument("--strategy", default="adaptive", choices=["adaptive", "NL", "LR", "LC"],
                        help="layout strategy; adaptive switches between them (default)")
    parser.add_argument("--selector", choices=["predefined", "bandit", "leader", "stall"], default=None,
                        help="strategy selector for --strategy adaptive (default: predefined 5:5:6)")
    parser.add_argument("--per-round", type=int, default=16, help="candidates per round (default 16)")
    parser.add_argument("--compare", action="store_true",
                        help="with --task: also tune NL, LR and LC alone at the same trials")
    parser.add_argument("--work-dir", help="tuning database directory (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=-1, help="random seed of the search")
    add_input_shape_argument(parser)


def _target():
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.meta_schedule.utils import cpu_count  # pylint: disable=import-outside-toplevel

    return tvm.target.Target({"kind": "llvm", "num-cores": cpu_count(logical=False)})


def duration(secs) -> str:
    """A time in a unit that shows its digits: µs below 0.1 ms, ms below 10 s."""
    if secs is None:
        return "n/a"
    if secs < 1e-4:
        return f"{secs * 1e6:.2f} µs"
    return f"{secs * 1e3:.3f} ms" if secs < 10 else f"{secs:.1f} s"


def _print_round(task: str, outcome) -> None:
    best = duration(outcome.best_so_far_secs)
    failed = f"  ({outcome.failures} failed)" if outcome.failures else ""
    print(f"{task}  round {outcome.round_index + 1:3d}  {outcome.strategy.value}  best so far {best}{failed}",
          flush=True)


def _fmt(secs) -> str:
    return "n/a" if secs is None else f"{secs * 1e3:.4f}"  # table cells: ms, 4 decimals


def _parse_task(spec: str):
    from tvm_einweld.auto_scheduler_ext.workloads import Conv2dBlock  # pylint: disable=import-outside-toplevel
    from tvm_einweld.cli import UserError  # pylint: disable=import-outside-toplevel

    kind, _, shape = spec.partition(":")
    if kind != "conv2d":
        raise UserError(f"--task {spec!r}: only conv2d:N,C,H,W,F,K,S,P tasks are supported")
    try:
        return Conv2dBlock.parse(shape)
    except ValueError as err:
        raise UserError(f"--task: {err}") from None


def _tune_block(block, args, work_dir: str) -> int:
    # pylint: disable=import-outside-toplevel
    from tvm_einweld.auto_scheduler_ext import comparison

    target = _target()
    label = args.strategy + (f"-{args.selector}" if args.selector else "")
    variants = [comparison.Variant(label, args.strategy, args.selector)]
    if args.compare:
        variants += [v for v in comparison.SINGLE_AND_ADAPTIVE[:3] if v.label != args.strategy]
    results = comparison.tune_variants(
        block.module(), target, work_dir, args.trials, variants, task_name=block.name,
        on_round=_print_round, num_trials_per_iter=args.per_round, seed=args.seed,
    )
    from tvm import s_tir

    untuned = s_tir.Schedule(block.module())  # the task as written, no schedule
    secs = comparison.remeasure([untuned] + [r.best_program for r in results], target)
    print(f"\nfinal comparison for {block.name} ({args.trials} trials each, re-measured side by side, "
          "median ms):")
    print("| variant | best ms | GFLOP/s | rounds NL/LR/LC | wall s |")
    print("|---|---|---|---|---|")
    print(f"| untuned | {_fmt(secs[0])} | {_gflops(block, secs[0])} | - | - |")
    for r, t in zip(results, secs[1:]):
        counts = "/".join(str(sum(o.strategy.value == s for o in r.tuning.rounds)) for s in ("NL", "LR", "LC"))
        print(f"| {r.variant.label} | {_fmt(t)} | {_gflops(block, t)} | {counts} | {r.tuning.wall_secs:.0f} |")
    print(f"\ndatabase of the {label} run: {os.path.join(work_dir, block.name + '-' + label)}")
    return 0 if results[0].best_program is not None else 1


def _gflops(block, secs) -> str:
    return "n/a" if not secs else f"{block.flops / secs / 1e9:.1f}"


def _first(output):
    """The first output of a VM call as numpy (a single Tensor or a tuple of them)."""
    return output.numpy() if hasattr(output, "numpy") else output[0].numpy()


def _tune_model(model, path: str, args, work_dir: str) -> int:
    # pylint: disable=import-outside-toplevel
    import numpy as np
    import tvm
    from tvm import relax

    from tvm_einweld.auto_scheduler_ext.comparison import machine_description
    from tvm_einweld.auto_scheduler_ext.entry_points import (
        adaptive_layout_tuning_pass,
        prepare_relax,
        relax_tasks,
    )
    from tvm_einweld.commands.model_input import load
    from tvm_einweld.models import random_inputs

    model, mod = load(model, path, args.input_shape)
    target = _target()
    _LOG.info("extracting tuning tasks ...")
    num_tasks = len(relax_tasks(prepare_relax(mod, None, target), target))
    _LOG.info("%d tasks, %d trials each: tuning ...", num_tasks, args.trials)
    stage = adaptive_layout_tuning_pass(
        target, work_dir, max_trials_global=args.trials * max(1, num_tasks), layout_strategy=args.strategy,
        selector=args.selector, num_trials_per_iter=args.per_round, seed=args.seed, on_round=_print_round,
    )
    tuned = stage(mod)
    _LOG.info("compiling the untuned and tuned builds ...")
    inputs = [tvm.runtime.tensor(x) for x in random_inputs(model).values()]
    vms = {
        "untuned": relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu()),
        "tuned": relax.VirtualMachine(tvm.compile(tuned, target), tvm.cpu()),
    }
    outs = {k: vm["main"](*inputs) for k, vm in vms.items()}
    if not np.allclose(_first(outs["tuned"]), _first(outs["untuned"]), rtol=1e-3, atol=1e-3):
        print("error: the tuned build's output differs from the untuned build's", flush=True)
        return 1
    timers = {k: vm.time_evaluator("main", tvm.cpu(), number=1, repeat=1, min_repeat_ms=50) for k, vm in vms.items()}
    samples = {k: [] for k in timers}
    _LOG.info("timing both builds, alternating ...")
    for _ in range(5):
        for k, t in timers.items():
            samples[k].append(t(*inputs).mean)
    med = {k: float(np.median(v)) for k, v in samples.items()}
    print(f"\nfinal comparison for {path} on {machine_description()} (median of 5 alternating runs):")
    print("| build | time | speedup |\n|---|---|---|")
    for k in ("untuned", "tuned"):
        print(f"| {k} | {duration(med[k])} | {med['untuned'] / med[k]:.2f}x |")
    print("outputs of the tuned and untuned builds agree")
    if med["tuned"] > med["untuned"]:
        print(f"the tuned build is slower ({args.trials} trials found nothing better than the "
              f"default schedules): keep the untuned build; more --trials may help",
              flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from tvm_einweld.cli import UserError  # pylint: disable=import-outside-toplevel
    from tvm_einweld.commands.model_input import read_onnx  # pylint: disable=import-outside-toplevel

    if (args.model is None) == (args.task is None):
        raise UserError("give either an ONNX model file or --task conv2d:N,C,H,W,F,K,S,P")
    if args.trials <= 0:
        raise UserError("--trials must be positive")
    if args.per_round <= 0:
        raise UserError("--per-round must be positive")
    if args.selector is not None and args.strategy != "adaptive":
        raise UserError("--selector applies only to --strategy adaptive")
    if args.compare and args.task is None:
        raise UserError("--compare applies only to --task")
    if args.input_shape and args.model is None:
        raise UserError("--input-shape applies only to an ONNX model")
    block = _parse_task(args.task) if args.task is not None else None
    model = read_onnx(args.model) if args.model is not None else None
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="einweld-tune-")
    os.makedirs(work_dir, exist_ok=True)
    if block is not None:
        _LOG.info("tuning %s in %s ...", block.name, work_dir)
        return _tune_block(block, args, work_dir)
    _LOG.info("tuning %s in %s ...", args.model, work_dir)
    return _tune_model(model, args.model, args, work_dir)
