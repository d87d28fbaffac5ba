"""Report writing (table, ratios, geomean, JSON, chart) and the `bench` command end to end."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from tvm_einweld.bench import report, suite
from tvm_einweld.bench.harness import FAILED, OK, WRONG, ModelResult, RunnerResult
from tvm_einweld.machine import MachineInfo
from tvm_einweld.bench.roofline import GraphCost
from tvm_einweld.bench.runners import PYTORCH
from tvm_einweld.bench.timing import Timing
from tvm_einweld.cli import UserError
from tvm_einweld.commands import bench

MACHINE = MachineInfo("Test CPU", 2, 8.0, 100.0, 10.0, "1.0", "2026-01-01T00:00:00+00:00")


def _ok(name: str, seconds: float, error: float = 1e-7) -> RunnerResult:
    return RunnerResult(name, OK, "max |err| 0", 1.0, Timing(name, (seconds,) * 3, 10),
                        settings=(("TVM_NUM_THREADS", "2"), ("cpus", "0,1")), pid=42,
                        error=error)


def _suite() -> report.SuiteResult:
    cost = GraphCost(flops=2e9, min_bytes=1e7, unfused_bytes=5e7)
    models = (
        ModelResult("alpha", 1, cost, (_ok("base", 0.010), _ok("fast", 0.005),
                                       RunnerResult("odd", WRONG, "max |err| 3")),
                    load_before=0.25, load_after=0.5,
                    reference=Timing("machine", (0.001, 0.0012, 0.001), 200),
                    round_trip_before=52.4, round_trip_after=388.0),
        ModelResult("beta", 1, cost, (_ok("base", 0.020), _ok("fast", 0.080),
                                      RunnerResult("odd", FAILED, "RuntimeError: boom"))),
    )
    return report.SuiteResult("python benchmarks/zoo.py --quick", "2026-01-01T00:00:00+00:00",
                              90.0, MACHINE, 0.5, 16, ("base", "fast", "odd"), "base", models,
                              ("pytorch skipped: not installed: torch",), load_after=0.75,
                              threads=2)


def test_latency_table_has_ratios_and_geomean() -> None:
    table = report.latency_table(_suite())
    lines = table.splitlines()
    assert lines[0] == "| model | batch | base | fast | odd |"
    assert "| alpha | 1 | 10 (1.00×) | 5 (2.00×) | wrong |" in lines
    assert "| beta | 1 | 20 (1.00×) | 80 (0.25×) | failed |" in lines
    assert lines[-1] == "| geomean speedup vs base | | 1.00× | 0.71× | – |"  # sqrt(2 * 0.25)


def test_spread_settings_load_and_reduced_precision_error() -> None:
    suite = _suite()
    noisy = RunnerResult("fast", OK, "max |err| 0.02", 1.0, Timing("fast", (0.004, 0.005, 0.006),
                                                                   7), error=7e-3,
                         settings=(("TVM_NUM_THREADS", "1"),))
    models = (suite.models[0], ModelResult("beta", 1, None, (_ok("base", 0.020), noisy)))
    suite = dataclasses.replace(suite, models=models)
    spread = report.spread_table(suite)
    # The machine's reference loop first: its 20 % says alpha's rounds ran on a noisy machine.
    assert ("| model | batch | load before → after | round trip ns before → after | machine | "
            "base | fast | odd |") in spread
    assert ("| alpha | 1 | 0.25 → 0.50 | 52 → 388 | 20.0% ⚠ (3×200) | 0.0% (3×10) | "
            "0.0% (3×10) | – |") in spread
    assert "| beta | 1 | ? → ? | ? → ? | – | 0.0% (3×10) | 40.0% ⚠ (3×7) | – |" in spread
    # A runner off by more than fp32 rounding shows its error beside its latency.
    assert "| beta | 1 | 20 (1.00×) | 5 (4.00×) err 7.0e-03 | – |" in report.latency_table(suite)
    assert report.settings_lines(suite) == [
        "- settings base: TVM_NUM_THREADS=2, cpus=0,1",
        "- settings fast (alpha b1): TVM_NUM_THREADS=2, cpus=0,1",
        "- settings fast (beta b1): TVM_NUM_THREADS=1"]
    text = report.markdown(suite)
    assert "Load (1-min average): 0.50 at start, 0.75 at end" in text
    assert "own worker process with 2 threads" in text and "## Settings" in text
    assert "## Timing spread" in text


def test_roofline_table_uses_the_best_correct_runner() -> None:
    table = report.roofline_table(_suite())
    # bound = max(2e9 / 100e9, 1e7 / 10e9) = 20 ms; alpha's best is fast at 5 ms
    assert "| alpha | 1 | 2 | 10 | 50 | 200 | 20 | fast | 5 | 0.2× |" in table
    assert "| beta | 1 | 2 | 10 | 50 | 200 | 20 | base | 20 | 1.0× |" in table


def test_markdown_names_command_machine_problems_and_notes() -> None:
    text = report.markdown(_suite(), chart="x.png")
    assert "Command: `python benchmarks/zoo.py --quick`" in text
    assert "Test CPU" in text and "sgemm 100 GFLOP/s" in text and "16 MetaSchedule trials" in text
    assert "- alpha b1, odd: **wrong** — max |err| 3" in text
    assert "- beta b1, odd: **failed** — RuntimeError: boom" in text
    assert "- pytorch skipped: not installed: torch" in text and "![speedup chart](x.png)" in text


def test_write_report_writes_markdown_json_and_chart(tmp_path) -> None:
    notes = report.write_report(_suite(), tmp_path / "out" / "r.md")
    assert notes == []  # matplotlib is installed in the test environment
    assert (tmp_path / "out" / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![speedup chart](r.png)" in (tmp_path / "out" / "r.md").read_text()
    data = json.loads((tmp_path / "out" / "r.json").read_text())
    assert data["models"][0]["results"][1]["median_seconds"] == 0.005
    assert data["models"][0]["results"][1]["spread"] == 0.0
    assert data["models"][0]["results"][1]["settings"][0] == ["TVM_NUM_THREADS", "2"]
    assert data["machine"]["cpu_model"] == "Test CPU"
    again = report.from_json((tmp_path / "out" / "r.json").read_text())
    assert (again.models[0].round_trip_before, again.models[0].round_trip_after) == (52.4, 388.0)
    assert again.models[1].round_trip_before is None


def _args(tmp_path, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["-o", str(tmp_path / "r.md")]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)


@pytest.mark.parametrize("bad", [dict(models="nosuchnet"), dict(runners="onnxruntime,nope"),
                                 dict(batch="one"), dict(trials=-1),
                                 dict(runners="onnxruntime", baseline="tvm-tuned"),
                                 dict(threads=0)])
def test_bench_command_rejects_bad_input_as_user_error(tmp_path, bad) -> None:
    with pytest.raises(UserError):
        bench.run(_args(tmp_path, quick=True, **bad))


def test_bench_command_runs_end_to_end(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(suite, "describe_machine", lambda: MACHINE)  # skip the peak probes
    code = bench.run(_args(tmp_path, quick=True, models="fsrcnn",
                           runners="tvm-untuned,onnxruntime,pytorch", repeats=2, threads=1))
    assert code == 0
    text = (tmp_path / "r.md").read_text()
    assert "| model | batch | tvm-untuned | onnxruntime | pytorch |" in text
    row = next(line for line in text.splitlines() if line.startswith("| fsrcnn | 1 |"))
    timed = 2 + (PYTORCH.unavailable() is None)
    assert row.count("×") == timed  # every available runner checked correct and timed
    out = capsys.readouterr().out
    assert "geomean speedup vs tvm-untuned" in out and "wrote" in out
    assert "- settings onnxruntime: TVM_NUM_THREADS=1" in text
    assert "intra_op_num_threads=1" in text and "tvm_pool_threads=1" in text


def test_bench_command_in_process(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(suite, "describe_machine", lambda: MACHINE)
    assert bench.run(_args(tmp_path, quick=True, models="fsrcnn", runners="onnxruntime",
                           repeats=2, in_process=True)) == 0
    text = (tmp_path / "r.md").read_text()
    assert "All runners ran in this one process" in text


def test_suite_reports_each_finished_model(tmp_path, monkeypatch) -> None:
    """A long run cut short keeps its finished rows: `on_model` sees each partial result."""
    monkeypatch.setattr(suite, "describe_machine", lambda: MACHINE)
    monkeypatch.setattr(suite, "load_average", lambda: 0.0)  # an idle machine
    config = suite.with_overrides(suite.QUICK, models=("fsrcnn", "nerf"),
                                  runners=("onnxruntime",), baseline="onnxruntime")
    partials = []
    final = suite.run_suite(config, log=lambda s: None, on_model=partials.append)
    assert [[m.model for m in p.models] for p in partials] == [["fsrcnn"], ["fsrcnn", "nerf"]]
    assert "partial: 1 more model(s) to measure" in partials[0].notes
    assert not any(n.startswith("partial") for n in final.notes)
    assert not any("busy" in n for n in final.notes)


def test_json_report_reads_back_as_written() -> None:
    result = _suite()
    assert report.from_json(report.to_json(result)) == result


def test_a_cut_short_run_resumes_with_its_rows_and_settings(tmp_path, monkeypatch) -> None:
    """`--resume` keeps the saved rows as they were (samples, start, wall time), measures only
    the missing model, and refuses a run with other settings."""
    monkeypatch.setattr(suite, "describe_machine", lambda: MACHINE)
    argv = dict(models="fsrcnn,nerf", runners="onnxruntime", repeats=2, threads=1)
    config = suite.with_overrides(suite.QUICK, models=("fsrcnn",), runners=("onnxruntime",),
                                  baseline="onnxruntime",
                                  plan=dataclasses.replace(suite.QUICK.plan, repeats=2,
                                                           threads=1))
    earlier = suite.run_suite(config, log=lambda s: None)
    report.write_report(earlier, tmp_path / "r.md", chart=False)
    with pytest.raises(UserError, match="threads 1 then, 2 now"):
        bench.run(_args(tmp_path, quick=True, resume=True, **{**argv, "threads": 2}))
    assert bench.run(_args(tmp_path, quick=True, resume=True, no_chart=True, **argv)) == 0
    resumed = report.from_json((tmp_path / "r.json").read_text())
    assert [m.model for m in resumed.models] == ["fsrcnn", "nerf"]
    assert resumed.models[0] == earlier.models[0]
    assert resumed.started_utc == earlier.started_utc
    assert resumed.wall_seconds > earlier.wall_seconds
    assert any(n.startswith("resumed ") for n in resumed.notes)


def test_suite_says_when_the_machine_was_busy(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(suite, "describe_machine", lambda: MACHINE)
    monkeypatch.setattr(suite, "load_average", lambda: 9.0)
    config = suite.with_overrides(suite.QUICK, models=("fsrcnn",), runners=("onnxruntime",),
                                  baseline="onnxruntime")
    result = suite.run_suite(config, log=lambda s: None)
    assert any(n.startswith("the machine was busy (1-min load up to 9.0") for n in result.notes)
    assert result.load_average == result.load_after == 9.0


def test_bench_list(tmp_path, capsys) -> None:
    assert bench.run(_args(tmp_path, list=True)) == 0
    out = capsys.readouterr().out
    assert "infogan" in out and "runner tvm-tuned" in out


def test_the_report_says_which_code_measured_which_rows() -> None:
    """A resumed run can span code changes: each row keeps the code version that measured
    it (through the JSON too), and the report lists them."""
    suite = _suite()
    assert report.code_line(suite) == "Code: tvm_einweld not recorded (every row)"
    first, second = suite.models
    mixed = dataclasses.replace(suite, models=(dataclasses.replace(first, code="0.2.0+aaa"),
                                               dataclasses.replace(second, code="0.2.0+bbb")))
    line = "Code: tvm_einweld 0.2.0+aaa (alpha b1); tvm_einweld 0.2.0+bbb (beta b1)"
    assert report.code_line(mixed) == line
    assert line in report.markdown(report.from_json(report.to_json(mixed)))
