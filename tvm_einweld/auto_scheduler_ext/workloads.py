"""Conv blocks (pad + conv2d + bias + ReLU), the paper's tuning tasks, as TIR and numpy.

The weight and bias are marked layout-free (``layout_free_buffers``), as Relax's
``AttachAttrLayoutFreeBuffers`` marks constant weights, so RewriteLayout may rewrite them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import te, topi


@dataclass(frozen=True)
class Conv2dBlock:
    """NCHW input (n, c, h, w), f filters of k x k, stride s, padding p."""

    n: int
    c: int
    h: int
    w: int
    f: int
    k: int
    s: int
    p: int

    @staticmethod
    def parse(spec: str) -> "Conv2dBlock":
        """Parse 'N,C,H,W,F,K,S,P' (eight positive integers; P may be 0)."""
        parts = [x.strip() for x in spec.split(",")]
        if len(parts) != 8 or not all(x.isdigit() for x in parts):
            raise ValueError(f"conv2d spec {spec!r} must be eight integers N,C,H,W,F,K,S,P")
        block = Conv2dBlock(*(int(x) for x in parts))
        if min(block.n, block.c, block.h, block.w, block.f, block.k, block.s) <= 0:
            raise ValueError(f"conv2d spec {spec!r}: N,C,H,W,F,K,S must be positive")
        if block.h + 2 * block.p < block.k or block.w + 2 * block.p < block.k:
            raise ValueError(f"conv2d spec {spec!r}: kernel larger than the padded input")
        return block

    @property
    def name(self) -> str:
        return f"conv2d_{self.n}x{self.c}x{self.h}x{self.w}_f{self.f}k{self.k}s{self.s}p{self.p}"

    @property
    def out_hw(self) -> tuple:
        return ((self.h + 2 * self.p - self.k) // self.s + 1, (self.w + 2 * self.p - self.k) // self.s + 1)

    @property
    def flops(self) -> int:
        oh, ow = self.out_hw
        return 2 * self.n * self.f * oh * ow * self.c * self.k * self.k

    def shapes(self) -> dict:
        return {
            "data": (self.n, self.c, self.h, self.w),
            "weight": (self.f, self.c, self.k, self.k),
            "bias": (1, self.f, 1, 1),
            "out": (self.n, self.f) + self.out_hw,
        }

    def prim_func(self) -> tvm.tirx.PrimFunc:
        sh = self.shapes()
        data = te.placeholder(sh["data"], name="data")
        weight = te.placeholder(sh["weight"], name="weight")
        bias = te.placeholder(sh["bias"], name="bias")
        pad = [0, 0, self.p, self.p]
        padded = topi.nn.pad(data, pad, pad, name="pad")
        conv = topi.nn.conv2d_nchw(padded, weight, self.s, 0, 1)
        out = topi.nn.relu(topi.add(conv, bias))
        func = te.create_prim_func([data, weight, bias, out])
        return func.with_attr("layout_free_buffers", [1, 2])

    def module(self) -> tvm.IRModule:
        return tvm.IRModule({"main": self.prim_func()})

    def random_inputs(self, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        sh = self.shapes()
        return {k: rng.standard_normal(sh[k]).astype("float32") for k in ("data", "weight", "bias")}

    def reference(self, data: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """numpy reference: im2col + matmul."""
        x = np.pad(data, ((0, 0), (0, 0), (self.p, self.p), (self.p, self.p)))
        oh, ow = self.out_hw
        cols = np.empty((self.n, self.c, self.k, self.k, oh, ow), dtype=np.float32)
        for i in range(self.k):
            for j in range(self.k):
                cols[:, :, i, j] = x[:, :, i : i + self.s * oh : self.s, j : j + self.s * ow : self.s]
        out = np.einsum("ncijhw,fcij->nfhw", cols, weight, optimize=True) + bias
        return np.maximum(out, 0)


# ResNet-50 (batch 1, 224x224) conv layers with distinct shapes, as in the paper's Table 2.
RESNET50_BLOCKS = (
    Conv2dBlock(1, 64, 56, 56, 64, 3, 1, 1),
    Conv2dBlock(1, 128, 28, 28, 128, 3, 1, 1),
    Conv2dBlock(1, 256, 14, 14, 256, 3, 1, 1),
    Conv2dBlock(1, 512, 7, 7, 512, 3, 1, 1),
    Conv2dBlock(1, 64, 56, 56, 256, 1, 1, 0),
    Conv2dBlock(1, 256, 56, 56, 128, 1, 2, 0),
)
