"""AL-Ansor's experiment on MetaSchedule: NL-only, LR-only, LC-only and adaptive layout tuning
(four rules: the paper's 5:5:6, a UCB bandit, our leader and stall rules) of ResNet-50 conv
blocks (pad + conv2d + bias + ReLU) at the same trial count per task, for the host's full
target.

    python benchmarks/layout_tuning.py            # full: 512 trials per task (many hours here)
    python benchmarks/layout_tuning.py --quick    # 9 trials per task, small search
    python benchmarks/layout_tuning.py --trials 64 --per-round 8 --output benchmarks/x.md
    python benchmarks/layout_tuning.py --output x.md --work-dir w --resume   # continue a run
    python benchmarks/layout_tuning.py --merge a.md.json b.md.json -o all.md  # several seeds

A run that stops part-way (a session's time, a machine's) keeps every finished task in
OUTPUT.json (the numbers the report is made of) beside OUTPUT; `--resume` with the same
settings skips those tasks and tunes the rest, so the 512-trial run can be done a few tasks
at a time, on another machine if need be: every task's variants are tuned and re-measured side
by side on one machine, and the task keeps that machine and its target (the gains are ratios
within a task, so tasks of different machines average as they are). A task cut off mid-way
continues from its variants' databases when the same `--work-dir` is given (each variant's
finished trials are counted, its cost model retrained on them, and its rounds, kept beside its
database, given back to its rule), else from its start.

One run per variant and task cannot tell a search's accidents (an early collapse into a poor
region) from a rule's merit; `--merge` puts runs of other seeds (`--seed`, each its own
OUTPUT.json, same settings otherwise) into one report, every (task, seed) a row of its own, the
gains averaged over all of them.

Each variant tunes every task with its own database. The best deployable program of each
variant (NL: A, LR: L+P with the transform in the kernel, LC and the adaptive rules: P with
weights transformed at compile time) is then re-measured side by side, alternating between
variants, and the median is reported. Gains are t_single / t_rule - 1 (positive: the adaptive
rule is faster).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time

import tvm
from tvm.s_tir import meta_schedule as ms

from tvm_einweld.auto_scheduler_ext import comparison
from tvm_einweld.auto_scheduler_ext.workloads import RESNET50_BLOCKS, Conv2dBlock
from tvm_einweld.tir_passes.device import host_target

QUICK = dict(trials=9, per_round=3, population=64, early_stopping_rounds=10, tasks=4)
# 16 rounds of 32 at 512 trials: the paper's 5:5:6 shares in whole rounds.
FULL = dict(trials=512, per_round=32, population=512, early_stopping_rounds=50, tasks=4)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced run (see QUICK)")
    p.add_argument("--trials", type=int, help="trials per task and variant")
    p.add_argument("--per-round", type=int, help="candidates per round")
    p.add_argument("--population", type=int, help="evolutionary search population")
    p.add_argument("--tasks", type=int, help="how many of the ResNet-50 blocks (in table order)")
    p.add_argument("--variants", default=",".join(v.label for v in comparison.ALL_RULES),
                   help="comma-separated variants to run (default: all: the three single "
                        "strategies and the adaptive rules %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work-dir", help="keep the tuning databases here (default: temp dir)")
    p.add_argument("-o", "--output", help="also write the Markdown report to this file (and the "
                   "finished tasks' numbers to the same path with .json added)")
    p.add_argument("--resume", action="store_true",
                   help="keep the tasks OUTPUT.json holds for the same settings and tune the rest")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="tune nothing: report the runs these OUTPUT.json files hold (same "
                        "settings but the seed) together, each (task, seed) a row")
    return p.parse_args(argv)


# What each adaptive variant's selector is (`tvm_einweld.auto_scheduler_ext.selectors`).
RULES = {"adaptive": "the paper's NL -> LR -> LC, round shares 5:5:6",
         "bandit": "UCB1 over the three strategies, rewarded by measured P",
         "leader": "NL, LR, LC once, then the strategy that found the best P, last third LC",
         "stall": "the paper's phases, NL or LR left early after two rounds without a faster P"}


def summary(results) -> list[dict]:
    """What the report needs of one task's [VariantResult], as plain data (OUTPUT.json).
    Tuning time and measurements are the sums over the variant's rounds, which a resumed
    run keeps (`comparison.ROUNDS_FILE`), where they are known (else this call's)."""
    def row(r):
        rounds = r.tuning.rounds
        if rounds and all(o.wall_secs for o in rounds):
            wall = sum(o.wall_secs for o in rounds)
            measurements = sum(o.measurements for o in rounds)
        else:
            wall, measurements = r.tuning.wall_secs, r.tuning.measurements
        return dict(label=r.variant.label, layout_strategy=r.variant.layout_strategy, secs=r.secs,
                    wall_secs=wall, measurements=measurements,
                    rounds=[o.strategy.value for o in rounds],
                    best_so_far=[o.best_so_far_secs for o in rounds])

    return [row(r) for r in results]


def convergence(results: list, shares=(0.25, 0.5, 0.75, 1.0)) -> list:
    """Per variant, its best deployable time (as measured while tuning) after each share of
    its rounds; None where the rounds are not known (a run before rounds were kept)."""
    out = []
    for r in results:
        curve = r.get("best_so_far") or []
        out.append([curve[max(0, math.ceil(len(curve) * q) - 1)] if curve else None
                    for q in shares])
    return out


def gain(single, adaptive):
    return None if single is None or adaptive is None else single / adaptive - 1


def pct(x):
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def msec(x):
    return "n/a" if x is None else f"{x * 1e3:.3f}"


def where_run(target) -> dict:
    """The machine and target a task is tuned and re-measured on (kept with the task)."""
    return dict(machine=comparison.machine_description(), target=str(target))


def report(rows, labels, settings, command, wall):
    """rows: (task name, `summary` of its variants, `where_run`) per task."""
    singles = [l for l in labels if l in ("NL", "LR", "LC")]
    adaptive = [l for l in labels if l not in singles]
    lines = [
        "# Adaptive layout-strategy tuning (AL-Ansor on MetaSchedule): ResNet-50 conv blocks",
        "",
        f"- command: `{command}`",
        "- machine and target of each task (its variants tuned and re-measured side by side "
        "there):",
        *[f"  - {name}: {where['machine']}, `{where['target']}`" for name, _, where in rows],
        "- load average at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()),
        f"- trials per task and variant: {settings['trials']} ({settings['per_round']} per round, "
        f"population {settings['population']}); total wall time {wall / 60:.1f} min",
        "- times: best deployable program of each variant, re-measured side by side (7 alternating "
        "rounds, median), in ms; NL = A, LR = L+P (transform in the kernel), the others P "
        "(weights transformed at compile time); adaptive rules: "
        + ", ".join(f"{l} ({RULES.get(l, l)})" for l in adaptive),
        "",
        "| task | " + " | ".join(f"{l} ms" for l in labels) + " | ranking |",
        "|---|" + "---|" * (len(labels) + 1),
    ]
    # gains[rule][single or "best"]: t_single / t_rule - 1 per task
    gains = {a: {s: [] for s in singles + ["best"]} for a in adaptive}
    for name, results, _ in rows:
        t = {r["label"]: r["secs"] for r in results}
        ranked = sorted((x for x in labels if t.get(x) is not None), key=lambda x: t[x])
        best_single = min((t[s] for s in singles if t.get(s) is not None), default=None)
        for a in adaptive:
            for s, ref in [(s, t.get(s)) for s in singles] + [("best", best_single)]:
                g = gain(ref, t.get(a))
                if g is not None:
                    gains[a][s].append(g)
        lines.append(f"| {name} | " + " | ".join(msec(t.get(l)) for l in labels)
                     + f" | {' < '.join(ranked)} |")
    lines += ["", "Gain of each adaptive rule (t_single / t_rule - 1; positive: the rule is "
              "faster), mean over the tasks, and the tasks where it is at least as fast as the "
              "best single strategy:", "",
              "| rule | " + " | ".join(f"vs {s}" for s in singles)
              + " | vs best single | tasks >= best single |",
              "|---|" + "---|" * (len(singles) + 2)]
    for a in adaptive:
        best = gains[a]["best"]
        lines.append(f"| {a} | " + " | ".join(
            pct(statistics.mean(gains[a][s]) if gains[a][s] else None) for s in singles)
            + f" | {pct(statistics.mean(best) if best else None)} | "
            f"{sum(g >= 0 for g in best)} of {len(best)} |")
    lines += ["", "Tuning wall time per task (s) and measurements (programs built and run):", "",
              "| task | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, results, _ in rows:
        lines.append(f"| {name} | " + " | ".join(
            f"{r['wall_secs']:.0f} s / {r['measurements']}" for r in results) + " |")
    lines += ["", "Search progress: each variant's best deployable program as timed while tuning "
              "(not side by side), in ms, after 1/4, 1/2, 3/4 and all of its rounds:", "",
              "| task | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, results, _ in rows:
        lines.append(f"| {name} | " + " | ".join(
            " / ".join(msec(x) for x in points) if any(x is not None for x in points) else "n/a"
            for points in convergence(results)) + " |")
    lines += ["", "Strategy of each round of the adaptive runs:", ""]
    for name, results, _ in rows:
        for r in results:
            if r["layout_strategy"] == "adaptive":
                lines.append(f"- {name} [{r['label']}]: {' '.join(r['rounds'])}")
    return "\n".join(lines) + "\n"


def merge(paths: list[str]) -> tuple[list, dict, list, float]:
    """The rows of several runs' OUTPUT.json (`--merge`): (rows, settings, labels, wall), each
    task's name marked with its run's seed. The runs must agree on every setting but the seed
    (and on the variants, in order); SystemExit otherwise."""
    rows, wall, first = [], 0.0, None
    for path in paths:
        with open(path) as f:
            state = json.load(f)
        key = dict(state["settings"])
        seed = key.pop("seed")
        if first is None:
            first = key
        elif key != first:
            raise SystemExit(f"{path} was run with other settings ({key}) than {paths[0]} "
                             f"({first}); only the seed may differ")
        rows += [(f"{name} (seed {seed})", results, where) for name, results, where in state["tasks"]]
        wall += state.get("wall_secs", 0.0)
    return rows, first, first["variants"], wall


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = ("python benchmarks/layout_tuning.py " + " ".join(argv)).strip()
    if args.merge:
        rows, settings, labels, wall = merge(args.merge)
        text = report(rows, labels, settings, command, wall)
        if args.output:
            with open(args.output, "w") as f:
                f.write(text)
        print(text)
        return 0
    settings = dict(QUICK if args.quick else FULL)
    for key in ("trials", "per_round", "population", "tasks"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tvm_einweld.auto_scheduler_ext").setLevel(logging.INFO)
    logging.getLogger("tvm_einweld.auto_scheduler_ext.search").setLevel(logging.WARNING)
    target = host_target()  # -mcpu and the physical cores, as the pipeline compiles for
    by_label = {v.label: v for v in comparison.ALL_RULES}
    unknown = [l for l in args.variants.split(",") if l not in by_label]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(by_label)}")
    variants = [by_label[l] for l in args.variants.split(",")]
    labels = [v.label for v in variants]
    search = ms.search_strategy.EvolutionarySearch(population_size=settings["population"])
    work_root = args.work_dir or tempfile.mkdtemp(prefix="einweld-layout-bench-")
    blocks: list[Conv2dBlock] = list(RESNET50_BLOCKS[: settings["tasks"]])
    state_path = args.output + ".json" if args.output else None
    # What the kept numbers depend on (not how many tasks: a resumed run may go further; not
    # the machine: each task keeps its own, `where_run`).
    key = dict({k: v for k, v in settings.items() if k != "tasks"}, seed=args.seed, variants=labels)
    rows, wall_before = [], 0.0
    if args.resume:
        if not state_path:
            raise SystemExit("--resume needs --output (the finished tasks are kept beside it)")
        if os.path.exists(state_path):
            with open(state_path) as f:
                state = json.load(f)
            if state.get("settings") != key:
                raise SystemExit(f"{state_path} holds a run with other settings: "
                                 f"{state.get('settings')}; not resuming it")
            rows = [(name, results, where) for name, results, where in state["tasks"]]
            wall_before = state.get("wall_secs", 0.0)
            print(f"resuming: {len(rows)} of {len(blocks)} tasks done", flush=True)
    start = time.time()
    text = report(rows, labels, settings, command, wall_before)
    done = {name for name, _, _ in rows}
    for block in blocks:
        if block.name in done:
            continue
        results = comparison.compare_task(
            block.module(), target, work_root, settings["trials"], variants, task_name=block.name,
            num_trials_per_iter=settings["per_round"], search=search, seed=args.seed,
            early_stopping_rounds=settings["early_stopping_rounds"],
        )
        rows.append((block.name, summary(results), where_run(target)))
        print(f"{block.name}: " + ", ".join(f"{r.variant.label} {msec(r.secs)} ms" for r in results), flush=True)
        # Written after every task, so that a long run stopped part-way still leaves its table
        # and, in OUTPUT.json, the tasks `--resume` keeps.
        wall = wall_before + time.time() - start
        text = report(rows, labels, settings, command, wall)
        if args.output:
            with open(args.output, "w") as f:
                f.write(text)
            with open(state_path, "w") as f:
                json.dump(dict(settings=key, tasks=rows, wall_secs=wall), f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
