"""FSRCNN (Dong et al. 2016), the x4 super-resolution network of the EinNet evaluation."""
from __future__ import annotations

import onnx

from .graph_builder import GraphBuilder


def fsrcnn(batch: int = 1, size: int = 32) -> onnx.ModelProto:
    """FSRCNN(d=56, s=12, m=4) on a 1x32x32 luminance patch, upscaled x4 to 1x128x128.

    Feature extraction 5x5/56, shrinking 1x1/12, four 3x3/12 mapping layers, expanding
    1x1/56 (each followed by PReLU), then a 9x9 stride-4 ConvTranspose (pad 4, output
    padding 3) as the deconvolution.
    """
    g = GraphBuilder("fsrcnn", seed=2)
    x = g.input("lr", [batch, 1, size, size])
    layers = [(1, 56, 5), (56, 12, 1), (12, 12, 3), (12, 12, 3), (12, 12, 3), (12, 12, 3),
              (12, 56, 1)]
    for c_in, c_out, k in layers:
        x = g.prelu(g.conv(x, c_in, c_out, k), c_out)
    y = g.conv_transpose(x, 56, 1, kernel=9, stride=4, pad=4, output_padding=3)
    return g.build([y], fsrcnn.__doc__)
