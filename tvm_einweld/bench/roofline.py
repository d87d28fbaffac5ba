"""How far a latency is from the machine's roofline, from the ONNX graph's FLOPs and bytes.

FLOPs and intensity follow the package's one convention (`cost_model`: 2 FLOPs per point of a
summation, 1 per point otherwise, over bytes of compulsory traffic), read off each node's
shapes: 2 per multiply-add of the contractions (Conv, ConvTranspose, MatMul, Gemm, Einsum), 2
per input element of the Reduce* family and GlobalAveragePool, 1 per element (of the largest
operand) for everything else except pure data movement, which is free.
Two byte counts are kept:
- `min_bytes`: graph inputs + weights + outputs, each touched once. No schedule can move
  less, so it is the memory side of the roofline bound.
- `unfused_bytes`: every operator reading its inputs and writing its output through memory,
  i.e. the traffic without any fusion; min/unfused shows how much fusion can save.
The bound is max(FLOPs / FMA peak, min_bytes / copy bandwidth) (`MachineInfo.peak_flops`: the
C probe's FMA peak on every core, numpy's sgemm only where no compiler ran it); distance =
latency / bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from ..cost_model import intensity, point_flops
from ..machine import MachineInfo

_MOVEMENT_OPS = {"Reshape", "Transpose", "Gather", "Concat", "Split", "Flatten", "Squeeze",
                 "Unsqueeze", "Identity", "Slice", "Expand", "Shape", "Constant"}


@dataclass(frozen=True)
class GraphCost:
    flops: float
    min_bytes: float
    unfused_bytes: float

    def bound_seconds(self, machine: MachineInfo) -> float:
        return max(self.flops / machine.peak_flops,
                   self.min_bytes / (machine.copy_gbs * 1e9))

    def intensity(self) -> float:
        """`cost_model.intensity`: FLOPs per byte of `min_bytes`."""
        return intensity(self.flops, self.min_bytes)


def _value_types(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (static shape, bytes per element) for every typed value of the graph."""
    types = {}
    for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).itemsize
        types[vi.name] = (dims, itemsize)
    for init in model.graph.initializer:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        types[init.name] = (tuple(init.dims), itemsize)
    return types


def _numel(shape: tuple[int, ...]) -> int:
    if any(d < 0 for d in shape):
        raise ValueError(f"dynamic shape {shape}: roofline needs static shapes")
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _einsum_flops(equation: str, shapes: list[tuple[int, ...]]) -> float:
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, shape in zip(lhs, shapes):
        if "." in term:
            raise ValueError("Einsum with ellipsis is not counted")
        sizes.update(zip(term, shape))
    return float(point_flops(_numel(tuple(sizes.values())), summation=True))


def node_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> float:
    ins = [shapes[i] for i in node.input if i]
    out = shapes[node.output[0]]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        w = ins[1]  # (Cout, Cin/group, kh, kw): each output element sums Cin/group*kh*kw terms
        return float(point_flops(_numel(out) * _numel(w[1:]), summation=True))
    if node.op_type == "ConvTranspose":
        x, w = ins[0], ins[1]  # every input element scatters into Cout/group*kh*kw outputs
        return float(point_flops(_numel(x) * _numel(w[1:]), summation=True))
    if node.op_type == "MatMul":
        return float(point_flops(_numel(out) * ins[0][-1], summation=True))
    if node.op_type == "Gemm":
        k = ins[0][0] if attrs.get("transA", 0) else ins[0][-1]
        return float(point_flops(_numel(out) * k, summation=True))
    if node.op_type == "Einsum":
        return _einsum_flops(attrs["equation"].decode() if isinstance(attrs["equation"], bytes)
                             else attrs["equation"], ins)
    if node.op_type.startswith("Reduce") or node.op_type == "GlobalAveragePool":
        return float(point_flops(_numel(ins[0]), summation=True))
    if node.op_type in _MOVEMENT_OPS:
        return 0.0
    return float(point_flops(max([_numel(s) for s in ins] + [_numel(out)]), summation=False))


def graph_cost(model: onnx.ModelProto) -> GraphCost:
    """FLOPs and byte counts of a statically shaped ONNX model."""
    model = onnx.shape_inference.infer_shapes(model)
    types = _value_types(model)
    missing = [o for n in model.graph.node for o in [*n.input, *n.output] if o and o not in types]
    if missing:
        raise ValueError(f"no static shape for {missing[0]!r}: run shape inference first")
    shapes = {k: s for k, (s, _) in types.items()}
    nbytes = {k: _numel(s) * size for k, (s, size) in types.items()}
    flops = sum(node_flops(n, shapes) for n in model.graph.node)
    used = {i for n in model.graph.node for i in n.input if i}
    boundary = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    boundary |= {t.name for t in model.graph.initializer if t.name in used}
    min_bytes = sum(nbytes[name] for name in boundary)
    unfused = sum(nbytes[v] for n in model.graph.node for v in [*n.input, *n.output] if v)
    return GraphCost(float(flops), float(min_bytes), float(unfused))
