"""Memory-bound sub-graphs of the Welder evaluation, built as Relax modules.

Shared by the tests, the benchmark and the examples so that all three run the same graphs.
Every builder returns an un-legalized Relax module with one function `main`.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax import op


def _module(name_shapes, body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in name_shapes]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def matmul_softmax(m: int = 4096, k: int = 64, n: int = 128) -> tvm.IRModule:
    """The paper's §2 example: softmax(A @ B) row-wise."""
    return _module([("a", (m, k)), ("b", (k, n))],
                   lambda bb, a, b: op.nn.softmax(bb.emit(op.matmul(a, b)), axis=-1))


def conv_relu_maxpool(batch: int = 1, channels: int = 16, size: int = 56, filters: int = 32,
                      ) -> tvm.IRModule:
    """Figure 4/5: 3x3 conv (pad 1) -> ReLU -> 2x2 max-pool, NCHW."""

    def body(bb, x, w):
        conv = bb.emit(op.nn.conv2d(x, w, padding=1))
        relu = bb.emit(op.nn.relu(conv))
        return op.nn.max_pool2d(relu, pool_size=2, strides=2)

    return _module([("x", (batch, channels, size, size)), ("w", (filters, channels, 3, 3))], body)


def layernorm_chain(rows: int = 2048, dim: int = 256) -> tvm.IRModule:
    """Residual add -> LayerNorm -> GELU -> scale: a chain of row reductions and elementwise ops."""

    def body(bb, x, r, gamma, beta):
        s = bb.emit(op.add(x, r))
        ln = bb.emit(op.nn.layer_norm(s, gamma, beta, axes=[-1]))
        g = bb.emit(op.nn.gelu(ln))
        return op.multiply(g, gamma)

    return _module([("x", (rows, dim)), ("r", (rows, dim)), ("gamma", (dim,)), ("beta", (dim,))],
                   body)


def _attention(bb, x, wq, wk, wv, wo, heads: int):
    seq, hidden = (int(d) for d in x.ty.shape.values)
    head_dim = hidden // heads

    def split_heads(t):  # [S, H*D] -> [H, S, D]
        return bb.emit(op.permute_dims(bb.emit(op.reshape(t, (seq, heads, head_dim))), [1, 0, 2]))

    q = split_heads(bb.emit(op.matmul(x, wq)))
    k = split_heads(bb.emit(op.matmul(x, wk)))
    v = split_heads(bb.emit(op.matmul(x, wv)))
    kt = bb.emit(op.permute_dims(k, [0, 2, 1]))
    scores = bb.emit(op.multiply(bb.emit(op.matmul(q, kt)),
                                 relax.const(1.0 / math.sqrt(head_dim), "float32")))
    probs = bb.emit(op.nn.softmax(scores, axis=-1))
    ctx = bb.emit(op.matmul(probs, v))
    merged = bb.emit(op.reshape(bb.emit(op.permute_dims(ctx, [1, 0, 2])), (seq, hidden)))
    return bb.emit(op.matmul(merged, wo))


def bert_attention(seq: int = 128, hidden: int = 256, heads: int = 4) -> tvm.IRModule:
    """A BERT self-attention block (batch 1): projections, scaled softmax(QK^T)V, output proj."""
    weights = [(n, (hidden, hidden)) for n in ("wq", "wk", "wv", "wo")]
    return _module([("x", (seq, hidden)), *weights],
                   lambda bb, x, *w: _attention(bb, x, *w, heads=heads))


def bert_encoder(seq: int = 128, hidden: int = 256, heads: int = 4, ffn: int = 1024
                 ) -> tvm.IRModule:
    """A BERT encoder layer: attention, add & LayerNorm, GELU FFN, add & LayerNorm."""

    def body(bb, x, wq, wk, wv, wo, w1, w2, gamma, beta):
        attn = _attention(bb, x, wq, wk, wv, wo, heads)
        h = bb.emit(op.nn.layer_norm(bb.emit(op.add(x, attn)), gamma, beta, axes=[-1]))
        f = bb.emit(op.nn.gelu(bb.emit(op.matmul(h, w1))))
        f = bb.emit(op.matmul(f, w2))
        return op.nn.layer_norm(bb.emit(op.add(h, f)), gamma, beta, axes=[-1])

    weights = [(n, (hidden, hidden)) for n in ("wq", "wk", "wv", "wo")]
    return _module([("x", (seq, hidden)), *weights, ("w1", (hidden, ffn)), ("w2", (ffn, hidden)),
                    ("gamma", (hidden,)), ("beta", (hidden,))], body)


WORKLOADS = {
    "matmul_softmax": matmul_softmax,
    "conv_relu_maxpool": conv_relu_maxpool,
    "layernorm_chain": layernorm_chain,
    "bert_attention": bert_attention,
    "bert_encoder": bert_encoder,
}
