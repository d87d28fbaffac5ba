"""Derivation search and the DerivationTransform pass, measured (EinNet §6–7).

    python benchmarks/search.py            # full measurement (EinNet's shapes, ResNet-18)
    python benchmarks/search.py --quick    # reduced budget and model, a few minutes
    python benchmarks/search.py --trials 64  # both sides through static_shape_tuning_pipeline

1. Search: for each EinNet operator case, the time the distance-guided search needs to find
   the paper's transformation from the canonical expression (default budget, depth 7), and
   the statistics of a whole budgeted search (states, fingerprint pruning, seconds).
2. Pass: each case as a Relax module (weights as constants) through stock `tvm.compile` and
   through `DerivationTransform` + `tvm.compile`, same build on both sides (untuned default
   lowering, or with --trials the same MetaSchedule budget on both), outputs checked equal,
   timed alternately, medians; onnxruntime for the operators it has. A conv-heavy model from
   the zoo goes through the same comparison.
3. Matched GEMMs: every matmul left in the optimised programs, timed, as a fraction of the
   machine's measured sgemm peak (numpy's BLAS on 1024² matrices).

Several processes share this machine's 2 cores while it runs: timings are noisy.
"""
from __future__ import annotations

import argparse
import datetime
import platform

import sys
import tempfile
import time
from typing import List, Tuple

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper
from tvm import relax

from tvm_einweld import machine
from tvm_einweld.bench.timing import median_seconds as time_alternating
from tvm_einweld.expr import Expr, Tensor
from tvm_einweld.expr import canonical as C
from tvm_einweld.relay_passes.derivation_transform import DerivationTransform
from tvm_einweld.relay_passes.instantiate import instantiate
from tvm_einweld.relay_passes.mapping_table import match_conv2d, match_g2bmm
from tvm_einweld.relay_passes.op_cost import is_memory_bound, levels, time_call
from tvm_einweld.relay_passes.search import (
    Budget, State, default_rules, default_targets, distance_guided_search,
)

TARGET = "llvm"


# --- goals: what "found" means for each case ----------------------------------------------------

def _kernels(state: State):
    try:
        return instantiate(state.expr).kernels
    except Exception:  # not instantiable: not the goal
        return ()


def matmul_plus_eop(state: State) -> bool:
    ks = _kernels(state)
    return any(k == "matmul" for k, _ in ks) and any(k == "eOperator" for k, _ in ks)


def undilated_g2bmm(state: State) -> bool:
    heavy = [lv for lv in levels(state.expr) if not is_memory_bound(lv)]
    return len(heavy) == 1 and any(m.attr("dilation") == 1 for m in match_g2bmm(heavy[0]))


def conv3x3_plus_eop(state: State) -> bool:
    """A conv with a 3×3 kernel as the one compute-bound level, the rest eOperators."""
    if state.depth == 0:
        return False
    heavy = [lv for lv in levels(state.expr) if not is_memory_bound(lv)]
    if len(heavy) != 1:
        return False
    for m in match_conv2d(heavy[0]):
        its = {it.name: it for it in heavy[0].iterators}
        if all(its[r].extent == 3 for _, r, _ in m.attr("spatial")):
            return True
    return False


# --- cases ---------------------------------------------------------------------------------------

def cases(quick: bool):
    """(label, expression, goal, relax builder, onnx builder or None)."""
    g2 = (8, 10000, 64, 1000, 4) if not quick else (2, 2000, 64, 100, 4)
    c5 = (16, 32, 224, 1) if not quick else (1, 32, 56, 1)
    return [
        ("conv3x3 1×512×7×7→512", conv_expr(1, 512, 7, 512, 3), matmul_plus_eop,
         lambda: conv_module(1, 512, 7, 512, 3), lambda: conv_onnx(1, 512, 7, 512, 3)),
        ("conv3x3 1×64×56×56→64", conv_expr(1, 64, 56, 64, 3), matmul_plus_eop,
         lambda: conv_module(1, 64, 56, 64, 3), lambda: conv_onnx(1, 64, 56, 64, 3)),
        ("convT 16×256×2×2→448 (4×4, s2)", convt_expr(16, 256, 2, 448), matmul_plus_eop,
         lambda: convt_module(16, 256, 2, 448), lambda: convt_onnx(16, 256, 2, 448)),
        (f"conv5x5 {c5[0]}×{c5[1]}×{c5[2]}×{c5[2]}→{c5[3]}", conv_expr(*c5, 5),
         conv3x3_plus_eop, lambda: conv_module(*c5, 5), lambda: conv_onnx(*c5, 5)),
        (f"G2BMM {g2[0]}×{g2[1]}×{g2[2]} w{g2[3]} d{g2[4]}",
         C.g2bmm(Tensor("A", g2[:3]), Tensor("B", g2[:3]), width=g2[3], dilation=g2[4]),
         undilated_g2bmm, None, None),
    ]


def conv_expr(n, c, hw, f, k):
    return C.conv2d(Tensor("A", (n, c, hw, hw)), Tensor("K", (f, c, k, k)),
                    padding=(k // 2,) * 4)


def convt_expr(n, c, hw, f):
    return C.conv2d_transpose(Tensor("A", (n, c, hw, hw)), Tensor("K", (c, f, 4, 4)),
                              strides=(2, 2), padding=(1, 1, 1, 1))


def _weights(*shape):
    return np.random.default_rng(1).uniform(-0.1, 0.1, shape).astype("float32")


def _module(x_shape, make_call):
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(make_call(x)))
        bb.emit_func_output(out)
    return bb.get()


def conv_module(n, c, hw, f, k):
    w = relax.const(_weights(f, c, k, k))
    return _module((n, c, hw, hw), lambda x: relax.op.nn.conv2d(x, w, padding=k // 2))


def convt_module(n, c, hw, f):
    w = relax.const(_weights(c, f, 4, 4))
    return _module((n, c, hw, hw), lambda x: relax.op.nn.conv2d_transpose(
        x, w, strides=2, padding=1))


def _onnx(node, x_shape, w, y_shape):
    graph = helper.make_graph(
        [node], "op", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.flatten().tolist())])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def conv_onnx(n, c, hw, f, k):
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[k // 2] * 4)
    return _onnx(node, [n, c, hw, hw], _weights(f, c, k, k), [n, f, hw, hw])


def convt_onnx(n, c, hw, f):
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], pads=[1] * 4)
    return _onnx(node, [n, c, hw, hw], _weights(c, f, 4, 4), [n, f, 2 * hw, 2 * hw])


# --- timing --------------------------------------------------------------------------------------

def build(mod, trials: int, work_dir: str):
    """Compile `mod` (tuned first by static_shape_tuning_pipeline when `trials` > 0) and
    return its `main`."""
    target = tvm.target.Target(TARGET)
    if trials:  # MetaSchedule needs the core count in the target
        target = tvm.target.Target({"kind": TARGET, "num-cores": machine.cpu_cores()})
        mod = relax.pipeline.static_shape_tuning_pipeline(
            total_trials=trials, target=target, work_dir=work_dir)(mod)
    return relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())["main"]


def _inputs(mod):
    rng = np.random.default_rng(0)
    return [rng.uniform(-1, 1, [int(v) for v in p.ty.shape.values]).astype("float32")
            for p in mod["main"].params]


def _flat(out):
    return [out.numpy()] if hasattr(out, "numpy") else [a for o in out for a in _flat(o)]


def compare_pass(mod, transform, trials: int, rounds: int, ort_model=None):
    """(stock s, pass s, ort s or None, chosen program text, pass seconds, module after)."""
    start = time.perf_counter()
    new = transform(mod)
    pass_s = time.perf_counter() - start
    arrays = _inputs(mod)
    with tempfile.TemporaryDirectory() as work:
        stock = build(mod, trials, work + "/a")
        ours = build(new, trials, work + "/b")
    args = [tvm.runtime.tensor(a) for a in arrays]
    for got, ref in zip(_flat(ours(*args)), _flat(stock(*args))):
        scale = max(1.0, float(np.abs(ref).max()))
        if not np.allclose(got, ref, rtol=1e-3, atol=1e-4 * scale):
            raise SystemExit("the optimised module differs from the original")
    fns = [lambda: stock(*args), lambda: ours(*args)]
    if ort_model is not None:
        import onnxruntime as ort

        sess = ort.InferenceSession(ort_model.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        feed = {i.name: a for i, a in zip(sess.get_inputs(), arrays)}
        fns.append(lambda: sess.run(None, feed))
    times = time_alternating(fns, rounds)
    chosen = "; ".join(" + ".join(r.to_json()["chosen"]["ops"]) for r in transform.last_results)
    return times[0], times[1], (times[2] if ort_model is not None else None), chosen, pass_s, new


def compare_programs(original: Expr, derived: Expr, rounds: int):
    """(original s, derived s, derived kernels): an expression without a Relax operator, as
    the TE kernel of its canonical expression, against the instantiated derived program."""
    from tvm_einweld.expr import input_tensors
    from tvm_einweld.relay_passes.eoperator import eoperator_module

    mod = eoperator_module(original, "original")
    inst = instantiate(derived)
    assert list(inst.input_names) == sorted(input_tensors(original))
    args = [tvm.runtime.tensor(a) for a in _inputs(mod)]
    run_o, run_d = build(mod, 0, ""), build(inst.mod, 0, "")
    ref, got = run_o(*args).numpy(), run_d(*args).numpy()
    if not np.allclose(got, ref, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(ref).max()))):
        raise SystemExit("the derived program differs from the original")
    t_o, t_d = time_alternating([lambda: run_o(*args), lambda: run_d(*args)], rounds)
    return t_o, t_d, " + ".join(n if k == "eOperator" else k for k, n in inst.kernels)


def gemm_rows(mod) -> List[Tuple[str, str, float, float]]:
    """(provider, shape, seconds, GFLOP/s) of every matmul in `mod`'s Relax functions."""
    rows = []
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for b in block.bindings:
                call = b.value
                name = getattr(getattr(call, "op", None), "name", None)
                if name == "relax.call_dps_packed":
                    provider, args = str(call.args[0].global_symbol), list(call.args[1].fields)
                elif name == "relax.matmul":
                    provider, args = "relax.matmul", list(call.args)
                else:
                    continue
                if "gemm" not in provider and provider != "relax.matmul":
                    continue
                a, out = [int(v) for v in args[0].ty.shape.values], \
                    [int(v) for v in b.var.ty.shape.values]
                flops = 2.0 * float(np.prod(out)) * a[-1]
                seconds = time_call(call, TARGET)
                rows.append((provider, f"{a} → {out}", seconds, flops / seconds / 1e9))
    return rows


def machine_line() -> str:
    return f"{machine.profile().describe()}; {platform.system()} {platform.release()}, " \
           f"TVM {tvm.__version__}, Python {platform.python_version()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced budget, shapes and model")
    parser.add_argument("--trials", type=int, default=0,
                        help="MetaSchedule trials per side (0: untuned default lowering)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--model", default=None,
                        help="zoo model for the end-to-end row ('none' to skip it)")
    parser.add_argument("--cases", default="",
                        help="only the cases whose label contains this text")
    parser.add_argument("--search-only", action="store_true",
                        help="only section 1 (the search statistics), no builds")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    budget = Budget(time_limit_s=5.0 if args.quick else 30.0)
    started = time.time()
    cmd = "python benchmarks/search.py" + (" --quick" if args.quick else "") + \
        (f" --trials {args.trials}" if args.trials else "") + \
        (" --search-only" if args.search_only else "")
    print("# Derivation search and DerivationTransform\n")
    print(f"- command: `{cmd}`")
    print(f"- machine: {machine_line()}")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    how = (f"MetaSchedule {args.trials} trials per side" if args.trials else
           "tvm.compile default lowering (untuned), both sides")
    print(f"- build: {how}; medians of {rounds} alternating rounds")
    print("- the machine's 2 cores are shared with other jobs while this runs: timings are noisy\n")

    print("## 1. Search (depth 7, distance-guided, from the canonical expression)\n")
    print("| case | found | time to find (s) | rules | states to find | budgeted search: "
          "states | pruned by fingerprint | seconds | stopped by |")
    print("|---|---|---:|---|---:|---:|---:|---:|---|")
    all_cases = [c for c in cases(args.quick) if args.cases in c[0]]
    found_states = {}
    for label, expr, goal, _, _ in all_cases:
        t0 = time.perf_counter()
        hit = distance_guided_search(expr, default_rules(), default_targets(), budget,
                                     stop_when=goal)
        t_find = time.perf_counter() - t0
        found = [s for s in hit.states if goal(s)]
        found_states[label] = found[0] if found else None
        full = distance_guided_search(expr, default_rules(), default_targets(), budget)
        s = full.stats
        rules = " > ".join(found[0].rules) if found else "—"
        print(f"| {label} | {'yes' if found else 'no'} | {t_find:.2f} | {rules} | "
              f"{hit.stats.states} | {s.states} | {s.pruned} ({100 * s.pruned_fraction:.1f}%) | "
              f"{s.seconds:.1f} | {s.stopped_by} |")
        sys.stdout.flush()

    if args.search_only:
        print(f"\nTotal benchmark time {time.time() - started:.0f} s.")
        return 0
    print("\n## 2. Stock tvm.compile vs DerivationTransform + tvm.compile\n")
    print("| workload | stock (ms) | pass (ms) | stock / pass | onnxruntime (ms) | pass / ort "
          "| pass time (s) | chosen program |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    optimised = []
    transform_args = dict(time_limit_s=5.0 if args.quick else 10.0)
    for label, expr, _, make_mod, make_onnx in all_cases:
        if make_mod is None:  # no Relax operator (G2BMM): the found program vs the original
            if found_states[label] is not None:
                t_o, t_d, chosen = compare_programs(expr, found_states[label].expr, rounds)
                print(f"| {label} (original: TE kernel of its expression) | {t_o * 1e3:.3f} | "
                      f"{t_d * 1e3:.3f} | {t_o / t_d:.2f}× | — | — | — | {chosen} |")
            continue
        transform = DerivationTransform(**transform_args)
        t_s, t_p, t_o, chosen, pass_s, new = compare_pass(
            make_mod(), transform, args.trials, rounds, make_onnx() if make_onnx else None)
        optimised.append((label, new))
        ort = f"{t_o * 1e3:.3f} | {t_p / t_o:.2f}" if t_o else "— | —"
        print(f"| {label} | {t_s * 1e3:.3f} | {t_p * 1e3:.3f} | {t_s / t_p:.2f}× | {ort} | "
              f"{pass_s:.1f} | {chosen} |")
        sys.stdout.flush()
    model_name = args.model or ("fsrcnn" if args.quick else "resnet18")
    if model_name != "none":
        optimised.append(end_to_end(model_name, transform_args, args.trials, rounds))
    gemm_table(optimised)
    print(f"\nTotal benchmark time {time.time() - started:.0f} s.")
    return 0


def end_to_end(model_name: str, transform_args: dict, trials: int, rounds: int):
    """The model row of section 2, and the rewrites applied to it."""
    from tvm_einweld.commands.derive import load_onnx_as_relax
    from tvm_einweld.models import build_model

    model = build_model(model_name, batch=1)
    with tempfile.NamedTemporaryFile(suffix=".onnx") as f:
        onnx.save(model, f.name)
        mod = load_onnx_as_relax(f.name)
    transform = DerivationTransform(**transform_args)
    t_s, t_p, t_o, chosen, pass_s, new = compare_pass(mod, transform, trials, rounds, model)
    applied = sum(r.applied for r in transform.last_results)
    print(f"| {model_name} (batch 1, {len(transform.last_results)} subprograms, {applied} "
          f"rewritten) | {t_s * 1e3:.3f} | {t_p * 1e3:.3f} | {t_s / t_p:.2f}× | "
          f"{t_o * 1e3:.3f} | {t_p / t_o:.2f} | {pass_s:.1f} | see below |")
    for r in transform.last_results:
        if r.applied:
            rec = r.to_json()
            print(f"\n- {model_name} subprogram {r.subprogram.index}: "
                  f"{' + '.join(rec['ops'])} → {' + '.join(rec['chosen']['ops'])} "
                  f"(estimated {rec['chosen']['orig_time_s'] * 1e3:.3f} → "
                  f"{rec['chosen']['est_time_s'] * 1e3:.3f} ms, measured "
                  f"{r.measured_before_s * 1e3:.3f} → {r.measured_after_s * 1e3:.3f} ms)")
    return model_name, new


def gemm_table(optimised) -> None:
    print("\n## 3. Matched GEMMs against the machine's sgemm peak\n")
    from tvm_einweld.relay_passes.op_cost import best_seconds

    peak = machine.profile().peak_gflops
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    c = np.empty_like(a)
    now = 2 * 1024 ** 3 / best_seconds(lambda: np.matmul(a, a, out=c), repeats=7) / 1e9
    print(f"sgemm peak (numpy, 1024²): {peak:.0f} GFLOP/s as cached by `machine.profile()`, "
          f"{now:.0f} GFLOP/s measured now (best of 7)\n")
    print("| workload | provider | shape | time (ms) | GFLOP/s | of cached peak | of peak now |")
    print("|---|---|---|---:|---:|---:|---:|")
    for label, mod in optimised:
        for provider, shape, seconds, gflops in gemm_rows(mod):
            print(f"| {label} | {provider} | {shape} | {seconds * 1e3:.3f} | {gflops:.0f} | "
                  f"{gflops / peak:.0%} | {gflops / now:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
