"""Writing benchmark results: a Markdown report, a JSON dump and an optional PNG chart.

Besides latencies, the report says how far each number can be trusted: how the runners were
run (own processes, thread counts), each runner's settings as read back from its runtime,
the spread of its round medians, the load before and after, and every runner's error
against the reference.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .check import RTOL
from .harness import OK, SKIPPED, ModelResult
from .timing import Timing
from ..machine import MachineInfo, profile

# A runner's rounds agreeing within this are a trustworthy median on an idle machine.
SPREAD_TARGET = 0.15


@dataclass(frozen=True)
class SuiteResult:
    command: str
    started_utc: str
    wall_seconds: float
    machine: MachineInfo
    load_average: Optional[float]  # 1-minute load when the run started
    trials: int
    runners: tuple[str, ...]
    baseline: str  # ratios are baseline latency / runner latency (> 1: faster than baseline)
    models: tuple[ModelResult, ...]
    notes: tuple[str, ...] = ()
    load_after: Optional[float] = None  # 1-min load when the run ended
    threads: Optional[int] = None  # threads every runtime was given
    isolated: bool = True  # each runner in its own worker process


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def speedup(model: ModelResult, runner: str, baseline: str) -> Optional[float]:
    """baseline latency / runner latency; where the baseline failed, its stand-in's latency."""
    mine, base = model.latency(runner), model.latency_or_stand_in(baseline)
    return base / mine if mine and base else None


def columns(suite: SuiteResult) -> list[str]:
    """The selected runners, then any stand-in measured in a failed runner's place."""
    extra = [other for m in suite.models for _, other in m.stand_ins]
    return list(suite.runners) + [r for r in dict.fromkeys(extra) if r not in suite.runners]


def geomean(values: Sequence[float]) -> Optional[float]:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _cell(model: ModelResult, runner: str, baseline: str) -> str:
    r = model.result(runner)
    if r is None:
        return "–"
    if r.status != OK:
        other = model.stand_in(runner)
        return f"{r.status} (→ {other})" if other else r.status
    ratio = speedup(model, runner, baseline)
    text = f"{_ms(r.latency)} ({ratio:.2f}×)" if ratio else _ms(r.latency)
    # Error beyond fp32 rounding (a reduced-precision runner, within its own tolerance).
    return text + (f" err {r.error:.1e}" if r.error is not None and r.error > RTOL else "")


def latency_table(suite: SuiteResult) -> str:
    runners = columns(suite)
    head = ["model", "batch", *runners]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in suite.models:
        lines.append("| " + " | ".join([m.model, str(m.batch)] +
                                        [_cell(m, r, suite.baseline) for r in runners]) + " |")
    means = []
    for r in runners:
        g = geomean([s for m in suite.models if (s := speedup(m, r, suite.baseline))])
        means.append(f"{g:.2f}×" if g else "–")
    lines.append("| geomean speedup vs " + suite.baseline + " | | " + " | ".join(means) + " |")
    return "\n".join(lines)


def roofline_table(suite: SuiteResult) -> str:
    m_info = suite.machine
    lines = ["| model | batch | GFLOP | compulsory MB | unfused MB | FLOP/byte | roofline bound ms "
             "| best runner | best ms | distance |", "|" + "---|" * 10]
    for m in suite.models:
        if m.cost is None:
            continue
        c = m.cost
        bound = c.bound_seconds(m_info)
        ok = [r for r in m.results if r.status == OK and r.latency
              and (r.error is None or r.error <= RTOL)]  # fp32-accurate runners only
        best = min(ok, key=lambda r: r.latency) if ok else None
        lines.append(
            f"| {m.model} | {m.batch} | {c.flops / 1e9:.3g} | {c.min_bytes / 1e6:.3g} | "
            f"{c.unfused_bytes / 1e6:.3g} | {c.intensity():.0f} | {_ms(bound)} | "
            + (f"{best.runner} | {_ms(best.latency)} | {best.latency / bound:.1f}× |"
               if best else "– | – | – |"))
    return "\n".join(lines)


def _load(value: Optional[float]) -> str:
    return f"{value:.2f}" if value is not None else "?"


def _ns(value: Optional[float]) -> str:
    return f"{value:.0f}" if value is not None else "?"


def spread_table(suite: SuiteResult) -> str:
    """Per runner and for the machine's reference loop: spread of its round medians, rounds x
    calls per round; ⚠ over target."""
    runners = columns(suite)
    head = ["model", "batch", "load before → after", "round trip ns before → after", "machine",
            *runners]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(t: Optional[Timing]) -> str:
        if t is None:
            return "–"
        flag = " ⚠" if t.spread > SPREAD_TARGET else ""
        return f"{t.spread:.1%}{flag} ({len(t.samples)}×{t.calls_per_round})"

    for m in suite.models:
        cells = [cell(m.reference)]
        for name in runners:
            r = m.result(name)
            cells.append(cell(r.timing if r else None))
        lines.append("| " + " | ".join([m.model, str(m.batch),
                                        f"{_load(m.load_before)} → {_load(m.load_after)}",
                                        f"{_ns(m.round_trip_before)} → {_ns(m.round_trip_after)}"
                                        + retimed_note(m.slow_attempts),
                                        *cells]) + " |")
    return "\n".join(lines)


def retimed_note(slow_attempts) -> str:
    """A table cell's note for rounds timed again (`timing.time_in_fast_phase`): the slowest
    round trip of each discarded attempt."""
    if not slow_attempts:
        return ""
    trips = [max((t for t in a if t is not None), default=None) for a in slow_attempts]
    return f" (timed again: first at {', '.join(_ns(t) for t in trips)})"


def settings_lines(suite: SuiteResult) -> list[str]:
    """One line per runner and distinct settings: what it ran with, read back in its process."""
    seen: dict[str, dict[tuple, list[str]]] = {}
    for m in suite.models:
        for r in m.results:
            if r.settings:
                seen.setdefault(r.runner, {}).setdefault(r.settings, []).append(
                    f"{m.model} b{m.batch}")
    lines = []
    for runner in columns(suite):
        variants = seen.get(runner, {})
        for settings, models in variants.items():
            where = f" ({', '.join(models)})" if len(variants) > 1 else ""
            lines.append(f"- settings {runner}{where}: "
                         + ", ".join(f"{k}={v}" for k, v in settings))
    return lines


def code_line(suite: SuiteResult) -> str:
    """Which tvm_einweld code (`machine.code_version`) measured which rows: a resumed run
    can span changes to the code."""
    rows: dict = {}
    for m in suite.models:
        rows.setdefault(m.code or "not recorded", []).append(f"{m.model} b{m.batch}")
    if len(rows) <= 1:
        return f"Code: tvm_einweld {next(iter(rows), 'not recorded')} (every row)"
    return "Code: " + "; ".join(f"tvm_einweld {code} ({', '.join(models)})"
                                for code, models in rows.items())


def problems(suite: SuiteResult) -> list[str]:
    """Runners that failed or disagreed with the reference (skips are listed once in notes)."""
    return [f"- {m.model} b{m.batch}, {r.runner}: **{r.status}** — {r.detail}"
            for m in suite.models for r in m.results if r.status not in (OK, SKIPPED)]


def markdown(suite: SuiteResult, chart: Optional[str] = None) -> str:
    balance = suite.machine.peak_gflops / suite.machine.copy_gbs
    threads = f"{suite.threads} threads" if suite.threads else "their default threads"
    how = (f"Each runner ran in its own worker process with {threads} (every runtime's thread "
           "setting, listed under Settings), prepared once, then timed in rounds that "
           "alternated across the processes; after each round the next waited until the "
           "previous process's threads stopped spinning."
           if suite.isolated else
           "All runners ran in this one process (not isolated: thread pools that spin after "
           "a call slow the runner timed next).")
    parts = [
        "# Zoo benchmark",
        "",
        f"Command: `{suite.command}`  ",
        f"Date: {suite.started_utc} (UTC), wall time {suite.wall_seconds / 60:.1f} min  ",
        f"Machine: {suite.machine.describe()}; machine balance {balance:.0f} FLOP/byte  ",
        f"Load (1-min average): {_load(suite.load_average)} at start, "
        f"{_load(suite.load_after)} at end  ",
        f"Tuning budget: {suite.trials} MetaSchedule trials per model for every tuned runner  ",
        code_line(suite),
        "",
        "## Latency (median ms) and speedup vs " + suite.baseline,
        "",
        f"Cells: median latency in ms (speedup = {suite.baseline} latency / this latency; "
        f"> 1 is faster). {how} Every output was checked against onnxruntime (graph "
        "optimisations off) before and after timing; `err` is the max error relative to the "
        "largest reference value where it exceeds fp32 rounding (a reduced-precision runner, "
        "within its own tolerance). `failed (→ X)` / "
        "`wrong (→ X)`: the runner was not timed and X was measured in its place; X's "
        "latency is then the baseline of that row.",
        "",
        latency_table(suite),
        "",
        "## Distance from the roofline",
        "",
        "Bound = max(FLOPs / FMA peak, compulsory bytes / copy bandwidth); compulsory bytes "
        "= inputs + weights + outputs once; unfused bytes = every operator's inputs and "
        "outputs through memory. Distance = best latency / bound. The FLOPs are the graph's "
        "(a Winograd form computes fewer multiply-adds) and the copy bandwidth is one numpy "
        "thread's (every core together copies faster), so a distance below 1 is possible.",
        "",
        roofline_table(suite),
        "",
        "## Timing spread",
        "",
        f"Per runner: (max − min) / median of its round medians (target ≤ "
        f"{SPREAD_TARGET:.0%} on an idle machine; ⚠ above), then rounds × calls per round. "
        "machine: the same for a fixed single-threaded Python loop timed in the same rounds "
        "(`bench.timing.reference_work`): where it is over the target too, the machine "
        "gave the processes uneven CPU during the row, whatever the runtime. round trip: one "
        "cache line from a thread on one core to a thread on another and back "
        "(`machine.measure_round_trip_ns`), with every worker quiet, just before and after the "
        "rounds; every fork/join of a thread pool pays it, and on a VM it jumps for minutes "
        "(about 50 -> 400 ns on the 2-vCPU Zen 5) when the host places the CPUs apart. "
        "Rounds around which it read over twice the run's fastest are timed again once it "
        "is back (`bench.timing.time_in_fast_phase`, waiting up to 2 minutes); \"timed "
        "again\" gives the discarded attempt's round trip.",
        "",
        spread_table(suite),
        "",
    ]
    settings = settings_lines(suite)
    if settings:
        parts += ["## Settings", "", *settings, ""]
    issues = problems(suite)
    if issues:
        parts += ["## Runners not timed", "", *issues, ""]
    if suite.notes:
        parts += ["## Notes", "", *[f"- {n}" for n in suite.notes], ""]
    if chart:
        parts += [f"![speedup chart]({chart})", ""]
    return "\n".join(parts)


def write_chart(suite: SuiteResult, path: Path) -> Optional[str]:
    """A grouped bar chart of speedups vs the baseline; returns a note when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install 'tvm_einweld[plot]')"
    labels = [f"{m.model}\nb{m.batch}" for m in suite.models]
    # Only runners with at least one timed result get a bar colour and a legend entry.
    runners = [r for r in columns(suite) if any(m.latency(r) for m in suite.models)]
    width = 0.8 / max(1, len(runners))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    for i, runner in enumerate(runners):
        values = [speedup(m, runner, suite.baseline) or 0.0 for m in suite.models]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=runner)
    ax.set_xticks([x + width * (len(runners) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=8)
    if any(b.get_height() > 0 for b in ax.patches):
        ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel(f"speedup vs {suite.baseline} (log)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def to_json(suite: SuiteResult) -> str:
    def default(obj):
        if dataclasses.is_dataclass(obj):
            return dataclasses.asdict(obj)
        raise TypeError(type(obj).__name__)

    data = dataclasses.asdict(suite)
    for m, model in zip(data["models"], suite.models):
        for r, res in zip(m["results"], model.results):
            r["median_seconds"] = res.latency
            r["spread"] = res.spread
    return json.dumps(data, indent=1, default=default)


def from_json(text: str) -> SuiteResult:
    """The SuiteResult `to_json` wrote (its derived fields, median and spread, recomputed)."""
    from .harness import RunnerResult
    from .roofline import GraphCost

    data = json.loads(text)

    def timing_of(t: Optional[dict]) -> Optional[Timing]:
        return Timing(t["name"], tuple(t["samples"]), t["calls_per_round"]) if t else None

    def runner(r: dict) -> RunnerResult:
        return RunnerResult(
            r["runner"], r["status"], r["detail"], r.get("prepare_seconds"),
            timing_of(r.get("timing")),
            tuple(tuple(kv) for kv in r.get("settings", ())), r.get("pid"), r.get("error"))

    def model(m: dict) -> ModelResult:
        return ModelResult(m["model"], m["batch"], GraphCost(**m["cost"]) if m["cost"] else None,
                           tuple(runner(r) for r in m["results"]),
                           tuple(tuple(s) for s in m.get("stand_ins", ())),
                           m.get("load_before"), m.get("load_after"), m.get("code"),
                           timing_of(m.get("reference")), m.get("round_trip_before"),
                           m.get("round_trip_after"),
                           tuple(tuple(a) for a in m.get("slow_attempts", ())))

    return SuiteResult(
        data["command"], data["started_utc"], data["wall_seconds"], MachineInfo(**data["machine"]),
        data["load_average"], data["trials"], tuple(data["runners"]), data["baseline"],
        tuple(model(m) for m in data["models"]), tuple(data.get("notes", ())),
        data.get("load_after"), data.get("threads"), data.get("isolated", True))


def write_report(suite: SuiteResult, markdown_path: Path, chart: bool = True) -> list[str]:
    """Write `markdown_path`, a `.json` next to it and (if possible) a `.png` chart.

    Returns notes for the user (e.g. why the chart is missing)."""
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    notes, chart_name = [], None
    if chart:
        png = markdown_path.with_suffix(".png")
        note = write_chart(suite, png)
        if note:
            notes.append(note)
        else:
            chart_name = png.name
    markdown_path.write_text(markdown(suite, chart_name))
    markdown_path.with_suffix(".json").write_text(to_json(suite))
    return notes


def run_header(title: str, command: str, started: str, wall_seconds: float,
               loads: tuple) -> list:
    """The first lines of a benchmark's Markdown: its title, the command, the date and wall
    time, this machine (`machine.profile`) and the load average before and after the run."""
    return [f"# {title}", "", f"Command: `{command}`  ",
            f"Date: {started} (UTC), wall time {wall_seconds / 60:.1f} min  ",
            f"Machine: {profile().describe()}  ",
            f"Load (1-min average): {loads[0]:.2f} at start, {loads[1]:.2f} at end"]
