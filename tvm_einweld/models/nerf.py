"""The NeRF MLP (Mildenhall et al. 2020): the per-sample network of neural radiance fields."""
from __future__ import annotations

import onnx

from .graph_builder import GraphBuilder

POINTS_PER_BATCH = 4096  # one "batch" = 64 rays x 64 samples


def nerf_mlp(batch: int = 1) -> onnx.ModelProto:
    """NeRF MLP on batch x 4096 sample points (64 rays x 64 samples each).

    Inputs are the positionally encoded position (63 = 3 + 3*2*10) and view direction
    (27 = 3 + 3*2*4). Eight 256-wide ReLU layers with the position re-injected (concat)
    before the fifth; density from a linear head; colour from a 256-wide feature layer
    concatenated with the direction, a 128-wide ReLU layer and a sigmoid. Output is
    (points, 4) = [rgb, sigma].
    """
    n = batch * POINTS_PER_BATCH
    g = GraphBuilder("nerf_mlp", seed=11)
    pos = g.input("position", [n, 63])
    dirs = g.input("direction", [n, 27])
    x, width = pos, 63
    for layer in range(8):
        if layer == 4:
            x, width = g.node("Concat", [x, pos], axis=-1), 256 + 63
        x, width = g.relu(g.linear(x, width, 256)), 256
    sigma = g.linear(x, 256, 1)
    feat = g.node("Concat", [g.linear(x, 256, 256), dirs], axis=-1)
    rgb = g.node("Sigmoid", [g.linear(g.relu(g.linear(feat, 256 + 27, 128)), 128, 3)])
    return g.build([g.node("Concat", [rgb, sigma], axis=-1)], nerf_mlp.__doc__)
