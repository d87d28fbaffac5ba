"""TileGraphFusion vs stock TVM (MetaSchedule at the same trial budget) on memory-bound subgraphs.

For each workload of `tvm_einweld.tir_passes.workloads`, in one process on this machine:

* stock: the passes of `relax.pipeline.static_shape_tuning_pipeline` (DecomposeOpsForInference,
  CanonicalizeBindings, the zero pipeline, MetaSchedule tuning, MetaScheduleApplyDatabase), with
  MetaSchedule given as many trials as TileGraphFusion measured kernels for the same module (the
  same trial budget, split evenly over its tasks), then tvm.compile. The only change from the
  stock pipeline is a longer build/run timeout for MetaSchedule's local builder and runner: on a
  loaded 2-core machine their default 30 s kills every build, which would leave stock untuned;
* fused: `prepare()` + `TileGraphFusion(target, topk)` (scheduling includes its measurements and
  the random-input check of every group), then tvm.compile;

both are checked against each other on random inputs, then run alternately (A B A B ...); the
table reports medians, the stock/fused latency ratio, the cost model's DRAM traffic of the fused
plan and of the same nodes unconnected, and the scheduling time of TileGraphFusion vs the tuning
time of MetaSchedule.

    python benchmarks/tile_fusion.py            # full sizes
    python benchmarks/tile_fusion.py --quick    # reduced sizes and repetitions, a few minutes
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import tvm
from tvm import relax

from tvm_einweld.machine import cpu_model
from tvm_einweld.tir_passes import TileGraphFusion, prepare, workloads
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.scheduler import subgraph_tiling
from tvm_einweld.tir_passes.tile_graph import build_tile_graph, subgraph

FULL = {
    "matmul_softmax": dict(m=16384, k=64, n=128),
    "conv_relu_maxpool": dict(batch=1, channels=32, size=56, filters=32),
    "layernorm_chain": dict(rows=4096, dim=256),
    "bert_attention": dict(seq=128, hidden=256, heads=4),
    "bert_encoder": dict(seq=128, hidden=256, heads=4, ffn=1024),
}
QUICK = {
    "matmul_softmax": dict(m=4096, k=64, n=128),
    "conv_relu_maxpool": dict(batch=1, channels=16, size=28, filters=16),
    "layernorm_chain": dict(rows=1024, dim=256),
    "bert_attention": dict(seq=64, hidden=128, heads=2),
    "bert_encoder": dict(seq=64, hidden=128, heads=2, ffn=512),
}


def _vm(mod, target):
    return relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())


def _args(mod, seed=0):
    rng = np.random.default_rng(seed)
    return [tvm.runtime.tensor(rng.standard_normal([int(d) for d in p.ty.shape.values])
                               .astype("float32")) for p in mod["main"].params]


def _alternate(calls: dict, repeats: int) -> dict:
    """Median seconds per call, the calls timed round-robin so drifts hit them alike."""
    for fn in calls.values():
        fn()
    reps = {}
    for name, fn in calls.items():  # back-to-back calls per sample: samples of ~20 ms at least
        start = time.perf_counter()
        fn()
        reps[name] = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / reps[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def _stock_tuned(mod, target, trials: int):
    """static_shape_tuning_pipeline's passes, MetaSchedule with patient builder and runner."""
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    with target:
        mod = tvm.transform.Sequential([
            relax.transform.DecomposeOpsForInference(),
            relax.transform.CanonicalizeBindings(),
            relax.pipeline.zero_pipeline(),
        ])(mod)
    tasks = sum(1 for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    per_task = max(1, math.ceil(trials / max(1, tasks)))
    with tempfile.TemporaryDirectory() as work_dir:
        ms.relax_integration.tune_relax(
            mod=mod, params={}, target=target, work_dir=work_dir,
            max_trials_global=per_task * tasks, max_trials_per_task=per_task,
            num_trials_per_iter=min(64, per_task),
            builder=ms.builder.LocalBuilder(timeout_sec=600),
            runner=ms.runner.LocalRunner(timeout_sec=300))
        with target:
            mod = relax.transform.MetaScheduleApplyDatabase(work_dir)(mod)
    return mod, per_task * tasks


def _unconnected_traffic(mod, device) -> int:
    """The model's DRAM traffic of every node on its own, with its best tile."""
    graph = build_tile_graph(mod)
    total = 0
    for node in graph.nodes:
        cands = subgraph_tiling(graph, subgraph(graph, [node.name]), device, 1)
        if cands:
            total += cands[0].cost.traffic
    return total


def bench_one(name: str, sizes: dict, target, topk: int, repeats: int, min_trials: int) -> dict:
    mod = workloads.WORKLOADS[name](**sizes)
    prepared = prepare()(mod)

    fuse = TileGraphFusion(target, topk=topk)
    start = time.perf_counter()
    fused = fuse(prepared)
    schedule_s = time.perf_counter() - start
    report = fuse.report
    trials = max(report.measurements, min_trials)

    start = time.perf_counter()
    tuned, trials = _stock_tuned(mod, target, trials)
    tune_s = time.perf_counter() - start

    stock_vm, fused_vm = _vm(tuned, target), _vm(fused, target)
    args = _args(mod)
    want = stock_vm["main"](*args).numpy()
    got = fused_vm["main"](*args).numpy()
    max_err = float(np.max(np.abs(want - got)))
    if not np.allclose(want, got, rtol=1e-3, atol=1e-3):
        raise SystemExit(f"{name}: fused and stock disagree (max abs error {max_err})")

    times = _alternate({"stock": lambda: stock_vm["main"](*args),
                        "fused": lambda: fused_vm["main"](*args)}, repeats)
    fused_traffic = sum(g.candidate.cost.traffic for g in report.plan.groups)
    return {
        "workload": name,
        "sizes": ",".join(f"{k}={v}" for k, v in sizes.items()),
        "stock_ms": times["stock"] * 1e3,
        "fused_ms": times["fused"] * 1e3,
        "ratio": times["stock"] / times["fused"],
        "groups": sum(1 for names in report.replaced if len(names) > 1),
        "nodes": len(build_tile_graph(prepared).nodes),
        "kernels": len(report.replaced),
        "traffic_mb": fused_traffic / 2**20,
        "unconnected_mb": _unconnected_traffic(prepared, fuse.device) / 2**20,
        "trials": trials,
        "tgf_measured": report.measurements,
        "schedule_s": schedule_s,
        "tune_s": tune_s,
        "max_err": max_err,
    }


def markdown(rows, header: str) -> str:
    lines = [header, "",
             "| workload | sizes | stock TVM (MetaSchedule) ms | TileGraphFusion ms | stock/fused "
             "| fused groups / nodes | model DRAM MiB fused / unconnected | trials (TGF measured) "
             "| TGF schedule s | MS tune s | tune/schedule |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['sizes']} | {r['stock_ms']:.3f} | {r['fused_ms']:.3f} | "
            f"{r['ratio']:.2f}x | {r['groups']} / {r['nodes']} | {r['traffic_mb']:.1f} / "
            f"{r['unconnected_mb']:.1f} | {r['trials']} ({r['tgf_measured']}) | "
            f"{r['schedule_s']:.1f} | {r['tune_s']:.1f} | {r['tune_s'] / r['schedule_s']:.1f}x |")
    ratios = [r["ratio"] for r in rows]
    speed = [r["tune_s"] / r["schedule_s"] for r in rows]
    lines += ["", f"Geomean stock/fused latency ratio: "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x; geomean MetaSchedule "
              f"tuning time / TileGraphFusion scheduling time: "
              f"{math.exp(sum(map(math.log, speed)) / len(speed)):.2f}x."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes and repetitions")
    parser.add_argument("--only", nargs="*", help="workload names to run")
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--out", help="also write the table here, rewritten after each workload")
    parser.add_argument("--min-trials", type=int, default=None,
                        help="lower bound of MetaSchedule's trials (default: TGF's count)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    topk = args.topk or (2 if args.quick else 4)
    repeats = 5 if args.quick else 15
    target = host_target()
    names = [n for n in sizes if not args.only or n in args.only]
    rows = []
    for name in names:
        row = bench_one(name, sizes[name], target, topk, repeats, args.min_trials or 0)
        print(f"{name}: stock {row['stock_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms, "
              f"{row['ratio']:.2f}x; schedule {row['schedule_s']:.1f} s vs tune "
              f"{row['tune_s']:.1f} s", file=sys.stderr, flush=True)
        rows.append(row)
        table = markdown(rows, _header(args, target, topk, repeats, len(rows), len(names)))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(table + "\n")
    print(table)
    return 0


def _header(args, target, topk, repeats, done, total) -> str:
    load = os.getloadavg()
    command = "python benchmarks/tile_fusion.py" + (" --quick" if args.quick else "") + (
        f" --only {' '.join(args.only)}" if args.only else "")
    partial = "" if done == total else f" (PARTIAL: {done} of {total} workloads finished)"
    return (f"Command: `{command}`{partial}  \n"
            f"Machine: {cpu_model()}, {os.cpu_count()} cores, target {target}  \n"
            f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
            f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (other jobs share "
            f"the machine)  \n"
            f"TileGraphFusion top-k {topk}; latencies are medians of {repeats} alternating "
            f"samples.")


if __name__ == "__main__":
    sys.exit(main())
