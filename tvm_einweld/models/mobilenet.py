"""A MobileNetV2 (Sandler et al. 2018) stage: inverted residual blocks, ReLU6, depthwise 3x3."""
from __future__ import annotations

import onnx

from .graph_builder import GraphBuilder


def _inverted_residual(g: GraphBuilder, x: str, c_in: int, c_out: int, stride: int,
                       expand: int) -> str:
    hidden = c_in * expand
    y = g.relu6(g.conv(x, c_in, hidden, 1))
    y = g.relu6(g.conv(y, hidden, hidden, 3, stride=stride, group=hidden))
    y = g.conv(y, hidden, c_out, 1)  # linear bottleneck: no activation
    return g.node("Add", [x, y]) if stride == 1 and c_in == c_out else y


def mobilenetv2_stage(batch: int = 1) -> onnx.ModelProto:
    """MobileNetV2's third stage: 24x56x56 in, three inverted residual blocks (expansion 6,
    32 channels, the first with stride 2, the others residual), 32x28x28 out."""
    g = GraphBuilder("mobilenetv2_stage", seed=9)
    x = g.input("features", [batch, 24, 56, 56])
    x = _inverted_residual(g, x, 24, 32, stride=2, expand=6)
    for _ in range(2):
        x = _inverted_residual(g, x, 32, 32, stride=1, expand=6)
    return g.build([x], mobilenetv2_stage.__doc__)
