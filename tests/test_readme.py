"""The README's Python code blocks run as written, on a small ONNX model built here.

The prelude gives each block what the README says it comes from: `model.onnx` in the working
folder (the blocks' files are written to a temporary folder), `inputs` (numpy arrays in graph-input order) and `model.so` from `optimize model.onnx -o
model.so`.
"""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _save_model(path: Path) -> None:
    """Conv 3x3 + ReLU on a 1x3x8x8 input: small enough to compile and tune in seconds."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(
        np.random.default_rng(0).uniform(-1, 1, (4, 3, 3, 3)).astype("float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])],
        "readme", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]),
              path)


def _prelude(folder: Path, block: str) -> dict:
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    from tvm_einweld.models import random_inputs
    from tvm_einweld.tir_passes.device import host_target

    _save_model(folder / "model.onnx")
    model = onnx.load(folder / "model.onnx")
    if "model.so" in block:
        out = subprocess.run([sys.executable, "-m", "tvm_einweld", "optimize", "model.onnx",
                              "-o", "model.so", "--no-derive"], cwd=folder,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {"mod": from_onnx(model, keep_params_in_input=False), "target": host_target(),
            "inputs": list(random_inputs(model).values())}


def test_the_readme_has_its_python_blocks():
    assert len(BLOCKS) == 4


def _run_blocks(indices, folder: Path, monkeypatch) -> dict:
    """Run the README blocks `indices` in order, in one namespace (a block that says "as
    above" continues the one before it)."""
    monkeypatch.chdir(folder)
    namespace = _prelude(folder, "".join(BLOCKS[i] for i in indices))
    for i in indices:
        exec(compile(BLOCKS[i], f"README.md python block {i + 1}", "exec"), namespace)
    return namespace


def test_use_block(tmp_path, monkeypatch):
    ns = _run_blocks([0], tmp_path, monkeypatch)
    assert hasattr(ns["ex"], "export_library") and ns["staged"] is not None
    assert (tmp_path / "rewrites.jsonl").exists()


def test_tuning_block(tmp_path, monkeypatch):
    ns = _run_blocks([0, 1], tmp_path, monkeypatch)
    assert hasattr(ns["ex"], "export_library") and ns["db"] is not None
    assert (tmp_path / "tune").is_dir() and (tmp_path / "work_dir").is_dir()


def test_exported_library_block(tmp_path, monkeypatch):
    ns = _run_blocks([2], tmp_path, monkeypatch)
    out = ns["out"]
    result = (out if hasattr(out, "numpy") else out[0]).numpy()
    expected = np.maximum(0, _conv_reference(ns["inputs"][0], tmp_path / "model.onnx"))
    np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)


def test_blas_threads_block(tmp_path, monkeypatch):
    """The OpenBLAS cap around the exported library's inference (the block after it)."""
    ns = _run_blocks([2, 3], tmp_path, monkeypatch)
    out = ns["out"]
    result = (out if hasattr(out, "numpy") else out[0]).numpy()
    expected = np.maximum(0, _conv_reference(ns["inputs"][0], tmp_path / "model.onnx"))
    np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)


def _conv_reference(x: np.ndarray, path: Path) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    w = numpy_helper.to_array(onnx.load(path).graph.initializer[0])
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((1, 4, 8, 8), "float32")
    for r in range(3):
        for s in range(3):
            out += np.einsum("nchw,fc->nfhw", padded[:, :, r:r + 8, s:s + 8], w[:, :, r, s])
    return out
