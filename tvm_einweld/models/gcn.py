"""GCN: Global Convolutional Network (Peng et al. 2017) for semantic segmentation.

The paper's large-kernel block approximates a k x k convolution by two separable branches,
(k x 1 then 1 x k) + (1 x k then k x 1): the structure EinNet merges into batched matmuls.
"""
from __future__ import annotations

import onnx

from .graph_builder import GraphBuilder

NUM_CLASSES = 21  # PASCAL VOC


def _gcn_block(g: GraphBuilder, x: str, c_in: int, k: int) -> str:
    c = NUM_CLASSES
    left = g.conv(g.conv(x, c_in, c, (k, 1)), c, c, (1, k))
    right = g.conv(g.conv(x, c_in, c, (1, k)), c, c, (k, 1))
    return g.node("Add", [left, right])


def _boundary_refine(g: GraphBuilder, x: str) -> str:
    c = NUM_CLASSES
    y = g.conv(g.relu(g.conv(x, c, c, 3)), c, c, 3)
    return g.node("Add", [x, g.scale(y, 0.5)])


def _upsample(g: GraphBuilder, x: str) -> str:
    return g.conv_transpose(x, NUM_CLASSES, NUM_CLASSES, kernel=4, stride=2, pad=1)


def gcn(batch: int = 1, size: int = 224) -> onnx.ModelProto:
    """GCN on a 3x224x224 image, 21 classes.

    Backbone (kept small for a 2-core CPU, standing in for the paper's ResNet): 7x7/2 stem to
    64 channels and 3x3 max-pool (56x56), then strided 3x3 convolutions to 128@28, 256@14 and
    512@7. Each of the four feature maps goes through a GCN block (k x 1 / 1 x k separable
    branches, k = 15, or the map size when it is smaller) and a boundary-refinement block; the
    decoder adds each score map to the 2x-upsampled (4x4 stride-2 ConvTranspose) coarser one,
    refines, and upsamples twice more to 21x224x224.
    """
    g = GraphBuilder("gcn", seed=4)
    x = g.input("image", [batch, 3, size, size])
    x = g.relu(g.conv(x, 3, 64, 7, stride=2))
    x = g.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    feats, c_in, hw = [(x, 64, size // 4)], 64, size // 4
    for c_out in [128, 256, 512]:
        x = g.relu(g.conv(x, c_in, c_out, 3, stride=2))
        c_in, hw = c_out, hw // 2
        feats.append((x, c_in, hw))
    score = None
    for f, c, hw in reversed(feats):
        k = min(15, hw if hw % 2 else hw + 1)
        s = _boundary_refine(g, _gcn_block(g, f, c, k))
        score = s if score is None else _boundary_refine(g, g.node("Add", [s, _upsample(g, score)]))
    out = _boundary_refine(g, _upsample(g, _boundary_refine(g, _upsample(g, score))))
    return g.build([out], gcn.__doc__)
