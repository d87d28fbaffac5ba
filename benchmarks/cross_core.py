"""How fast is a tensor read right after it was written, by the core that wrote it and by the
other one? The fact behind `tvm_einweld.tir_passes.rules.cpu.affinity` (which core writes
which rows of a product).

    python benchmarks/cross_core.py            # 64 KiB .. 16 MiB
    python benchmarks/cross_core.py --quick    # 256 KiB, 1 MiB, 4 MiB

For each size, `machine.measure_handoff` (a C probe, two OpenMP threads unpinned as TVM's
pool runs them): thread 0 writes the buffer, then thread 0 or thread 1 reads it, the best of
`--repeats` hand-offs each; sizes in alternating rounds (`--rounds`), the median kept. Below
the per-core L2, a read by the writer comes from its L2 and a read by the other core must
fetch each line from the writer's cache; beyond it, both come from L3 or memory. Two kernels
in a row pay the second figure on the part of the tensor their parallel loops give to
different cores.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from tvm_einweld import machine
from tvm_einweld.bench.report import run_header

SIZES_KIB = (64, 256, 512, 1024, 1536, 2048, 4096, 16384)
QUICK_KIB = (256, 1024, 4096)


def measure(sizes: tuple, rounds: int, repeats: int) -> list:
    """Rows {kib, own_gbs, other_gbs, ratio}: medians over the rounds."""
    seen: dict = {kib: [] for kib in sizes}
    for _ in range(rounds):
        for kib in sizes:
            handoff = machine.measure_handoff(kib, repeats)
            if handoff is None:
                raise SystemExit("cross_core: needs gcc with OpenMP and two usable CPUs")
            seen[kib].append(handoff)
    rows = []
    for kib, runs in seen.items():
        own = statistics.median(h.own_gbs for h in runs)
        other = statistics.median(h.other_gbs for h in runs)
        rows.append({"kib": kib, "own_gbs": own, "other_gbs": other, "ratio": own / other})
    return rows


def markdown(rows: list, command: str, started: str, loads: tuple, wall: float) -> str:
    lines = run_header("Reading what another core just wrote", command, started, wall,
                       loads) + [
        "",
        "Thread 0 writes a buffer; then thread 0 (own) or thread 1 (other) reads it once "
        "(`machine.measure_handoff`: a C probe, two OpenMP threads unpinned, the best of the "
        "hand-offs in a round; the median of the rounds). GB/s of that one read.",
        "",
        "| KiB | read by the writer GB/s | read by the other core GB/s | writer / other |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['kib']} | {r['own_gbs']:.1f} | {r['other_gbs']:.1f} | "
                     f"{r['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50, help="hand-offs per size a round")
    parser.add_argument("-o", "--output", default=str(Path(__file__).with_name("cross_core")),
                        help="output path without extension (.md and .json are written)")
    args = parser.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_before, start = machine.load_average() or 0.0, time.perf_counter()
    rows = measure(QUICK_KIB if args.quick else SIZES_KIB, args.rounds, args.repeats)
    loads = (load_before, machine.load_average() or 0.0)
    command = "python benchmarks/cross_core.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv)
    text = markdown(rows, command.strip(), started, loads, time.perf_counter() - start)
    Path(args.output + ".md").write_text(text)
    Path(args.output + ".json").write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
