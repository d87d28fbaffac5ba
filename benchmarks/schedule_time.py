"""How long the analytic CPU rules take to schedule one GEMM-class kernel, without tuning
(issue 12's target: at most 1 s): `python benchmarks/schedule_time.py [--quick]` writes
benchmarks/schedule_time.md (and .json).

The rows are the GEMM-class rows of `benchmarks/kernels.py`: every distinct MatMul, Gemm,
Conv and ConvTranspose of the zoo, each cut out as a one-operator ONNX model. Each is
imported and prepared as the pipeline prepares a module for scheduling
(`tir_passes.fusion.prepare`: transposed convolutions split into stride-1 phases, stock
legalisation and fusion), and every PrimFunc of it is handed to the CPU rule families
(`rules.cpu.schedule_cpu` with the families given, so that the per-process memo answers
nothing), timed with a wall clock, one call each. A row's figure is its slowest kernel's (a
transposed convolution has four phase kernels). Rule names say which family took a kernel.
What is timed is the analytic schedule alone: not the derivation's search, the checks nor the
build (`kernels.py` reports the whole compile of one operator).

Scheduling is single-threaded Python and TVM, so the machine's phases move it little; the
first kernel of the run is scheduled once untimed (imports, TVM's first uses).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kernels as K  # noqa: E402  (the rows of the kernel benchmark)

TARGET_SECONDS = 1.0  # issue 12: scheduling one GEMM-class kernel without tuning
QUICK_ROWS = 6
GEMM_CLASS_RULES = ("conv", "gemm", "gemm-rows")  # the rule families of that target


@dataclass(frozen=True)
class Timed:
    """One row: its slowest GEMM-class kernel's scheduling time and every kernel's rule."""

    label: str
    where: str
    seconds: float | None  # the slowest kernel a GEMM-class rule took; None: no such kernel
    kernels: int
    rules: tuple[str, ...]  # the rule that scheduled each kernel ("none": no rule did)


def schedule_seconds(kernel: "K.Kernel", target) -> Timed:
    """Prepare `kernel`'s model as the pipeline does and time the rules on each PrimFunc."""
    import tvm
    from tvm.relax.frontend.onnx import from_onnx
    from tvm_einweld.tir_passes.fusion import prepare
    from tvm_einweld.tir_passes.rules.cpu import CPU_RULE_FAMILIES, schedule_cpu

    with target:
        mod = prepare()(from_onnx(kernel.model))
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    times, rules = [], []
    for func in funcs:
        start = time.perf_counter()
        result = schedule_cpu(func, target, CPU_RULE_FAMILIES)
        times.append(time.perf_counter() - start)
        rules.append(result[0] if result is not None else "none")
    gemm_class = [t for t, rule in zip(times, rules) if rule in GEMM_CLASS_RULES]
    return Timed(kernel.label, kernel.where, max(gemm_class, default=None), len(funcs),
                 tuple(rules))


def render(rows: list[Timed], command: str, started: str, wall: float) -> str:
    """The report: summary against the target, then one line per row."""
    from tvm_einweld import machine

    scheduled = [r for r in rows if r.seconds is not None]
    seconds = sorted(r.seconds for r in scheduled)
    over = [r for r in scheduled if r.seconds > TARGET_SECONDS]
    slowest = max(scheduled, key=lambda r: r.seconds, default=None)
    lines = [
        "# Scheduling time of the analytic CPU rules (one GEMM-class kernel, no tuning)", "",
        f"Command: `{command}`  ",
        f"Date: {started} (wall time {wall / 60:.1f} min)  ",
        f"Machine: {machine.cpu_model()}, {len(machine.usable_cpus())} usable CPUs; "
        f"Python {platform.python_version()}; load (1-min) {machine.load_average() or 0:.2f}  ", "",
        "## Summary", "",
    ]
    if seconds:
        lines.append(
            f"- {len(scheduled)} rows scheduled by a rule: median {statistics.median(seconds):.3f} s, "
            f"max {seconds[-1]:.3f} s ({slowest.label}); {len(over)} over "
            f"{TARGET_SECONDS:g} s (target <= {TARGET_SECONDS:g} s)"
            + (": " + "; ".join(r.label for r in over) if over else "") + ".")
    unscheduled = [r.label for r in rows if r not in scheduled]
    lines.append(f"- Rows no GEMM-class rule scheduled: {len(unscheduled)}"
                 + (f" ({'; '.join(unscheduled)})" if unscheduled else "") + ".")
    lines += ["", "## Rows", "",
              "Seconds: the slowest kernel of the row that a GEMM-class rule (conv, gemm, "
              "gemm-rows) took, scheduled cold (one call, no memo); rules: every kernel's.", "",
              "| kernel | in | kernels | rules | seconds |", "|---|---|--:|---|--:|"]
    lines += [f"| {r.label} | {r.where} | {r.kernels} | {', '.join(sorted(set(r.rules)))} | "
              + (f"{r.seconds:.3f} |" if r.seconds is not None else "- |") for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_ROWS} rows")
    parser.add_argument("--output", default=str(HERE / "schedule_time"),
                        help="writes OUTPUT.md and OUTPUT.json")
    args = parser.parse_args(argv)
    from tvm_einweld.tir_passes.device import host_target

    target = host_target()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    begin = time.perf_counter()
    rows = [k for k in K.zoo_kernels() if k.section == K.GEMM]
    rows = rows[:QUICK_ROWS] if args.quick else rows
    schedule_seconds(rows[0], target)  # untimed: imports and TVM's first uses
    timed = []
    for i, kernel in enumerate(rows, 1):
        timed.append(schedule_seconds(kernel, target))
        print(f"[{i}/{len(rows)}] {kernel.label}: {timed[-1].seconds or 0:.3f} s "
              f"({', '.join(timed[-1].rules)})", flush=True)
    command = "python benchmarks/schedule_time.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    out = Path(args.output)
    out.with_suffix(".md").write_text(render(timed, command, started,
                                             time.perf_counter() - begin))
    out.with_suffix(".json").write_text(json.dumps([asdict(t) for t in timed], indent=1))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
