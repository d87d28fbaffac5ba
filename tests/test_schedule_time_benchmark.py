"""benchmarks/schedule_time.py: each row's kernels go to the CPU rules as the pipeline prepares
them, the GEMM-class ones are named, and the report says which rows no such rule took (no
timing is asserted)."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tvm_einweld.tir_passes.device import host_target

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "schedule_time.py"


def _module():
    spec = importlib.util.spec_from_file_location("schedule_time", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["schedule_time"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _kernel(st, label, nodes, inputs, output, weights=()):
    graph = helper.make_graph(nodes, label, inputs, [output], list(weights))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return st.K.Kernel(label, st.K.GEMM, label, nodes[-1].op_type, (("test", 1),),
                       model.SerializeToString(), 0.0, 0.0)


def test_rows_name_their_rules_and_the_report_says_which_no_gemm_rule_took():
    st = _module()
    w = numpy_helper.from_array(np.ones((5, 7), np.float32), "w")
    matmul = _kernel(st, "MatMul 3x5 . 5x7", [helper.make_node("MatMul", ["x", "w"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                     helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 7]), [w])
    relu = _kernel(st, "Relu 4x9", [helper.make_node("Relu", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 9])],
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 9]))
    rows = [st.schedule_seconds(k, host_target()) for k in (matmul, relu)]
    assert "gemm" in rows[0].rules and rows[0].seconds is not None and rows[0].kernels >= 1
    assert rows[1].seconds is None and not set(rows[1].rules) & set(st.GEMM_CLASS_RULES)
    text = st.render(rows, "python benchmarks/schedule_time.py", "2026-01-01", 1.0)
    assert "1 rows scheduled by a rule" in text and "0 over 1 s" in text
    assert "Rows no GEMM-class rule scheduled: 1 (Relu 4x9)" in text
    assert "| MatMul 3x5 . 5x7 | test |" in text and "| Relu 4x9 | test |" in text
