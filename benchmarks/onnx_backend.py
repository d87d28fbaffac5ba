"""The onnx backend test models through the einweld pipeline: `python benchmarks/onnx_backend.py`.

Every model of the installed onnx package's backend test data (`tvm_einweld.models.onnx_backend`:
the nine light ImageNet models and the 117 PyTorch node tests) is imported by TVM's frontend,
compiled with `tvm.compile(mod, host_target(), relax_pipeline="einweld")`, run, and compared
with its reference: onnxruntime (graph optimisations off, same prepared model) for the light
models, the stored outputs for the node tests. Light models run twice: with their own (uniform)
weights and with seeded random weights. One row per model and weights in
`benchmarks/onnx_backend.md` (+ `.json`): imported (or why not), equal (normwise max error),
einweld and onnxruntime latency, compile time, the load average when it was measured.

Each runtime runs in its own process, one model at a time: onnxruntime's thread pool spins after
each call and slows whatever shares the cores, and TVM pins its main thread to a CPU when its
pool starts, which threads created later inherit. onnxruntime gets spinning off and one thread
per physical core. Latency is the median of `--repeats` samples (`tvm_einweld.bench.timing`),
each sample long enough for the timer. The table is written after every model, so an
interrupted run keeps what it measured; `--resume` continues it.

    python benchmarks/onnx_backend.py --quick          # five node tests, a few minutes
    python benchmarks/onnx_backend.py                  # everything (hours on 2 cores)
    python benchmarks/onnx_backend.py --suites light --weights own
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tvm_einweld.models import onnx_backend as ob  # noqa: E402

DEFAULT_OUTPUT = ROOT / "benchmarks" / "onnx_backend.md"
QUICK_MODELS = ("pytorch-converted/test_BatchNorm2d_eval", "pytorch-converted/test_Linear",
                "pytorch-converted/test_MaxPool2d", "pytorch-converted/test_Conv2d_no_bias",
                "pytorch-operator/test_operator_index")  # one of them is not imported
WORKER_TIMEOUT_S = 3600
RANDOM_SEED = 0


@dataclass(frozen=True)
class Row:
    """One model with one set of weights. `equal` is None when there was nothing to compare
    (not imported, not compiled); `reason` then says why. Latencies in ms, None when not run."""

    model: str
    weights: str
    reference: str
    imported: bool
    reason: Optional[str]
    equal: Optional[bool]
    max_abs_error: Optional[float]
    max_rel_error: Optional[float]
    einweld_ms: Optional[float]
    onnxruntime_ms: Optional[float]
    compile_s: Optional[float]
    load: float
    notes: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.weights


# ---- workers: one process per model and runtime ---------------------------------------------
def _inputs(entry: ob.BackendModel, prepared: ob.PreparedModel) -> dict[str, np.ndarray]:
    if entry.is_light:
        return ob.light_inputs(prepared.proto)
    return dict(ob.load_data_sets(entry)[0].inputs)


def _time(call, repeats: int) -> float:
    """Median seconds per call."""
    from tvm_einweld.bench.timing import calls_per_sample, time_alternating

    number = calls_per_sample(call)
    return time_alternating({"call": call}, repeats=repeats, number=number)["call"].median


def worker_tvm(entry: ob.BackendModel, weights: str, repeats: int, out: Path) -> dict:
    """Import, compile with the einweld pipeline, run, time; outputs saved to out/outputs.npz."""
    import tvm
    from tvm import relax

    from tvm_einweld.runtime_io import flatten_outputs, vm_input
    from tvm_einweld.tir_passes.device import host_target

    prepared = ob.prepare(entry, weights, RANDOM_SEED)
    result = {"notes": list(prepared.notes)}
    imported = ob.import_model(prepared.proto)
    if not imported.imported:
        return {**result, "imported": False, "reason": imported.reason}
    compiled = ob.compile_model(imported.mod, host_target())
    if not compiled.compiled:
        return {**result, "imported": True, "reason": compiled.reason}
    result["compile_s"] = compiled.seconds
    # A stage whose module disagreed with its input was dropped: the answer is still checked,
    # but the table says which stage the pipeline fell back from.
    result["notes"] += [f"fell back: {stage}" for stage in compiled.fallbacks]
    executable = compiled.executable
    inputs = _inputs(entry, prepared)
    main = relax.VirtualMachine(executable, tvm.cpu())["main"]
    args = [vm_input(inputs[n]) for n in prepared.input_names]
    outputs = flatten_outputs(main(*args))
    np.savez(out / "outputs.npz", *outputs)
    result["seconds"] = _time(lambda: main(*args), repeats)
    return {**result, "imported": True, "reason": None}


def worker_onnxruntime(entry: ob.BackendModel, weights: str, repeats: int, out: Path) -> dict:
    """The reference outputs (light models: graph optimisations off) to out/reference.npz, and
    the latency with all optimisations, spinning off, one thread per physical core."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    prepared = ob.prepare(entry, weights, RANDOM_SEED)
    model, notes = ob.onnxruntime_model(prepared)
    inputs = _inputs(entry, prepared)
    result = {"notes": list(notes)}
    try:
        if entry.is_light:
            np.savez(out / "reference.npz", *ob.onnxruntime_outputs(model, inputs))
        session = ob.onnxruntime_session(model, optimize=True)
        feeds = dict(inputs)
        session.run(None, feeds)
    except Exception as err:  # pylint: disable=broad-except
        return {**result, "reason": f"onnxruntime failed: {ob.describe_error(err)}"}
    result["seconds"] = _time(lambda: session.run(None, feeds), repeats)
    return {**result, "reason": None}


WORKERS = {"tvm": worker_tvm, "onnxruntime": worker_onnxruntime}


def run_worker(kind: str, entry: ob.BackendModel, weights: str, repeats: int, out: Path,
               timeout_s: float) -> dict:
    """Run one worker in a fresh process; a crash or timeout becomes a `reason`."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--models",
           entry.name, "--weights", weights, "--repeats", str(repeats), "--work-dir", str(out)]
    log = out / f"{kind}.log"
    try:
        with open(log, "w") as handle:
            proc = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"reason": f"{kind} worker timed out after {timeout_s:.0f} s", "notes": []}
    result_path = out / f"{kind}.json"
    if proc.returncode != 0 or not result_path.exists():
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return {"reason": f"{kind} worker exited with {proc.returncode}: "
                          f"{tail[-1][:160] if tail else '(no output)'}", "notes": []}
    return json.loads(result_path.read_text())


def _load_arrays(path: Path) -> list[np.ndarray]:
    with np.load(path) as data:
        return [data[f"arr_{k}"] for k in range(len(data.files))]


def measure(entry: ob.BackendModel, weights: str, repeats: int, work: Path,
            timeout_s: float = WORKER_TIMEOUT_S) -> Row:
    """One row: the TVM worker, then the onnxruntime worker, then the comparison."""
    folder = work / entry.name.replace("/", "__") / weights
    tvm_result = run_worker("tvm", entry, weights, repeats, folder, timeout_s)
    load = os.getloadavg()[0]
    ort_result = run_worker("onnxruntime", entry, weights, repeats, folder, timeout_s)
    notes = tuple(dict.fromkeys(tvm_result.get("notes", []) + ort_result.get("notes", [])))
    if ort_result.get("reason"):
        notes += (ort_result["reason"],)
    reference_name = "onnxruntime" if entry.is_light else "stored outputs"
    common = dict(model=entry.name, weights=weights, reference=reference_name,
                  onnxruntime_ms=_ms(ort_result.get("seconds")), load=round(load, 2))
    imported = tvm_result.get("imported", False)
    if tvm_result.get("reason"):
        return Row(imported=imported, reason=tvm_result["reason"], equal=None,
                   max_abs_error=None, max_rel_error=None, einweld_ms=None,
                   compile_s=tvm_result.get("compile_s"), notes=notes, **common)
    got = _load_arrays(folder / "outputs.npz")
    if entry.is_light:
        if not (folder / "reference.npz").exists():
            return Row(imported=True, reason="no onnxruntime reference", equal=None,
                       max_abs_error=None, max_rel_error=None,
                       einweld_ms=_ms(tvm_result["seconds"]),
                       compile_s=tvm_result["compile_s"], notes=notes, **common)
        reference = _load_arrays(folder / "reference.npz")
    else:
        reference = list(ob.load_data_sets(entry)[0].outputs)
    comparison = ob.compare_outputs(got, reference, entry.name)
    return Row(imported=True, reason=None, equal=comparison.equal,
               max_abs_error=comparison.max_abs_error, max_rel_error=comparison.max_rel_error,
               einweld_ms=_ms(tvm_result["seconds"]), compile_s=tvm_result["compile_s"],
               notes=notes + (() if comparison.equal else (comparison.what,)), **common)


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


# ---- the report -----------------------------------------------------------------------------
def commit_line(given: Optional[str] = None) -> str:
    """HEAD of the checkout the benchmark runs from (noting uncommitted changes to the code it
    measures), or `given` when it runs from an exported copy of a commit."""
    if given:
        return given

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "tvm_einweld",
                "benchmarks/onnx_backend.py")
    return head + (" (with uncommitted changes)" if dirty else "")


def machine_line() -> str:
    import onnx
    import onnxruntime
    import tvm

    from tvm_einweld.machine import cpu_model, memory_gib, physical_cores

    return (f"{cpu_model()}, {physical_cores()} physical / {os.cpu_count()} logical cores, "
            f"{memory_gib():.0f} GiB; {platform.system()} {platform.release()}; Python "
            f"{platform.python_version()}, TVM {tvm.__version__}, onnxruntime "
            f"{onnxruntime.__version__}, onnx {onnx.__version__}, numpy {np.__version__}")


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _equal_cell(row: Row) -> str:
    if row.equal is None:
        return "–"
    verdict = "yes" if row.equal else "**NO**"
    return f"{verdict} ({row.max_rel_error:.1e})"


def summary_lines(rows: Sequence[Row]) -> list[str]:
    imported = [r for r in rows if r.imported]
    compared = [r for r in rows if r.equal is not None]
    equal = [r for r in compared if r.equal]
    unequal = [r for r in compared if not r.equal]
    failed = [r for r in imported if r.equal is None]
    compile_times = sorted((r.compile_s, r.model) for r in rows if r.compile_s is not None)
    lines = [f"- rows: {len(rows)} ({len({r.model for r in rows})} models); imported "
             f"{len(imported)}, not imported {len(rows) - len(imported)}; equal "
             f"{len(equal)}, NOT equal {len(unequal)}, imported but not built "
             f"{len(failed)}"]
    if compared:
        worst = max(compared, key=lambda r: r.max_rel_error)
        lines.append(f"- worst normwise error (max|a-b| / max|ref|): {worst.max_rel_error:.2g} "
                     f"({worst.model}, {worst.weights} weights)")
    if compile_times:
        total = sum(t for t, _ in compile_times)
        lines.append(f"- compile time: total {total / 60:.1f} min, median "
                     f"{compile_times[len(compile_times) // 2][0]:.1f} s, longest "
                     f"{compile_times[-1][0]:.1f} s ({compile_times[-1][1]})")
    for row in unequal:
        lines.append(f"- **NOT equal**: {row.model} ({row.weights} weights): "
                     f"{'; '.join(row.notes)}")
    for row in failed:
        lines.append(f"- imported but not built: {row.model} ({row.weights}): {row.reason}")
    for row in rows:
        if not row.imported:
            lines.append(f"- not imported: {row.model}: {row.reason}")
    fell_back = [r for r in rows if any(n.startswith("fell back") for n in r.notes)]
    if fell_back:
        lines.append(f"- the pipeline fell back from a stage on {len(fell_back)} rows "
                     f"(see notes)")
    return lines


def render(rows: Sequence[Row], meta: dict) -> str:
    lines = [
        "# onnx backend test models through the einweld pipeline",
        "",
        "Every model of the installed onnx package's backend test data "
        "(`tvm_einweld/models/onnx_backend.py`) imported by TVM's frontend, compiled with "
        "`tvm.compile(mod, host_target(), relax_pipeline=\"einweld\")` (no tuning) and compared "
        "normwise with its reference (`compare_arrays`, float32: max|a-b| <= 1e-5 + 1e-4·max|ref|): "
        "onnxruntime with graph optimisations off for the light models, the stored outputs for "
        "the node tests. Light models run with their own weights (uniform, from ConstantOfShape) "
        f"and with seeded He-scaled random weights (seed {RANDOM_SEED}). With their own weights "
        "every class logit of a light model is the same number, so its output is exactly "
        "uniform (0.001 for each of the 1000 classes): those rows check that the pipeline keeps "
        "every output channel identical (a rounding difference between channels was the "
        "SqueezeNet bug of issue 18) and little else; the random-weight rows check the "
        "computation. Latency: median of "
        f"{meta['repeats']} samples, each runtime in its own process; onnxruntime with all graph "
        "optimisations, spinning off, one thread per physical core; TVM's thread pool as "
        "shipped. `load` is the 1-minute load average after the TVM worker (other engineers "
        "share the machine: latencies under load read slow).",
        "",
        f"- command: `{meta['command']}`",
        f"- measured at commit: {meta['commit']}",
        f"- machine: {meta['machine']}",
        f"- started {meta['started']}, load average at start {meta['load_start']}, at end "
        f"{meta.get('load_end', '(running)')}; wall time {meta.get('wall_min', 0):.0f} min",
    ]
    if meta.get("not_run"):
        lines.append(f"- not run: {meta['not_run']}")
    for run in meta.get("earlier_runs", []):
        lines.append(f"- rows from an earlier run (`--resume`): `{run['command']}` at commit "
                     f"{run['commit']}, started {run['started']}, load average at start "
                     f"{run['load_start']}, at end {run.get('load_end', '(interrupted)')}; "
                     f"wall time {run.get('wall_min', 0):.0f} min"
                     + (f"; not run: {run['not_run']}" if run.get("not_run") else ""))
    lines += ["", "## Summary", ""] + summary_lines(rows) + [
        "",
        "## Models",
        "",
        "| model | weights | imported | equal (normwise error) | einweld ms | onnxruntime ms "
        "| compile s | load | notes |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        imported = "yes" if r.imported else r.reason
        notes = "; ".join(([r.reason] if r.imported and r.reason else []) + list(r.notes))
        lines.append(f"| {r.model} | {r.weights} | {imported} | {_equal_cell(r)} | "
                     f"{_fmt(r.einweld_ms, '.3g')} | {_fmt(r.onnxruntime_ms, '.3g')} | "
                     f"{_fmt(r.compile_s, '.1f')} | {r.load:.1f} | {notes} |")
    return "\n".join(lines) + "\n"


def write(rows: Sequence[Row], meta: dict, output: Path) -> None:
    output.write_text(render(rows, meta))
    output.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))


def read_previous(path: Path) -> tuple[list[Row], list[dict]]:
    """The rows of an earlier run's .json and the descriptions of the runs that measured them."""
    if not path.exists():
        return [], []
    data = json.loads(path.read_text())
    meta = dict(data["meta"])
    runs = meta.pop("earlier_runs", []) + [meta]
    return [Row(**{**r, "notes": tuple(r["notes"])}) for r in data["rows"]], runs


# ---- command line ---------------------------------------------------------------------------
def select(args: argparse.Namespace) -> list[tuple[ob.BackendModel, str]]:
    entries = ob.list_models(args.suites)
    if args.quick and not args.models:
        entries = [e for e in entries if e.name in QUICK_MODELS]
    elif args.models:
        entries = [e for e in entries if any(n == e.name or n in e.name for n in args.models)]
    jobs = [(entry, weights) for entry in entries for weights in args.weights
            if weights == "own" or entry.is_light]  # node tests have their real weights
    # Node tests first (seconds each), then the light models with their own weights, then with
    # random weights (minutes each): a run cut short keeps the most rows.
    return sorted(jobs, key=lambda job: (job[0].is_light, job[1] != "own"))


def _interrupt(signum, frame) -> None:  # pylint: disable=unused-argument
    raise KeyboardInterrupt


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {len(QUICK_MODELS)} node tests, fewer repeats")
    parser.add_argument("--suites", nargs="+", default=list(ob.SUITES), choices=ob.SUITES)
    parser.add_argument("--models", nargs="+", default=[],
                        help="only models whose name contains one of these")
    parser.add_argument("--weights", nargs="+", default=list(ob.WEIGHTS), choices=ob.WEIGHTS,
                        help="weights of the light models (node tests use their own)")
    parser.add_argument("--repeats", type=int, default=None, help="timing samples (default 7, "
                        "--quick 5)")
    parser.add_argument("--timeout", type=float, default=WORKER_TIMEOUT_S,
                        help="seconds one worker (one model, one runtime) may take")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help=f"Markdown table (default {DEFAULT_OUTPUT.relative_to(ROOT)}; "
                        "--quick: a temporary file); the .json goes beside it")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in the output's .json, measure the rest")
    parser.add_argument("--not-run", default="", help="a sentence for the report saying what "
                        "this run left out")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite the Markdown table from its .json; measure nothing")
    parser.add_argument("--commit", default=None,
                        help="the commit this copy of the code was exported from (`git archive`), "
                        "when it does not run from a git checkout")
    parser.add_argument("--work-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (5 if args.quick else 7)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    if args.worker:  # one model, one runtime, in this process
        entry = ob.find_model(args.models[0])
        result = WORKERS[args.worker](entry, args.weights[0], args.repeats, args.work_dir)
        (args.work_dir / f"{args.worker}.json").write_text(json.dumps(result))
        return 0
    output = args.output or (Path(tempfile.mkdtemp(prefix="onnx_backend_")) / "onnx_backend.md"
                             if args.quick else DEFAULT_OUTPUT)
    if args.render_only:  # the Markdown again from the .json, nothing measured
        data = json.loads(output.with_suffix(".json").read_text())
        rows, _ = read_previous(output.with_suffix(".json"))
        output.write_text(render(rows, data["meta"]))
        return 0
    rows, earlier_runs = read_previous(output.with_suffix(".json")) if args.resume else ([], [])
    done = {r.key for r in rows}
    jobs = [(e, w) for e, w in select(args) if (e.name, w) not in done]
    command = "python benchmarks/onnx_backend.py " + " ".join(
        map(shlex.quote, argv if argv is not None else sys.argv[1:]))
    meta = {"command": command.strip(), "commit": commit_line(args.commit), "machine": machine_line(),
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_start": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
            "repeats": args.repeats, "not_run": args.not_run, "earlier_runs": earlier_runs}
    started = time.time()
    # SIGTERM (or Ctrl-C) ends the run between models: the rows so far are kept and the
    # report lists the rows not measured.
    signal.signal(signal.SIGTERM, _interrupt)
    pending = list(jobs)
    try:
        with tempfile.TemporaryDirectory(prefix="onnx_backend_work_") as work:
            for k, (entry, weights) in enumerate(jobs, 1):
                print(f"[{k}/{len(jobs)}] {entry.name} ({weights})", flush=True)
                row = measure(entry, weights, args.repeats, Path(work), args.timeout)
                print(f"    imported={row.imported} equal={row.equal} "
                      f"err={_fmt(row.max_rel_error, '.2g')} "
                      f"compile={_fmt(row.compile_s, '.1f')} s "
                      f"einweld={_fmt(row.einweld_ms, '.3g')} ms "
                      f"onnxruntime={_fmt(row.onnxruntime_ms, '.3g')} ms {row.reason or ''}",
                      flush=True)
                rows.append(row)
                pending.pop(0)
                meta["wall_min"] = (time.time() - started) / 60
                write(rows, meta, output)
    except KeyboardInterrupt:
        left = ", ".join(f"{e.name} ({w} weights)" for e, w in pending)
        meta["not_run"] = "; ".join(filter(None, [
            args.not_run, f"the run was stopped before {len(pending)} rows: {left}"]))
        print(f"stopped; {len(pending)} rows not run", flush=True)
    meta["load_end"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    meta["wall_min"] = (time.time() - started) / 60
    write(rows, meta, output)
    print("\n".join(summary_lines(rows)))
    print(f"wrote {output} and {output.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
