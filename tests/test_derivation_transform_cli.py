"""`python -m tvm_einweld derive MODEL.onnx`: JSON schema, and clear errors for bad input."""
from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tvm_einweld.cli import UserError
from tvm_einweld.commands import derive


def conv_relu_conv_onnx(path):
    rng = np.random.default_rng(0)
    w = [rng.uniform(-0.5, 0.5, (4, 4, 3, 3)).astype("float32") for _ in range(2)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "crc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor(f"w{k + 1}", TensorProto.FLOAT, a.shape, a.flatten().tolist())
         for k, a in enumerate(w)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                                ir_version=8), path)


def parse(argv):
    parser = argparse.ArgumentParser()
    derive.add_arguments(parser)
    return parser.parse_args(argv)


def test_json_schema(tmp_path, capsys, fresh_decisions):
    model = tmp_path / "crc.onnx"
    conv_relu_conv_onnx(model)
    assert derive.run(parse([str(model), "--max-depth", "2", "--max-states", "30",
                             "--time-limit", "2", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"subprograms"} and len(out["subprograms"]) == 2
    for sub in out["subprograms"]:
        assert set(sub) == {"ops", "chosen", "candidates", "stats"}
        assert sub["ops"] == ["relax.nn.conv2d"]
        chosen = sub["chosen"]
        assert set(chosen) == {"ops", "rules", "verified", "orig_time_s", "est_time_s"}
        assert all(isinstance(op, str) for op in chosen["ops"])
        assert all(op.startswith(("relax.", "eop:", "tvm_einweld.")) for op in chosen["ops"])
        assert isinstance(chosen["verified"], bool) and isinstance(chosen["rules"], list)
        assert chosen["est_time_s"] <= chosen["orig_time_s"]
        assert isinstance(sub["candidates"], int) and sub["candidates"] >= 1
        assert set(sub["stats"]) == {"states", "pruned", "seconds"}
        assert sub["stats"]["states"] >= 1 and sub["stats"]["pruned"] >= 0


def test_text_output(tmp_path, capsys, fresh_decisions):
    model = tmp_path / "crc.onnx"
    conv_relu_conv_onnx(model)
    assert derive.run(parse([str(model), "--max-depth", "1", "--time-limit", "1"])) == 0
    text = capsys.readouterr().out
    assert "subprogram main#0: relax.nn.conv2d" in text and "chosen:" in text
    assert "best at depth 0" in text and "pruned by fingerprint" in text


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such ONNX file"):
        derive.run(parse([str(tmp_path / "missing.onnx")]))


def test_invalid_onnx(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(UserError, match="not a valid ONNX model"):
        derive.run(parse([str(bad)]))


def test_invalid_budget(tmp_path):
    model = tmp_path / "crc.onnx"
    conv_relu_conv_onnx(model)
    with pytest.raises(UserError):
        derive.run(parse([str(model), "--max-states", "0"]))
