"""Transformer layers: BERT encoder layer, ViT-small block and a Longformer layer.

All three share one multi-head self-attention builder; they differ in where the layer norms
sit (post-LN for BERT/Longformer, pre-LN for ViT) and in how scores are formed (dense
softmax(QK^T)V, or Longformer's dilated sliding-window band).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx

from .graph_builder import GraphBuilder


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    seq: int
    dim: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# attend(g, q, k, v, shape) -> context (B, H, S, D); q, k, v are (B, H, S, D).
Attend = Callable[[GraphBuilder, str, str, str, AttentionShape], str]


def dense_attend(g: GraphBuilder, q: str, k: str, v: str, s: AttentionShape) -> str:
    scores = g.node("MatMul", [q, g.transpose(k, [0, 1, 3, 2])])
    probs = g.node("Softmax", [g.scale(scores, 1.0 / np.sqrt(s.head_dim))], axis=-1)
    return g.node("MatMul", [probs, v])


def band_attend(window: int, dilation: int) -> Attend:
    """Longformer's sliding-window attention with dilation, in standard ONNX ops.

    Query i attends to keys i + dilation * (j - window) for j in [0, 2 * window]. The keys and
    values of each window are gathered (Gather on the sequence axis with a constant index
    table), scored with Einsum (the G2BMM of EinNet) and combined with Einsum (its GBMM).
    Window slots that fall outside the sequence are clamped for the gather and masked out.
    """

    def attend(g: GraphBuilder, q: str, k: str, v: str, s: AttentionShape) -> str:
        offsets = dilation * (np.arange(2 * window + 1) - window)
        pos = np.arange(s.seq)[:, None] + offsets[None, :]
        valid = (pos >= 0) & (pos < s.seq)
        idx = g.const(np.clip(pos, 0, s.seq - 1).astype(np.int64), "band_idx")
        bias = g.const(np.where(valid, 0.0, -1e9).astype(np.float32), "band_mask")
        k_win = g.node("Gather", [k, idx], axis=2)  # (B, H, S, W, D)
        v_win = g.node("Gather", [v, idx], axis=2)
        scores = g.node("Einsum", [q, k_win], equation="bhsd,bhswd->bhsw")
        scores = g.node("Add", [g.scale(scores, 1.0 / np.sqrt(s.head_dim)), bias])
        probs = g.node("Softmax", [scores], axis=-1)
        return g.node("Einsum", [probs, v_win], equation="bhsw,bhswd->bhsd")

    return attend


def self_attention(g: GraphBuilder, x: str, s: AttentionShape, attend: Attend) -> str:
    def heads(t: str) -> str:  # (B, S, C) -> (B, H, S, D)
        return g.transpose(g.reshape(t, [s.batch, s.seq, s.heads, s.head_dim]), [0, 2, 1, 3])

    q, k, v = (heads(g.linear(x, s.dim, s.dim)) for _ in range(3))
    ctx = attend(g, q, k, v, s)
    ctx = g.reshape(g.transpose(ctx, [0, 2, 1, 3]), [s.batch, s.seq, s.dim])
    return g.linear(ctx, s.dim, s.dim)


def feed_forward(g: GraphBuilder, x: str, dim: int, hidden: int) -> str:
    return g.linear(g.gelu(g.linear(x, dim, hidden)), hidden, dim)


def _encoder_layer(name: str, seed: int, s: AttentionShape, ffn: int, pre_norm: bool,
                   attend: Attend, doc: str) -> onnx.ModelProto:
    g = GraphBuilder(name, seed=seed)
    x = g.input("hidden", [s.batch, s.seq, s.dim])
    if pre_norm:
        x = g.node("Add", [x, self_attention(g, g.layer_norm(x, s.dim), s, attend)])
        y = g.node("Add", [x, feed_forward(g, g.layer_norm(x, s.dim), s.dim, ffn)])
    else:
        x = g.layer_norm(g.node("Add", [x, self_attention(g, x, s, attend)]), s.dim)
        y = g.layer_norm(g.node("Add", [x, feed_forward(g, x, s.dim, ffn)]), s.dim)
    return g.build([y], doc)


def bert_layer(batch: int = 1, seq: int = 128) -> onnx.ModelProto:
    """BERT-base encoder layer: sequence 128, hidden 768, 12 heads, FFN 3072 with GELU,
    post-layer-norm residuals (no attention mask)."""
    return _encoder_layer("bert_layer", 7, AttentionShape(batch, seq, 768, 12), 3072,
                          pre_norm=False, attend=dense_attend, doc=bert_layer.__doc__)


def vit_block(batch: int = 1, seq: int = 197) -> onnx.ModelProto:
    """ViT-small (ViT-S/16 at 224x224) block: 197 tokens, dim 384, 6 heads, MLP 1536 with
    GELU, pre-layer-norm residuals."""
    return _encoder_layer("vit_block", 8, AttentionShape(batch, seq, 384, 6), 1536,
                          pre_norm=True, attend=dense_attend, doc=vit_block.__doc__)


def longformer_layer(batch: int = 1, seq: int = 512, window: int = 32,
                     dilation: int = 2) -> onnx.ModelProto:
    """Longformer-base layer with dilated sliding-window attention: hidden 768, 12 heads,
    FFN 3072, post-layer-norm.

    Shrunk for a 2-core CPU: sequence 512 (Longformer uses 4096) and a one-sided window of
    32 keys with dilation 2 (65 keys spanning +-64 tokens; Longformer uses 256 one-sided).
    The gathered key/value windows are (B, 12, 512, 65, 64) fp32, about 100 MB each at
    batch 1. No global-attention tokens.
    """
    return _encoder_layer("longformer_layer", 3, AttentionShape(batch, seq, 768, 12), 3072,
                          pre_norm=False, attend=band_attend(window, dilation),
                          doc=longformer_layer.__doc__)
