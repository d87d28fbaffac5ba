"""The command line: subcommands listed, clear errors (no traceback) for bad input."""
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
    (("derive", "missing.onnx"), "no such ONNX file"),
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
    # --log: one JSON record per subprogram the derivation search saw (here the conv).
    import json

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


def test_optimize_checks_a_model_with_integer_inputs(tmp_path):
    """int64 indices get valid random indices in the check (issue 17, part 1)."""
    path = tmp_path / "gather.onnx"
    _tiny_gather_matmul(path)
    out = cli("optimize", str(path), "--no-derive")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "check against onnxruntime on random inputs: ok" in out.stdout
    assert "Traceback" not in out.stderr


def test_a_target_that_cannot_run_here_is_an_error_unless_cross_compiling(tmp_path):
    """cuda on a machine without a GPU: said on stdout, exit code 2 (issue 17, part 6)."""
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU")  # the error path needs a machine without one
    path = tmp_path / "gather.onnx"
    _tiny_gather_matmul(path)
    out = cli("optimize", str(path), "--target", "cuda", "--no-derive", "--no-fuse")
    assert out.returncode == 2 and "no cuda device" in out.stdout
    assert "--cross-compile" in out.stdout


def test_the_default_target_is_this_cpu():
    out = cli("optimize", "--help")
    assert out.returncode == 0 and '"host"' in out.stdout and "default" in out.stdout
