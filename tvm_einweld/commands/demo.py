"""`python -m tvm_einweld demo`: the main job on a built-in model (default: InfoGAN, batch 1).

1. Every operator as a tensor-algebra expression, with its fingerprint and the evidence that
   the expression is right: evaluated by the numpy interpreter and by its own TE lowering,
   against TVM's build of the operator on random inputs.
2. The model through the "einweld" pipeline: what the derivation search rewrote (rules,
   verification), which groups tile-graph fusion fused, and (with --trials) the tuning.
3. Latency side by side, alternating, medians: stock TVM at the same trial budget
   (`tvm.compile` untuned at 0 trials, `static_shape_tuning_pipeline` otherwise),
   onnxruntime, tvm_einweld; every output checked against onnxruntime first.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

import numpy as np

HELP = "run the main job on a built-in model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="infogan",
                        help="zoo model to run (default infogan; see `bench --list`)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--trials", type=int, default=0,
                        help="MetaSchedule trials for tvm_einweld and for stock TVM (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--repeats", type=int, default=5, help="timing samples per runner")


def operator_calls(mod) -> List[Tuple[str, object, List[str]]]:
    """(binding name, call, tensor argument names) for every operator call in `main`."""
    import tvm
    from tvm import relax

    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                names = [a.name if isinstance(a, relax.Var) else f"const{k}"
                         for k, a in enumerate(value.args) if isinstance(a.ty, relax.TensorType)]
                found.append((binding.var.name, value, names))
    return found


def _tvm_reference(call, inputs):
    """Build the single operator with stock TVM (its constant arguments kept) and run it."""
    import tvm
    from tvm import relax

    from tvm_einweld.expr.from_relax import single_op_module

    constants = list(call.args)[len(inputs):]
    mod, _ = single_op_module(
        lambda *params: relax.Call(call.op, list(params) + constants, call.attrs, call.ty_args),
        [a.shape for a in inputs], str(inputs[0].dtype))
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


def show_expressions(mod, seed: int) -> int:
    """Section 1; returns the number of operators whose expression failed verification."""
    from tvm_einweld.expr import evaluate, random_inputs
    from tvm_einweld.expr.fingerprint import fingerprint
    from tvm_einweld.expr.from_relax import UnsupportedOperator, expr_of_call, op_name
    from tvm_einweld.expr.lowering import build
    from tvm_einweld.verify.random_testing import compare_arrays

    failures = 0
    for var, call, names in operator_calls(mod):
        print(f"── {var} = {op_name(call)}")
        try:
            expr = expr_of_call(call, names)
        except UnsupportedOperator as err:
            print(f"   left to stock TVM: {err}\n")
            continue
        print(f"   {expr}")
        print(f"   fingerprint {fingerprint(expr)}")
        inputs = random_inputs(expr, seed=seed)
        value = evaluate(expr, inputs)
        reference = _tvm_reference(call, [inputs[n] for n in names])
        lowered, order = build(expr)
        against_tvm = compare_arrays([("output", value, reference)], expr.dtype,
                                     "interpreter vs TVM build")
        against_te = compare_arrays([("output", lowered(*[inputs[n] for n in order]), value)],
                                    expr.dtype, "TE lowering vs interpreter")
        ok = against_tvm.equal and against_te.equal
        failures += not ok
        print(f"   verified: {'OK' if ok else 'FAILED'} (interpreter vs TVM build max |err| "
              f"{against_tvm.max_abs_error:.1e}; TE lowering vs interpreter "
              f"{against_te.max_abs_error:.1e})\n")
    return failures


def show_stages(stages) -> None:
    """Section 2: what each stage of the pipeline found."""
    from tvm_einweld.einweld_pipeline import tuning_summary

    from .model_input import plain_note

    print("Derivation search (EinNet):")
    results = stages.derivation.last_results if stages.derivation is not None else ()
    for r in results:
        chosen = [name for o in r.ops for name in o.chosen.ops]
        rules = [rule for o in r.ops for rule in o.chosen.rules]
        states = sum(o.stats.states for o in r.ops if o.stats)
        pruned = sum(o.stats.pruned for o in r.ops if o.stats)
        status = "applied" if r.applied else "kept original"
        print(f"  {' → '.join(r.subprogram.kinds)}: {status}; {states} states "
              f"({pruned} pruned by fingerprint)")
        if rules:
            print(f"    derived {' + '.join(chosen)} by {' > '.join(rules)}")
            print(f"    estimate {r.est_time_s * 1e3:.3f} ms vs {r.orig_time_s * 1e3:.3f} ms; "
                  f"verified: {r.verified} ({plain_note(r.verification)})")
    if stages.derivation is None:
        print("  off")
    elif not results:
        print("  no supported subprogram")
    print("Tile-graph fusion (Welder):")
    report = stages.fusion.report if stages.fusion is not None else None
    if report is None or not report.replaced:
        print("  no group fused")
    else:
        for group in report.replaced:
            kind = "fused group" if len(group) > 1 else "tiled kernel"
            print(f"  {kind}: {', '.join(group)} (checked against the unfused kernels)")
        for group, why in report.rejected:
            print(f"  left unfused: {', '.join(group)}: {why}")
    if report is not None and report.analytic:
        print(f"  {len(report.analytic)} kernel(s) left to the analytic rules (faster than "
              f"any tile config; a+b: a group merged into one kernel): "
              f"{', '.join(report.analytic)}")
    rules = getattr(stages, "rules", None)
    if rules is not None:
        families = {}
        for rule in rules.scheduled.values():
            families[rule] = families.get(rule, 0) + 1
        print("Analytic CPU schedules: " + (", ".join(f"{n} {rule}" for rule, n in
                                                    sorted(families.items())) or "none"))
    print("Adaptive layout tuning (AL-Ansor):")
    print(f"  {tuning_summary(stages)}")
    print("Whole-module checks (the final module run against the given one; every stage's, "
          "only if that fails):")
    for check in stages.checks:
        print(f"  {plain_note(str(check))}")
    if not stages.checks:
        print("  no stage changed the module")
    seconds = getattr(stages, "stage_seconds", {})
    if seconds:
        spent = sum(c.seconds for c in stages.checks)
        print("Compile time by stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
              + f" (whole-module checks {spent:.1f} s of it)")


def run(args: argparse.Namespace) -> int:
    from tvm.relax.frontend.onnx import from_onnx

    from tvm_einweld.bench.harness import OK, TimingPlan, benchmark_model
    from tvm_einweld.bench.runners import (
        EINWELD, ONNXRUNTIME, TVM_TUNED, TVM_UNTUNED, Runner, prepare_einweld,
    )
    from tvm_einweld.cli import UserError
    from tvm_einweld.models import ZOO, build_model

    if args.model not in ZOO:
        raise UserError(f"unknown model {args.model!r}; built-in models: {', '.join(ZOO)}")
    if args.batch not in ZOO[args.model].batches:
        raise UserError(f"{args.model} runs at batch {ZOO[args.model].batches} on this machine")
    start = time.perf_counter()
    model = build_model(args.model, batch=args.batch)
    print(f"Built-in model: {args.model}, batch {args.batch} — {ZOO[args.model].summary}\n")
    print("1. Operators as tensor-algebra expressions\n")
    failures = show_expressions(from_onnx(model), args.seed)

    print("2. The einweld pipeline\n")
    stock = TVM_TUNED if args.trials > 0 else TVM_UNTUNED
    with tempfile.TemporaryDirectory(prefix="einweld_demo_") as tmp:
        # The stage report is an object of a pipeline compiled in this process; the timed
        # einweld runner compiles again in its own worker process (its measured decisions come
        # from the on-disk cache, so it is the same program). Spinning thread pools of runners
        # in one process slow each other, so every runner is timed in its own process; with a
        # tuning budget the pipeline would tune twice, so then it is timed here instead.
        report = prepare_einweld(model, args.trials, Path(tmp) / "report")
        show_stages(report.stages)
        isolate = args.trials == 0
        einweld = EINWELD if isolate else Runner("tvm_einweld", lambda *a: report,
                                                 "the einweld pipeline (compiled above)")
        result = benchmark_model(args.model, model, args.batch, [stock, ONNXRUNTIME, einweld],
                                 args.trials, Path(tmp),
                                 TimingPlan(repeats=args.repeats, isolate=isolate),
                                 seed=args.seed, log=lambda line: None)

    where = "each runner in its own process" if isolate else "in this process"
    print(f"\n3. Latency (median of {args.repeats} alternating rounds, {where}, "
          f"{args.trials} trials)\n")
    print(f"  {'runner':14s} {'median ms':>10s}  {'vs ' + stock.name:>16s}  "
          f"{'vs onnxruntime':>14s}  check against onnxruntime")
    base = result.latency(stock.name)
    ort = result.latency(ONNXRUNTIME.name)
    for r in result.results:
        lat = r.latency
        cells = (f"{lat * 1e3:10.2f}", f"{base / lat:15.2f}×" if base and lat else f"{'-':>16s}",
                 f"{ort / lat:13.2f}×" if ort and lat else f"{'-':>14s}") if lat else \
            (f"{'-':>10s}", f"{'-':>16s}", f"{'-':>14s}")
        print(f"  {r.runner:14s} {cells[0]}  {cells[1]}  {cells[2]}  {r.status}: {r.detail}")
    bad = [r for r in result.results if r.status != OK]
    print(f"\nDone in {time.perf_counter() - start:.0f} s. "
          + ("All operators verified; every runner agrees with onnxruntime."
             if not failures and not bad else
             f"{failures} operator expression(s) failed; runners not OK: "
             f"{', '.join(r.runner for r in bad) or 'none'}"))
    return 1 if failures or bad else 0


def builtin_model(channels: int = 16, size: int = 14):
    """A small Relax CNN block (conv3x3 + bias → relu → conv1x1 → reshape → matmul head),
    used by tests that need a module without going through ONNX."""
    from tvm import relax

    rng = np.random.default_rng(0)

    def const(*shape):
        return relax.const(rng.uniform(-0.5, 0.5, shape).astype("float32"))

    bb = relax.BlockBuilder()
    x = relax.Var("data", relax.TensorType((1, channels, size, size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            c1 = bb.emit(relax.op.nn.conv2d(x, const(channels, channels, 3, 3), padding=1))
            b1 = bb.emit(relax.op.add(c1, const(1, channels, 1, 1)))
            r1 = bb.emit(relax.op.nn.relu(b1))
            c2 = bb.emit(relax.op.nn.conv2d(r1, const(8, channels, 1, 1)))
            flat = bb.emit(relax.op.reshape(c2, (1, 8 * size * size)))
            head = bb.emit(relax.op.matmul(flat, const(8 * size * size, 10)))
            out = bb.emit_output(head)
        bb.emit_func_output(out)
    return bb.get()
