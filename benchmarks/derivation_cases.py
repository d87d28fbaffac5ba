"""Original vs derived programs for the paper's derivation cases, side by side, and eOperator
bandwidth against this machine's copy bandwidth.

    python benchmarks/derivation_cases.py             # full measurement
    python benchmarks/derivation_cases.py --quick     # reduced shapes, a few minutes
    python benchmarks/derivation_cases.py --trials 64 # both sides tuned by MetaSchedule
                                                      # (static_shape_tuning_pipeline)

Each case is derived by the fixed rule sequence in `tvm_einweld.relay_passes.cases`,
instantiated to Relax and built with `tvm.compile`; the original is TVM's own operator
(`nn.conv2d`, `nn.conv2d_transpose`, `matmul`; G2BMM as a TE kernel, since Relax has none).
Both are checked equal on random inputs before timing. Timing alternates original and derived
in rounds and reports medians. Without --trials both sides use TVM's untuned default lowering
(the same for both); with --trials both get the same MetaSchedule budget.

eOperator bandwidth: every eOperator of a derived program is compiled alone and timed; bytes
moved = its inputs read once + its output written once. It is compared with a TVM copy kernel
(same default schedule) moving the same bytes, timed alternately with it (small eOperators run
from cache, so a large copy would flatter them), and with the large-copy bandwidth (128 MiB
moved; numpy's copy for reference).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np
import tvm
from tvm import relax, te

from tvm_einweld.bench.timing import median_seconds
from tvm_einweld.expr import Tensor, random_inputs
from tvm_einweld.machine import cpu_model
from tvm_einweld.relay_passes import cases as C
from tvm_einweld.relay_passes.eoperator import eoperator_target
from tvm_einweld.relay_passes.instantiate import instantiate
from tvm_einweld.tir_passes.rules.cpu.memory_bound import schedule_eoperator

TARGET = {"kind": "llvm", "num-cores": os.cpu_count() or 1}


def case_list(quick: bool):
    """(label, builder) pairs; full shapes follow the paper's Table 3 where a CPU allows."""
    if quick:
        return [
            ("conv3x3 1×128×14×14→128", lambda: C.conv3x3_to_matmul(
                Tensor("A", (1, 128, 14, 14)), Tensor("K", (128, 128, 3, 3)))),
            ("convT 4×128×4×4→96 (4×4, s2)", lambda: C.conv_transpose_to_matmul(
                Tensor("A", (4, 128, 4, 4)), Tensor("W", (128, 96, 4, 4)))),
            ("conv5x5 1×32×56×56→1", lambda: C.conv5x5_to_conv3x3(
                Tensor("A", (1, 32, 56, 56)), Tensor("K", (1, 32, 5, 5)))),
            ("G2BMM 2×1000×64 w50 d4", lambda: C.dilated_g2bmm(
                Tensor("A", (2, 1000, 64)), Tensor("B", (2, 1000, 64)), 50, 4)),
            ("2 matmuls 128×256 · 256×(192,192)", lambda: C.merged_matmuls(
                Tensor("A", (128, 256)), Tensor("B1", (256, 192)), Tensor("B2", (256, 192)))),
        ]
    return [
        ("conv3x3 1×512×7×7→512", lambda: C.conv3x3_to_matmul(
            Tensor("A", (1, 512, 7, 7)), Tensor("K", (512, 512, 3, 3)))),
        ("convT 16×256×2×2→448 (4×4, s2)", lambda: C.conv_transpose_to_matmul(
            Tensor("A", (16, 256, 2, 2)), Tensor("W", (256, 448, 4, 4)))),
        ("conv5x5 4×32×224×224→1", lambda: C.conv5x5_to_conv3x3(
            Tensor("A", (4, 32, 224, 224)), Tensor("K", (1, 32, 5, 5)))),
        ("G2BMM 8×2000×64 w100 d4", lambda: C.dilated_g2bmm(
            Tensor("A", (8, 2000, 64)), Tensor("B", (8, 2000, 64)), 100, 4)),
        ("2 matmuls 512×512 · 512×(384,384)", lambda: C.merged_matmuls(
            Tensor("A", (512, 512)), Tensor("B1", (512, 384)), Tensor("B2", (512, 384)))),
    ]


def compile_module(mod: tvm.IRModule, trials: int, work_dir: str):
    target = tvm.target.Target(TARGET)
    if trials:  # tune, then the default build (the tuning pipeline leaves call_tir unlowered)
        mod = relax.pipeline.static_shape_tuning_pipeline(
            total_trials=trials, target=target, work_dir=work_dir)(mod)
    ex = tvm.compile(mod, target=target)
    return relax.VirtualMachine(ex, tvm.cpu())


def outputs(vm, args) -> Tuple[np.ndarray, ...]:
    out = vm["main"](*args)
    return (out.numpy(),) if hasattr(out, "numpy") else tuple(o.numpy() for o in out)


def time_alternating(fns: Sequence, rounds: int) -> List[float]:
    """Median seconds per call of each `f(n)` (which runs n calls), alternating rounds."""
    return median_seconds([lambda f=f: f(1) for f in fns], rounds)


def vm_runner(vm, args):
    fn = vm["main"]

    def run(n: int) -> None:
        for _ in range(n):
            fn(*args)

    return run


def prim_runner(func: tvm.tirx.PrimFunc):
    """A runner for one PrimFunc on random arguments, and the bytes it moves."""
    func = func.with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(TARGET))
    args, nbytes = [], 0
    for param in func.params:  # TVM 0.27: a PrimFunc parameter carries its buffer's type
        shape = [int(s) for s in param.shape]
        arr = np.random.default_rng(0).uniform(-1, 1, shape).astype(str(param.dtype))
        args.append(tvm.runtime.tensor(arr))
        nbytes += arr.nbytes
    fn = lib["main"]

    def run(n: int) -> None:
        for _ in range(n):
            fn(*args)

    return run, nbytes


def copy_runner(nbytes: int):
    """A TVM copy kernel (scheduled as eOperators are) moving `nbytes` (read + write)."""
    n = max(1024, nbytes // 8 // 1024 * 1024)  # float32 elements copied
    a = te.placeholder((n // 1024, 1024), "float32", name="a")
    b = te.compute(a.shape, lambda i, j: a[i, j], name="copy")
    func = te.create_prim_func([a, b])
    return prim_runner(schedule_eoperator(func, eoperator_target(tvm.target.Target(TARGET))))


def copy_bandwidth(rounds: int, nbytes: int = 128 << 20) -> Tuple[float, float]:
    """(TVM copy kernel GB/s, numpy copy GB/s) moving `nbytes` (read + write)."""
    run, moved = copy_runner(nbytes)
    src = np.random.default_rng(0).uniform(size=moved // 8).astype("float32")
    dst = np.empty_like(src)

    def np_copy(k: int) -> None:
        for _ in range(k):
            np.copyto(dst, src)

    t_tvm, t_np = time_alternating([run, np_copy], rounds)
    return moved / t_tvm / 1e9, 2 * src.nbytes / t_np / 1e9


def machine() -> str:
    cpu = cpu_model()
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, " \
           f"TVM {tvm.__version__}, Python {platform.python_version()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced shapes and rounds")
    parser.add_argument("--rounds", type=int, default=None, help="alternating timing rounds")
    parser.add_argument("--trials", type=int, default=0,
                        help="MetaSchedule trials per side (0: untuned default lowering)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    started = time.time()
    print(f"# Derivation cases: original vs derived\n")
    print(f"- command: `python benchmarks/derivation_cases.py"
          f"{' --quick' if args.quick else ''}{f' --trials {args.trials}' if args.trials else ''}`")
    print(f"- machine: {machine()}")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"load average at start {os.getloadavg()[0]:.1f} (other processes share the cores)")
    print(f"- build: {'MetaSchedule, %d trials per side' % args.trials if args.trials else 'tvm.compile default (untuned), both sides'}; "
          f"medians of {rounds} alternating rounds\n")
    tvm_bw, np_bw = copy_bandwidth(rounds)
    copy_bw = max(tvm_bw, np_bw)
    print(f"Copy bandwidth (128 MiB moved, read + write): TVM copy kernel {tvm_bw:.1f} GB/s, "
          f"numpy {np_bw:.1f} GB/s\n")

    rows, eop_rows = [], []
    for label, build_case in case_list(args.quick):
        case = build_case()
        inst = instantiate(case.derived[0] if len(case.derived) == 1 else case.derived)
        inputs: Dict[str, np.ndarray] = {}
        for i, e in enumerate(case.original):
            inputs.update(random_inputs(e, seed=i))
        vm_args = [tvm.runtime.tensor(inputs[n]) for n in inst.input_names]
        with tempfile.TemporaryDirectory() as work:
            original = compile_module(C.original_module(case), args.trials, work + "/o")
            derived = compile_module(inst.mod, args.trials, work + "/d")
        for o, d in zip(outputs(original, vm_args), outputs(derived, vm_args)):
            scale = max(1.0, float(np.abs(o).max()))
            if not np.allclose(d, o, rtol=1e-3, atol=1e-4 * scale):
                print(f"{label}: derived program differs from the original", file=sys.stderr)
                return 1
        t_o, t_d = time_alternating([vm_runner(original, vm_args), vm_runner(derived, vm_args)],
                                    rounds)
        kernels = " + ".join(n if k == "eOperator" else k for k, n in inst.kernels)
        rows.append((label, t_o, t_d, kernels))
        for kind, name in inst.kernels:
            if kind not in ("eOperator",):
                continue
            run, nbytes = prim_runner(inst.mod[name])
            copy, copied = copy_runner(nbytes)
            t, t_copy = time_alternating([run, copy], rounds)
            eop_rows.append((label, name, nbytes, t, nbytes / t / 1e9, copied / t_copy / 1e9))

    print("| case | original (ms) | derived (ms) | speedup | derived program |")
    print("|---|---:|---:|---:|---|")
    for label, t_o, t_d, kernels in rows:
        print(f"| {label} | {t_o * 1e3:.3f} | {t_d * 1e3:.3f} | {t_o / t_d:.2f}× | {kernels} |")
    print("\n| case | eOperator | bytes moved | time (ms) | GB/s | copy of same bytes (GB/s) "
          "| ratio | of large-copy bandwidth |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, name, nbytes, t, bw, same in eop_rows:
        print(f"| {label} | {name} | {nbytes / 1e6:.2f} MB | {t * 1e3:.3f} | {bw:.1f} | "
              f"{same:.1f} | {bw / same:.0%} | {bw / copy_bw:.0%} |")
    print(f"\nTotal benchmark time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
