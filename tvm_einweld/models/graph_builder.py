"""A small helper for writing ONNX graphs by hand with `onnx.helper`.

Every zoo model is built offline: weights are drawn from a seeded numpy generator with
He-style scaling (std = sqrt(2 / fan_in)), so activations stay O(1) through deep stacks and
fp32 comparisons against onnxruntime stay meaningful. Nothing is downloaded.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# onnxruntime 1.31 loads ONNX IR <= 13; TVM's importer handles opset 17 (LayerNormalization).
IR_VERSION = 8
OPSET = 17


class GraphBuilder:
    """Accumulates nodes and seeded random initializers, then emits a checked ModelProto.

    Methods take and return value names (strings), so model code reads like the network.
    """

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self._rng = np.random.default_rng(seed)
        self._nodes: list[onnx.NodeProto] = []
        self._inits: list[onnx.TensorProto] = []
        self._inputs: list[onnx.ValueInfoProto] = []
        self._counter = 0

    # ---- naming and raw material -------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}_{self._counter}"

    def input(self, name: str, shape: Sequence[int]) -> str:
        self._inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def const(self, value: np.ndarray, prefix: str = "c") -> str:
        name = self.fresh(prefix)
        self._inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape: Sequence[int], fan_in: int, prefix: str = "w") -> str:
        std = np.sqrt(2.0 / fan_in)
        return self.const((self._rng.standard_normal(shape) * std).astype(np.float32), prefix)

    def param(self, shape: Sequence[int], mean: float = 0.0, std: float = 0.1,
              prefix: str = "p") -> str:
        """A seeded random parameter around `mean` (norm scales and shifts)."""
        return self.const((mean + std * self._rng.standard_normal(shape)).astype(np.float32),
                          prefix)

    def bias(self, n: int, prefix: str = "b") -> str:
        return self.param([n], std=0.05, prefix=prefix)

    def node(self, op: str, inputs: Sequence[str], n_out: int = 1, **attrs) -> str | list[str]:
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self._nodes.append(helper.make_node(op, list(inputs), outs, **attrs))
        return outs[0] if n_out == 1 else outs

    # ---- layers ---------------------------------------------------------------------------
    def conv(self, x: str, c_in: int, c_out: int, kernel: Sequence[int] | int, stride: int = 1,
             pad: Optional[Sequence[int]] = None, dilation: int = 1, group: int = 1,
             bias: bool = True) -> str:
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        if pad is None:  # "same" padding for odd kernels
            pad = [dilation * (kh - 1) // 2, dilation * (kw - 1) // 2] * 2
        w = self.weight([c_out, c_in // group, kh, kw], fan_in=c_in // group * kh * kw)
        ins = [x, w] + ([self.bias(c_out)] if bias else [])
        return self.node("Conv", ins, kernel_shape=[kh, kw], strides=[stride, stride],
                         pads=list(pad), dilations=[dilation, dilation], group=group)

    def conv_transpose(self, x: str, c_in: int, c_out: int, kernel: int, stride: int, pad: int,
                       output_padding: int = 0, bias: bool = True) -> str:
        # fan_in of a transposed conv is what each output pixel sums over.
        w = self.weight([c_in, c_out, kernel, kernel],
                        fan_in=max(1, c_in * kernel * kernel // (stride * stride)))
        ins = [x, w] + ([self.bias(c_out)] if bias else [])
        attrs = dict(kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad] * 4)
        if output_padding:
            attrs["output_padding"] = [output_padding] * 2
        return self.node("ConvTranspose", ins, **attrs)

    def linear(self, x: str, d_in: int, d_out: int, bias: bool = True) -> str:
        """x @ W (+ b) over the last axis, as exporters emit it (MatMul + Add)."""
        y = self.node("MatMul", [x, self.weight([d_in, d_out], fan_in=d_in)])
        return self.node("Add", [y, self.bias(d_out)]) if bias else y

    def layer_norm(self, x: str, dim: int, axis: int = -1) -> str:
        gamma, beta = self.param([dim], mean=1.0), self.param([dim])
        return self.node("LayerNormalization", [x, gamma, beta], axis=axis, epsilon=1e-5)

    def relu(self, x: str) -> str:
        return self.node("Relu", [x])

    def relu6(self, x: str) -> str:
        lo = self.const(np.array(0.0, np.float32))
        hi = self.const(np.array(6.0, np.float32))
        return self.node("Clip", [x, lo, hi])

    def prelu(self, x: str, channels: int) -> str:
        slope = self.const(np.full((channels, 1, 1), 0.25, np.float32), "slope")
        return self.node("PRelu", [x, slope])

    def gelu(self, x: str) -> str:
        """GELU as PyTorch exports it at opset 17: 0.5 * x * (1 + erf(x / sqrt(2)))."""
        s = self.node("Div", [x, self.const(np.array(np.sqrt(2.0), np.float32))])
        e = self.node("Add", [self.node("Erf", [s]), self.const(np.array(1.0, np.float32))])
        return self.node("Mul", [self.node("Mul", [x, e]), self.const(np.array(0.5, np.float32))])

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        return self.node("Reshape", [x, self.const(np.array(shape, np.int64), "shape")])

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        return self.node("Transpose", [x], perm=list(perm))

    def scale(self, x: str, value: float) -> str:
        return self.node("Mul", [x, self.const(np.array(value, np.float32))])

    # ---- output -------------------------------------------------------------------------
    def build(self, outputs: Sequence[str], doc: str = "") -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        graph = helper.make_graph(self._nodes, self.name, self._inputs, outs, self._inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  ir_version=IR_VERSION, producer_name="tvm_einweld.models")
        model.doc_string = doc
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        # Give the outputs their inferred shapes so consumers need not re-infer.
        inferred = {vi.name: vi for vi in model.graph.value_info}
        for out in model.graph.output:
            if out.name in inferred:
                out.CopyFrom(inferred[out.name])
        onnx.checker.check_model(model, full_check=True)
        return model
