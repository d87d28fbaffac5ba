"""ResNet-18 (He et al. 2016) for 3x224x224 images, batch norm folded into the convolutions."""
from __future__ import annotations

import onnx

from .graph_builder import GraphBuilder


def _basic_block(g: GraphBuilder, x: str, c_in: int, c_out: int, stride: int) -> str:
    y = g.relu(g.conv(x, c_in, c_out, 3, stride=stride))
    y = g.conv(y, c_out, c_out, 3)
    # Keep the residual sum O(1): the branch is scaled like a zero-init-ish last BN gamma.
    y = g.scale(y, 0.5)
    shortcut = x if stride == 1 and c_in == c_out else g.conv(x, c_in, c_out, 1, stride=stride)
    return g.relu(g.node("Add", [y, shortcut]))


def resnet18(batch: int = 1, num_classes: int = 1000) -> onnx.ModelProto:
    """ResNet-18: 7x7/2 stem, max-pool, four stages of two basic blocks (64, 128, 256, 512
    channels), global average pool and a 1000-way fully connected layer."""
    g = GraphBuilder("resnet18", seed=5)
    x = g.input("image", [batch, 3, 224, 224])
    x = g.relu(g.conv(x, 3, 64, 7, stride=2))
    x = g.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = 64
    for c_out, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
        x = _basic_block(g, x, c_in, c_out, stride)
        x = _basic_block(g, x, c_out, c_out, 1)
        c_in = c_out
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x])], axis=1)
    w = g.weight([num_classes, 512], fan_in=512)
    logits = g.node("Gemm", [x, w, g.bias(num_classes)], transB=1)
    return g.build([logits], resnet18.__doc__)
