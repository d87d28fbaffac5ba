"""`tune` subcommand: clear errors for bad input, and an end-to-end run (slow)."""
import argparse

import pytest

from tvm_einweld.cli import UserError
from tvm_einweld.commands import tune


def parse(*argv):
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, message",
    [
        ((), "either an ONNX model"),
        (("m.onnx", "--task", "conv2d:1,8,8,8,8,3,1,1"), "either an ONNX model"),
        (("missing.onnx",), "no such ONNX file: missing.onnx"),
        (("--task", "conv2d:1,8,8,8,8,3,1,1", "--input-shape", "x:1x4x8x8"), "--input-shape"),
        (("--task", "conv2d:1,8,8"), "eight integers"),
        (("--task", "conv3d:1,8,8,8,8,3,1,1"), "only conv2d"),
        (("--task", "conv2d:1,8,8,8,8,3,0,1"), "positive"),
        (("--task", "conv2d:1,8,2,2,8,7,1,0"), "kernel larger"),
        (("--task", "conv2d:1,8,8,8,8,3,1,1", "--trials", "0"), "--trials"),
        (("--task", "conv2d:1,8,8,8,8,3,1,1", "--strategy", "NL", "--selector", "bandit"), "--selector"),
    ],
)
def test_bad_input_is_a_user_error(argv, message):
    with pytest.raises(UserError, match=message):
        tune.run(parse(*argv))


def test_not_an_onnx_file(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("x")
    with pytest.raises(UserError, match="not a valid ONNX model"):
        tune.run(parse(str(path)))


def test_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(UserError, match="is a directory, not an ONNX file"):
        tune.run(parse(str(tmp_path)))


@pytest.mark.parametrize("secs, text", [(None, "n/a"), (3.89e-6, "3.89 µs"), (2.5e-4, "0.250 ms"),
                                        (12.0, "12.0 s")])
def test_times_are_shown_in_a_unit_that_keeps_their_digits(secs, text):
    """Never "best so far 0.0000 ms" (issue 17)."""
    assert tune.duration(secs) == text


@pytest.mark.slow
def test_task_end_to_end(capsys, tmp_path):
    code = tune.run(parse("--task", "conv2d:1,8,8,8,8,3,1,1", "--trials", "4", "--per-round", "2",
                          "--work-dir", str(tmp_path)))
    out = capsys.readouterr().out
    assert code == 0
    assert "round   1  LR" in out or "round   1  NL" in out
    assert "final comparison" in out and "| untuned |" in out and "| adaptive |" in out


def tiny_onnx_conv(path):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype("float32"), "w")
    b = numpy_helper.from_array(rng.standard_normal((8,)).astype("float32"), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 8, 8])],
        initializer=[w, b],
    )
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 13)]), path)


@pytest.mark.slow
def test_onnx_model_end_to_end(capsys, tmp_path):
    path = str(tmp_path / "conv.onnx")
    tiny_onnx_conv(path)
    code = tune.run(parse(path, "--trials", "2", "--per-round", "2", "--work-dir", str(tmp_path / "db"),
                          "--input-shape", "x:2x4x8x8"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "input x: 2x4x8x8, dynamic dimensions bound as given: N=2" in out
    assert "final comparison" in out and "outputs of the tuned and untuned builds agree" in out
    assert "0.0000 ms" not in out
    tuned_speedup = float(out.split("| tuned |")[1].split("|")[1].strip().rstrip("x"))
    assert (tuned_speedup < 1) == ("the tuned build is slower" in out)
