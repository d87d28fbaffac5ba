"""GAN generators from the EinNet evaluation: stacks of ConvTranspose layers.

Batch normalisation is folded into the transposed convolutions' biases, as an inference
export would do, so the graphs are ConvTranspose + ReLU with a final Tanh.
"""
from __future__ import annotations

from typing import Sequence

import onnx

from .graph_builder import GraphBuilder


def _generator(name: str, batch: int, latent: int, first_kernel: int,
               channels: Sequence[int], doc: str) -> onnx.ModelProto:
    """latent (1x1) -> ConvT(first_kernel, s1) -> ConvT(4, s2, p1) ... -> Tanh."""
    g = GraphBuilder(name, seed=1)
    x = g.input("z", [batch, latent, 1, 1])
    c_in = latent
    for i, c_out in enumerate(channels):
        if i == 0:
            x = g.conv_transpose(x, c_in, c_out, kernel=first_kernel, stride=1, pad=0)
        else:
            x = g.conv_transpose(x, c_in, c_out, kernel=4, stride=2, pad=1)
        x = g.node("Tanh", [x]) if i == len(channels) - 1 else g.relu(x)
        c_in = c_out
    return g.build([x], doc)


def infogan(batch: int = 1) -> onnx.ModelProto:
    """InfoGAN generator: z (228x1x1) -> 448x2x2 -> 256x4x4 -> 128x8x8 -> 64x16x16 -> 3x32x32.

    The first layer is a 2x2 stride-1 ConvTranspose, the other four 4x4 stride 2 pad 1.
    """
    return _generator("infogan", batch, 228, 2, [448, 256, 128, 64, 3], infogan.__doc__)


def dcgan(batch: int = 1) -> onnx.ModelProto:
    """DCGAN generator: z (100x1x1) -> 512x4x4 -> 256x8x8 -> 128x16x16 -> 64x32x32 -> 3x64x64.

    The first layer is a 4x4 stride-1 ConvTranspose, the other four 4x4 stride 2 pad 1.
    """
    return _generator("dcgan", batch, 100, 4, [512, 256, 128, 64, 3], dcgan.__doc__)
