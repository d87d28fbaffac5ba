"""A NAFNet block (Chen et al. 2022): the activation-free image-restoration block."""
from __future__ import annotations

import numpy as np
import onnx

from .graph_builder import GraphBuilder


def _layer_norm_2d(g: GraphBuilder, x: str, c: int) -> str:
    """Layer norm over the channel axis at every pixel, as NAFNet's LayerNorm2d exports."""
    mean = g.node("ReduceMean", [x], axes=[1], keepdims=1)
    d = g.node("Sub", [x, mean])
    var = g.node("ReduceMean", [g.node("Mul", [d, d])], axes=[1], keepdims=1)
    eps = g.const(np.array(1e-6, np.float32))
    y = g.node("Div", [d, g.node("Sqrt", [g.node("Add", [var, eps])])])
    gamma, beta = g.param([c, 1, 1], mean=1.0), g.param([c, 1, 1])
    return g.node("Add", [g.node("Mul", [y, gamma]), beta])


def _simple_gate(g: GraphBuilder, x: str, c: int) -> str:
    a, b = g.node("Split", [x, g.const(np.array([c, c], np.int64))], n_out=2, axis=1)
    return g.node("Mul", [a, b])


def nafnet_block(batch: int = 1, width: int = 32, size: int = 128) -> onnx.ModelProto:
    """NAFNet block at width 32 on a 128x128 feature map.

    LayerNorm2d -> 1x1 conv (2c) -> depthwise 3x3 -> SimpleGate -> simplified channel
    attention (global average pool, 1x1 conv, multiply) -> 1x1 conv -> residual scaled by
    beta; then LayerNorm2d -> 1x1 conv (2c) -> SimpleGate -> 1x1 conv -> residual scaled
    by gamma.
    """
    c = width
    g = GraphBuilder("nafnet_block", seed=10)
    inp = g.input("features", [batch, c, size, size])
    x = g.conv(_layer_norm_2d(g, inp, c), c, 2 * c, 1)
    x = _simple_gate(g, g.conv(x, 2 * c, 2 * c, 3, group=2 * c), c)
    x = g.node("Mul", [x, g.conv(g.node("GlobalAveragePool", [x]), c, c, 1)])
    x = g.conv(x, c, c, 1)
    beta = g.const(np.full((c, 1, 1), 0.5, np.float32))
    y = g.node("Add", [inp, g.node("Mul", [x, beta])])
    x = _simple_gate(g, g.conv(_layer_norm_2d(g, y, c), c, 2 * c, 1), c)
    x = g.conv(x, c, c, 1)
    gamma = g.const(np.full((c, 1, 1), 0.5, np.float32))
    out = g.node("Add", [y, g.node("Mul", [x, gamma])])
    return g.build([out], nafnet_block.__doc__)
