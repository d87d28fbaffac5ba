"""`python -m tvm_einweld bench [--quick]`: the zoo benchmark, side by side with the baselines."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import sys
from pathlib import Path

HELP = ("benchmark the model zoo: stock TVM untuned/tuned, onnxruntime, OpenVINO, PyTorch (and "
        "any registered runner), each in its own process, alternating rounds, medians, roofline "
        "distance; writes Markdown + PNG")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="three small models, no tuning (minutes on 2 cores)")
    parser.add_argument("--models", help="comma-separated zoo models (default: the preset's)")
    parser.add_argument("--batch", help="comma-separated batch sizes (default: 1)")
    parser.add_argument("--runners", help="comma-separated runners (default: all built in)")
    parser.add_argument("--trials", type=int, help="MetaSchedule trials per model for tuned "
                        "runners (default: 0 quick, 256 full)")
    parser.add_argument("--repeats", type=int, help="timed rounds per runner")
    parser.add_argument("--threads", type=int, help="threads every runtime gets "
                        "(default: the machine's physical cores)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every runner in this process (to show what isolation "
                        "changes; spinning thread pools then slow their neighbours)")
    parser.add_argument("--baseline", help="runner the speedups are relative to "
                        "(default: tvm-tuned when selected)")
    parser.add_argument("--work-dir", type=Path, help="keep tuning logs here (with --resume: "
                        "default OUTPUT's name + '_work')")
    parser.add_argument("--resume", action="store_true",
                        help="continue a cut-short run: keep the rows of OUTPUT's .json, "
                        "measure the rest, tuning from the databases in the work dir")
    parser.add_argument("-o", "--output", type=Path, default=Path("bench_results.md"),
                        help="Markdown report; .json and .png are written next to it")
    parser.add_argument("--no-chart", action="store_true", help="do not draw the PNG chart")
    parser.add_argument("--list", action="store_true", help="list models and runners, then exit")


def _split(text: str | None) -> tuple[str, ...] | None:
    return tuple(t.strip() for t in text.split(",") if t.strip()) if text else None


def run(args: argparse.Namespace) -> int:
    from tvm_einweld.cli import UserError
    from tvm_einweld.models import ZOO
    from tvm_einweld.bench import report, suite
    from tvm_einweld.bench.runners import RUNNERS

    if args.list:
        for m in ZOO.values():
            print(f"{m.name:12s} {m.family:7s} batches {m.batches}: {m.summary}")
        for r in RUNNERS.values():
            why = r.unavailable()
            print(f"runner {r.name:12s} {r.description}" + (f" [unavailable: {why}]" if why else ""))
        return 0
    preset = suite.QUICK if args.quick else suite.FULL
    try:
        batches = tuple(int(b) for b in _split(args.batch)) if args.batch else None
    except ValueError:
        raise UserError(f"--batch must be comma-separated integers, got {args.batch!r}")
    runners = _split(args.runners) or preset.runners
    baseline = args.baseline or ("tvm-tuned" if "tvm-tuned" in runners else runners[0])
    if args.trials is not None and args.trials < 0:
        raise UserError("--trials must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be >= 1")
    plan = dataclasses.replace(preset.plan, repeats=args.repeats or preset.plan.repeats,
                               threads=args.threads, isolate=not args.in_process)
    work_dir = args.work_dir
    earlier = None
    if args.resume:
        work_dir = work_dir or args.output.with_name(args.output.stem + "_work")
        saved = args.output.with_suffix(".json")
        if saved.exists():
            try:
                earlier = report.from_json(saved.read_text())
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"--resume: {saved} is not a bench report ({err})")
    config = suite.with_overrides(preset, models=_split(args.models), batches=batches,
                                  runners=runners, trials=args.trials, baseline=baseline,
                                  plan=plan, work_dir=work_dir)
    for name in config.models:
        if name not in ZOO:
            raise UserError(f"unknown model {name!r}; known: {', '.join(ZOO)}")
    unknown = [r for r in config.runners if r not in RUNNERS]
    if unknown or baseline not in config.runners:
        raise UserError(f"unknown runner or baseline {', '.join(unknown or [baseline])}; "
                        f"known: {', '.join(RUNNERS)}")
    if earlier is not None:
        try:
            suite.check_resumable(earlier, config)
        except ValueError as err:
            raise UserError(f"--resume: {err}")
    command = "python -m tvm_einweld bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    # Progress (model, runner, timing) on stderr with elapsed seconds; stdout gets the report.
    progress = logging.getLogger("tvm_einweld.progress")
    result = suite.run_suite(
        config, command=getattr(args, "command_line", None) or command,
        log=lambda line: progress.info("%s", line),
        on_model=lambda partial: report.write_report(partial, args.output, chart=False),
        resume=earlier)
    notes = report.write_report(result, args.output, chart=not args.no_chart)
    print()
    print(report.markdown(result))
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {args.output} (+ .json" + (", .png)" if not notes and not args.no_chart
                                             else ")"))
    return 0
