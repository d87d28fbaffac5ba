"""CSRNet (Li et al. 2018) back-end: the dilated convolutions used for crowd counting."""
from __future__ import annotations

import onnx

from .graph_builder import GraphBuilder


def csrnet_backend(batch: int = 1, size: int = 14) -> onnx.ModelProto:
    """CSRNet back-end on the 512x14x14 VGG-16 front-end features (a 112x112 crop):
    six 3x3 dilation-2 convolutions 512, 512, 512, 256, 128, 64 with ReLU, then a 1x1
    convolution to the 1-channel density map."""
    g = GraphBuilder("csrnet", seed=6)
    x = g.input("features", [batch, 512, size, size])
    c_in = 512
    for c_out in [512, 512, 512, 256, 128, 64]:
        x = g.relu(g.conv(x, c_in, c_out, 3, dilation=2))
        c_in = c_out
    density = g.conv(x, 64, 1, 1)
    return g.build([density], csrnet_backend.__doc__)
