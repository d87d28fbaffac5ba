"""The command line: subcommands listed, clear errors (no traceback) for bad input."""
import json
import os
import re
import subprocess
import sys

import pytest

from tvm_einweld.cli import SUBCOMMANDS


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tvm_einweld", *args],
                          capture_output=True, text=True, timeout=300)


def test_help_lists_every_subcommand():
    out = cli("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("args,message", [
    (("demo", "--model", "nosuch"), "unknown model 'nosuch'"),
    (("derive", "missing.onnx"), "no such ONNX file: missing.onnx"),
    (("optimize", "missing.onnx"), "no such ONNX file: missing.onnx"),
    (("tune", "missing.onnx", "--trials", "1"), "no such ONNX file: missing.onnx"),
    (("optimize", "tests"), "tests is a directory, not an ONNX file"),
    (("derive", "tests"), "tests is a directory, not an ONNX file"),
])
def test_bad_input_gets_one_clear_line(args, message):
    out = cli(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_invalid_onnx_file_is_reported(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf")
    out = cli("derive", str(bad))
    assert out.returncode == 2 and "not a valid ONNX model" in out.stderr
    assert "Traceback" not in out.stderr


def test_optimize_exports_a_checked_library(tmp_path):
    """A small ONNX model through `optimize`: checked against onnxruntime, library written,
    every derivation logged."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.uniform(-1, 1, (4, 3, 3, 3)).astype("float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    path = tmp_path / "tiny.onnx"
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]),
              path)
    log = tmp_path / "rewrites.jsonl"
    out = cli("optimize", str(path), "-o", str(tmp_path / "tiny.so"), "--log", str(log))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "check against onnxruntime on random inputs: ok" in out.stdout
    assert (tmp_path / "tiny.so").stat().st_size > 0
    assert [p.name for p in tmp_path.glob("tiny.so*")] == ["tiny.so"]  # no staging file left
    # TVM's "Scope Saving:" / "Scope Loaded:" warnings (issue 17): neither on export nor on load.
    assert "Scope" not in out.stderr
    load = subprocess.run([sys.executable, "-c", "import tvm; from tvm import relax; "
                           f"relax.VirtualMachine(tvm.runtime.load_module({str(tmp_path / 'tiny.so')!r}), "
                           "tvm.cpu())"], capture_output=True, text=True, timeout=120)
    assert load.returncode == 0 and "Scope" not in load.stderr, load.stderr
    # --log: one JSON record per subprogram the derivation search saw (here the conv).
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["ops"][0] for r in records] == ["relax.nn.conv2d"]
    assert {"rules", "verified", "est_time_s", "orig_time_s"} <= set(records[0]["chosen"])


def _tiny_gather_matmul(path):
    """int64 token ids (Gather) then a MatMul, with a dynamic batch dimension."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.uniform(-1, 1, (50, 8)).astype("float32"), "E")
    weight = numpy_helper.from_array(rng.uniform(-1, 1, (8, 5)).astype("float32"), "W")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["g"], axis=0),
         helper.make_node("MatMul", ["g", "W"], ["y"])],
        "gather_matmul", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 7, 5])], [table, weight])
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]),
              path)


def _optimize_gather_matmul(tmp_path, *flags):
    """`optimize` on the Gather + MatMul model with `flags`: it compiles and checks ok."""
    path = tmp_path / "gather.onnx"
    _tiny_gather_matmul(path)
    out = cli("optimize", str(path), *flags)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "check against onnxruntime on random inputs: ok" in out.stdout
    assert "Traceback" not in out.stderr


def test_optimize_checks_a_model_with_integer_inputs(tmp_path):
    """int64 indices get valid random indices in the check (issue 17, part 1)."""
    _optimize_gather_matmul(tmp_path, "--no-derive")


def test_a_target_that_cannot_run_here_is_an_error_unless_cross_compiling(tmp_path):
    """cuda on a machine without a GPU: said on stdout, exit code 2 (issue 17, part 6)."""
    import tvm

    path = tmp_path / "gather.onnx"
    _tiny_gather_matmul(path)
    out = cli("optimize", str(path), "--target", "cuda", "--no-derive", "--no-fuse")
    if tvm.cuda(0).exist:  # a machine with a GPU runs it: not an error there
        assert out.returncode == 0 and "no cuda device" not in out.stdout
        return
    assert out.returncode == 2 and "no cuda device" in out.stdout
    assert "--cross-compile" in out.stdout


def test_the_default_target_is_this_cpu():
    out = cli("optimize", "--help")
    assert out.returncode == 0 and '"host"' in out.stdout and "default" in out.stdout


def _dynamic_conv_clip(path):
    """Conv then Clip(0, 6) on an input with a symbolic batch dimension "N"."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(-1, 1, (4, 3, 3, 3)).astype("float32"), "w"),
             numpy_helper.from_array(np.array(0, "float32"), "lo"),
             numpy_helper.from_array(np.array(6, "float32"), "hi")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Clip", ["c", "lo", "hi"], ["y"])],
        "conv_clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], inits)
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]),
              path)


def test_input_shape_binds_dynamic_dimensions_for_compilation_and_check(tmp_path):
    """--input-shape sets the batch of the compiled model and of the onnxruntime check; the
    output says what was bound (issue 17)."""
    path = tmp_path / "dyn.onnx"
    _dynamic_conv_clip(path)
    out = cli("optimize", str(path), "--input-shape", "x:2x3x8x8", "--no-derive", "--no-fuse")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "input x: 2x3x8x8, dynamic dimensions bound as given: N=2" in out.stdout
    assert "check against onnxruntime on random inputs: ok" in out.stdout
    assert "symbolic shape" not in out.stdout and "NOT equal" not in out.stdout
    # The note names what the model holds, not Relax internals of the ONNX import.
    assert "relax.call_tir" not in out.stdout and "relax.isnan" not in out.stdout


def test_dynamic_dimensions_default_to_one_and_derive_json_stays_clean(tmp_path):
    """Without --input-shape a dynamic dimension is 1 (said on stderr with --json); stdout is
    one JSON object; one progress line per subprogram with its seconds (issue 17)."""
    path = tmp_path / "dyn.onnx"
    _dynamic_conv_clip(path)
    out = cli("derive", str(path), "--json", "--max-depth", "1", "--time-limit", "0.5")
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout)
    assert [s["ops"] for s in record["subprograms"]] == [["relax.nn.conv2d"]]
    assert "dynamic dimensions bound by default; --input-shape to change: N=1" in out.stderr
    assert re.search(r"subprogram 1/1 main#0 \(relax.nn.conv2d\): [0-9.]+ s", out.stderr)


def test_derive_text_notes_once_each_and_in_words(tmp_path):
    path = tmp_path / "dyn.onnx"
    _dynamic_conv_clip(path)
    out = cli("derive", str(path), "--max-depth", "2", "--time-limit", "0.5")
    assert out.returncode == 0, out.stderr[-2000:]
    notes = [line for line in out.stdout.splitlines() if line.strip().startswith("note:")]
    assert len(notes) == len(set(notes))
    assert not re.search(r"\b[A-Z]\w*(Error|Exception): ", out.stdout)
    if any(line.lstrip().startswith("x ") for line in out.stdout.splitlines()):
        assert "x timed and not faster" in out.stdout  # every mark has its legend


@pytest.mark.parametrize("spec,message", [
    ("x:2x3x9x8", "dimension 2 is 8 in the model, the given shape says 9"),
    ("y:1x3x8x8", "the model has no input 'y'; its inputs are x"),
    ("x:2x3x8", "has 4 dimensions"),
    ("x=2x3x8x8", "malformed input shape"),
    ("x:0x3x8x8", "malformed input shape"),
])
def test_a_bad_input_shape_is_one_clear_line(tmp_path, spec, message):
    path = tmp_path / "dyn.onnx"
    _dynamic_conv_clip(path)
    for command in ("optimize", "derive"):
        out = cli(command, str(path), "--input-shape", spec)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_input_shapes_comma_separated_or_repeated():
    from tvm_einweld.models import parse_input_shapes

    assert parse_input_shapes(["a:1x2,b:3", "c:4X5"]) == {"a": (1, 2), "b": (3,), "c": (4, 5)}
    with pytest.raises(ValueError, match="given a shape twice"):
        parse_input_shapes(["a:1", "a:2"])


def test_optimize_with_trials_says_whether_tuning_was_used(tmp_path):
    """--trials N: stdout says whether the tuned kernels are used, and why not (issue 17)."""
    path = tmp_path / "gather.onnx"
    _tiny_gather_matmul(path)
    out = cli("optimize", str(path), "--no-derive", "--trials", "1", "--work-dir",
              str(tmp_path / "db"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(line for line in out.stdout.splitlines() if "1 trials, adaptive:" in line)
    assert "tuned kernels used" in line or "tuned kernels NOT used:" in line
    assert "0 tasks" not in line or "no kernel to tune" in line


def test_bench_progress_goes_to_stderr(tmp_path):
    out = cli("bench", "--models", "gcn", "--runners", "onnxruntime", "--repeats", "1",
              "--no-chart", "-o", str(tmp_path / "r.md"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"\] +gcn b1: preparing onnxruntime", out.stderr)
    assert "preparing onnxruntime" not in out.stdout and "# Zoo benchmark" in out.stdout


def test_optimize_without_measuring(tmp_path):
    """`--no-measure` compiles by the cost model alone and still checks the result."""
    _optimize_gather_matmul(tmp_path, "--no-measure")


def test_tune_a_task_with_the_leader_rule(tmp_path):
    """`tune --task ... --selector leader`: the rounds follow the rule's warm-up (NL, LR, LC)
    and the table names the variant by its rule."""
    out = cli("tune", "--task", "conv2d:1,4,6,6,4,3,1,1", "--trials", "3", "--per-round", "1",
              "--selector", "leader", "--work-dir", str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rounds = re.findall(r"\[adaptive-leader\]\s+round\s+\d+\s+(\w\w)", out.stdout + out.stderr)
    assert rounds == ["NL", "LR", "LC"]
    assert "| adaptive-leader |" in out.stdout
    assert os.path.isdir(out.stdout.rsplit(": ", 1)[-1].strip())  # the database it names
