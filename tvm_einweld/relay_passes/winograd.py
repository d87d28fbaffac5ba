"""Winograd minimal filtering: a stride-1 convolution as input transform + batched matmul +
output transform (Lavin & Gray 2016), a candidate of `DerivationTransform`.

What it rewrites
----------------
`relax.op.nn.conv2d(x, w)`, NCHW data, OIHW weights, an r x r kernel (r in `ALGORITHMS`),
stride 1, groups 1, static shapes, any dilation d whose padded input divides into d x d equal
phases (CSRNet's 3x3 dilation-2 convolutions on 14x14 maps). F(m, r) computes each m x m tile
of outputs from an a x a tile of inputs (a = m + r - 1) with a^2 multiplications per (input channel,
output channel) pair instead of m^2 r^2: 2.25x fewer for F(2, 3), 4x for F(4, 3). In tensor
form, with T = N * ceil(OH / m) * ceil(OW / m) tiles:

    V[c, (i, j), t] = (B^T d_{c,t} B)[i, j]           input transform (memory-bound)
    U[(i, j), f, c] = (G w_{f,c} G^T)[i, j]           weight transform (constant: folded)
    M[(i, j), f, t] = sum_c U[(i, j), f, c] V[c, (i, j), t]   a^2 matmuls (the FLOPs)
    y_{f,t}         = A^T M[., f, t] A                 output transform (memory-bound)

where d_{c,t} is tile t's a x a input window of channel c (the input zero-padded by the
convolution's own padding and, at the bottom and right, by what whole tiles need) and y_{f,t}
its m x m outputs, written into [N, F, OH, OW] (those past the edge skipped). The batched
matmul is a predefined operator (the analytic GEMM kernel, its constant U packed at compile
time); the two transforms are eOperators written here as scheduled TIR (`input_transform`,
`output_transform`): parallel over (n, channel), tile columns in vector lanes, the a x a
window's two linear stages unrolled with the matrices' constants folded into adds and
scalings. V is stored channel-major, [c, (i, j), t]: one tile vector's a^2 values then land
a row of T apart, in distinct L1 sets. As [(i, j), c, t] they were C * T * 4 bytes apart, a
multiple of 4 KiB when C = 512 (CSRNet), all in one set, each line written a vector at a
time and evicted between: that transform took 318 us, 183 us channel-major (65 -> 11 us on
one phase); the batched matmul (an einsum) reads V in place where its rows (a^2 * T
elements apart) do not thrash L1 and packs it where they would (4 KiB apart, CSRNet's F(2, 3)
on 512 channels: 3.6 -> 1.9 ms, `gemm._panel_thrashes`).
`plans` offers one algorithm per convolution, by a roofline bound that charges the
matmul's panels and U's bytes (F(4, 3) on 56x56 maps, F(2, 3) where F(4, 3)'s few tiles
would leave the matmul's panels empty); the derivation pass times it against the direct
convolution and keeps it only when faster.

Why it is correct
-----------------
In one dimension the algorithm states y[k] = sum_q d[k + q] g[q] (k < m, the correlation a
conv2d computes) = (A^T [(G g) * (B^T d)])[k]. Both sides are bilinear in (d, g), so the
identity holds for all d, g iff it holds for every pair of basis vectors (d = e_p, g = e_q):
`exact_identity` checks those a * r cases in exact rational arithmetic (the proof attached to
the candidate). The 2-D algorithm is the 1-D one applied along rows and then columns (a
tensor product of two instances), so the 1-D identity proves it. The tiling is exact: tile t
= (n, p, q) covers outputs (m p + k, m q + l), whose windows read padded rows m p .. m p + a - 1
and columns likewise; padding the input to m * ceil(OH / m) + r - 1 rows (zeros past the
convolution's own padding) gives every tile its window, and outputs past OH / OW are cropped.
A dilation d > 1: output (d y + p, d x + q) reads padded inputs (d (y + i) + p, d (x + j) + q)
for taps (i, j), so it is output (y, x) of the undilated convolution of phase (p, q),
xp[:, :, p::d, q::d]; the phases are stacked along the batch (space-to-batch: reshape and
transpose of the padded input), convolved as above without padding, and the outputs put back
in their places (batch-to-space), exact data movement on both sides.
Floating-point rounding differs from the direct sum (the transforms scale and subtract
inputs: F(4, 3)'s error is some 10x F(2, 3)'s); the derivation pass checks each rewritten
subprogram against the original on random inputs and keeps the original if they disagree,
and times it against the original (a rewrite that is not faster is not used).
"""
from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tvm
from tvm import relax

from ..cost_model import Peaks
from ..expr.from_relax import UnsupportedOperator, static_shape
from ..verify.smt import ProofResult

F = Fraction


@dataclass(frozen=True)
class Algorithm:
    """F(m, r): `m` outputs from `m + r - 1` inputs for an r-tap filter, as its three
    matrices (rows of B^T, G and A^T), exact."""

    m: int
    r: int
    bt: Tuple[Tuple[Fraction, ...], ...]
    g: Tuple[Tuple[Fraction, ...], ...]
    at: Tuple[Tuple[Fraction, ...], ...]

    @property
    def alpha(self) -> int:
        return self.m + self.r - 1

    @property
    def name(self) -> str:
        return f"F({self.m}, {self.r})"


def _rows(*rows) -> Tuple[Tuple[Fraction, ...], ...]:
    return tuple(tuple(F(v) for v in row) for row in rows)


# Lavin & Gray's matrices (interpolation points 0, +-1 and 0, +-1, +-2, infinity).
ALGORITHMS = (
    Algorithm(2, 3,
              bt=_rows((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
              g=_rows((1, 0, 0), (F(1, 2), F(1, 2), F(1, 2)), (F(1, 2), F(-1, 2), F(1, 2)),
                      (0, 0, 1)),
              at=_rows((1, 1, 1, 0), (0, 1, -1, -1))),
    Algorithm(4, 3,
              bt=_rows((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0),
                       (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1)),
              g=_rows((F(1, 4), 0, 0), (F(-1, 6), F(-1, 6), F(-1, 6)),
                      (F(-1, 6), F(1, 6), F(-1, 6)), (F(1, 24), F(1, 12), F(1, 6)),
                      (F(1, 24), F(-1, 12), F(1, 6)), (0, 0, 1)),
              at=_rows((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0),
                       (0, 1, -1, 8, -8, 1))),
)


def exact_identity(alg: Algorithm) -> bool:
    """Whether A^T [(G g) * (B^T d)] equals the correlation y[k] = sum_q d[k + q] g[q] for
    every basis pair (d = e_p, g = e_q), in exact arithmetic: by bilinearity, for all d, g."""
    for p in range(alg.alpha):
        for q in range(alg.r):
            gg = [row[q] for row in alg.g]  # G e_q
            bd = [row[p] for row in alg.bt]  # B^T e_p
            for k in range(alg.m):
                got = sum(alg.at[k][i] * gg[i] * bd[i] for i in range(alg.alpha))
                if got != (1 if p == k + q else 0):
                    return False
    return True


@dataclass(frozen=True)
class WinogradConv:
    """A conv2d the rewrite applies to: shapes, padding (top, left, bottom, right), dilation,
    output size, the algorithm and the tile counts. A dilated convolution is computed as its
    `phases`: an undilated one on the space-to-batch rearranged input."""

    data: Tuple[int, ...]
    weight: Tuple[int, ...]
    padding: Tuple[int, int, int, int]
    out_dtype: str
    alg: Algorithm
    lanes: int = 1  # the transforms' vector width (1: scalar code)
    dilation: int = 1

    @property
    def out_hw(self) -> Tuple[int, int]:
        (_, _, h, w), edge = self.data, self.dilation * (self.alg.r - 1)
        top, left, bottom, right = self.padding
        return h + top + bottom - edge, w + left + right - edge

    @property
    def phases(self) -> "WinogradConv":
        """The undilated convolution of the d x d phases (d the dilation), batched phase-major:
        phase (p, q) of the padded input is xp[:, :, p::d, q::d] and output (d y + p, d x + q)
        is output (y, x) of phase (p, q)'s undilated convolution (module docstring)."""
        d, (n, c, h, w), (top, left, bottom, right) = self.dilation, self.data, self.padding
        if d == 1:
            return self
        return replace(self, data=(d * d * n, c, (h + top + bottom) // d,
                                   (w + left + right) // d), padding=(0, 0, 0, 0), dilation=1)

    @property
    def tiles(self) -> Tuple[int, int]:
        oh, ow = self.phases.out_hw
        return math.ceil(oh / self.alg.m), math.ceil(ow / self.alg.m)

    @property
    def stored_columns(self) -> int:
        """Tile columns V and M hold per tile row: the tiles', or where a row has fewer tiles
        than the vector lanes and the next power of two adds at most a quarter, that power
        of two, so that the input transform computes a row in one whole vector (its extra
        tiles read zero padding; the matmul computes their columns, the output transform
        never reads them). ResNet-18's 14 tiles a row (64 channels at 56x56) took two
        overlapping 8-lane vectors, its 7 tiles (28x28, and 14x14 in F(2, 3)) two 4-lane
        ones; the matmul pads those 196 and 49 columns to 224 and 64 anyway."""
        tw = self.tiles[1]
        whole = 1 << (tw - 1).bit_length()
        if self.lanes <= 1 or tw >= self.lanes or 4 * (whole - tw) > tw:
            return tw
        return whole

    @property
    def multiplies(self) -> int:
        """Multiply-adds of the batched matmul (the direct conv: N F C OH OW r^2)."""
        th = self.tiles[0]
        return self.alg.alpha ** 2 * self.phases.data[0] * th * self.stored_columns * \
            self.data[1] * self.weight[0]


def match(call: relax.Call, alg: Algorithm) -> Optional[WinogradConv]:
    """The rewrite's plan of `call` with `alg`, or None if it does not apply (see the module
    docstring: what it rewrites)."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name != "relax.nn.conv2d":
        return None
    a = call.attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCHW", "OIHW",
                                                                          "NCHW"):
        return None
    dilation = {int(d) for d in a.dilation}
    if int(a.groups) != 1 or any(int(s) != 1 for s in a.strides) or len(dilation) != 1:
        return None
    try:
        data, weight = static_shape(call.args[0]), static_shape(call.args[1])
    except UnsupportedOperator:
        return None
    if len(data) != 4 or len(weight) != 4 or tuple(weight[2:]) != (alg.r, alg.r):
        return None
    if str(call.args[0].ty.dtype) not in ("float32", "float64"):
        return None  # integer data: the transforms' fractions do not apply
    conv = WinogradConv(tuple(data), tuple(weight), tuple(int(p) for p in a.padding),
                        str(call.ty.dtype), alg, dilation=dilation.pop())
    d, (top, left, bottom, right) = conv.dilation, conv.padding
    if (data[2] + top + bottom) % d or (data[3] + left + right) % d:
        return None  # the phases would differ in size
    oh, ow = conv.phases.out_hw
    if oh < alg.m or ow < alg.m:
        return None  # not even one whole tile: nothing to save
    return conv


def _lin(terms, dtype: str) -> str:
    """TVMScript of sum c * name over (c, name) terms, zero coefficients skipped."""
    out = ""
    for c, name in terms:
        if c == 0:
            continue
        mag = name if abs(c) == 1 else f"T.{dtype}({float(abs(c))!r}) * {name}"
        out += (" - " if c < 0 else " + ") + mag if out else (f"(-{mag})" if c < 0 else mag)
    return out or f"T.{dtype}(0)"


def _staged(first, second, source, shape: Tuple[int, int], dtype: str, store,
            guard=None) -> List[str]:
    """Lines of two unrolled linear stages of a tile, each in its own vectorised lane loop:
    stage[i, j] = sum_k first[i][k] source(k, j), then store(i, j) = sum_k second[j][k]
    stage[i, k] (rows, then columns; `source` gives an element's TVMScript, `shape` the
    source tile's), each store under the condition `guard(i, j)` when given."""
    lines = ["for lane in T.vectorized(LANES):"]
    for i in range(len(first)):
        for j in range(shape[1]):
            terms = [(first[i][k], source(k, j)) for k in range(shape[0])]
            lines.append(f"    stage[{i}, {j}, lane] = {_lin(terms, dtype)}")
    lines.append("for lane in T.vectorized(LANES):")
    for i in range(len(first)):
        for j in range(len(second)):
            terms = [(second[j][k], f"stage[{i}, {k}, lane]") for k in range(shape[1])]
            line = f"{store(i, j)} = {_lin(terms, dtype)}"
            lines += [f"    if {guard(i, j)}:", f"        {line}"] if guard else [f"    {line}"]
    return lines


def _kernel(buffers: Sequence[Tuple[str, str]], dtype: str, lanes: int, outer: str,
            rows: str, cols: str, staging: Tuple[int, int], lines: Sequence[str]
            ) -> tvm.tirx.PrimFunc:
    """A scheduled PrimFunc over symbolic shapes (`buffers`: name and shape, the first read,
    the last written; each dimension its own variable, so `PrimFunc.specialize` binds them)
    running `lines` once per vector of tiles (n, ty, tx): `outer` = (n, channel) fused and
    parallel, `rows` tile rows `ty`, `cols` tile columns `tx` in vectors of `lanes` (a tile's
    window column is read as a strided vector; `cols` >= `lanes`); the last vector ends at the
    last column, overlapping the one before where `lanes` does not divide `cols` (those tiles
    are computed twice, by the same thread, to the same values). `lines` refer to the tile
    column as `tx`, the vector width as LANES and to a local staging buffer `stage` of
    `staging` values per lane.

    Values pass between the two linear stages through that buffer, not let bindings: a
    let-bound value inside a vectorised loop is computed for one lane only in TVM 0.27
    (measured: every lane got the last lane's value). Parsing TVMScript takes about a second
    for such a kernel, so it is parsed once per algorithm and specialised per shape."""
    names = sorted({d for _, shape in buffers for d in re.findall(r"[a-z]\w*", shape)})
    (read, read_shape), (write, write_shape) = buffers

    def region(name: str, shape: str) -> str:
        return f"{name}[{', '.join(f'0:{d.strip()}' for d in shape.split(','))}]"

    tx = f"(T.min(txo * {lanes}, {cols} - {lanes}) + lane)"
    body = [re.sub(r"\btx\b", tx, line).replace("LANES", str(lanes)) for line in lines]
    nest = [f"for txo in T.serial(({cols} + {lanes - 1}) // {lanes}):",
            '    with T.sblock("tile"):', f"        T.reads({region(read, read_shape)})",
            f"        T.writes({region(write, write_shape)})",
            f'        stage = T.alloc_buffer(({staging[0]}, {staging[1]}, {lanes}), '
            f'"{dtype}", scope="local")'] + ["        " + b for b in body]
    source = "\n".join([
        "@T.prim_func(s_tir=True)",
        f"def main({', '.join(f'{name}_h: T.handle' for name, _ in buffers)}):",
        *[f"    {d} = T.int32()" for d in names],
        *[f'    {name} = T.match_buffer({name}_h, ({shape}), "{dtype}")'
          for name, shape in buffers],
        '    T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})',
        '    with T.sblock("root"):',
        f"        for nc in T.parallel({outer}):",
        f"            for ty in T.serial({rows}):",
        *[" " * 16 + line for line in nest], ""])
    return tvm.script.from_source(source).without_attr("global_symbol")


def _specialised(func: tvm.tirx.PrimFunc, dtype: str, *shapes: Tuple[int, ...]
                 ) -> tvm.tirx.PrimFunc:
    """`func` (from `_kernel`) with its buffers' shapes bound to `shapes`."""
    return func.specialize({param: tvm.tirx.decl_buffer(shape, dtype, f"p{k}")
                            for k, (param, shape) in enumerate(zip(func.params, shapes))})


def padded_input_shape(conv: "WinogradConv") -> Tuple[int, int, int, int]:
    """The zero-padded input the input transform reads: every tile's window inside."""
    (n, c, _, _), th, edge = conv.data, conv.tiles[0], conv.alg.r - 1
    return n, c, th * conv.alg.m + edge, conv.stored_columns * conv.alg.m + edge


def _width(conv: "WinogradConv", columns: int) -> int:
    """A transform's vector width over `columns` tile columns: the target's lanes, or the
    largest power of two not above the columns when there are fewer (a vector never reaches
    past the last column)."""
    return min(conv.lanes, 1 << (columns.bit_length() - 1))


@functools.lru_cache(maxsize=None)
def _input_kernel(alg: Algorithm, dtype: str, lanes: int) -> tvm.tirx.PrimFunc:
    m, a = alg.m, alg.alpha
    th, tw = f"((hp - {a - m}) // {m})", f"((wp - {a - m}) // {m})"
    lines = _staged(
        alg.bt, alg.bt, lambda p, q: f"x[nc // c, nc % c, ty * {m} + {p}, tx * {m} + {q}]",
        (a, a), dtype,
        lambda i, j: f"v[nc % c, {i * a + j}, nc // c * {th} * {tw} + ty * {tw} + tx]")
    return _kernel([("x", "n, c, hp, wp"), ("v", "c, k2, t")], dtype, lanes, "n * c", th, tw,
                   (a, a), lines)


def input_transform(conv: "WinogradConv") -> tvm.tirx.PrimFunc:
    """V[c, (i, j), t] = (B^T d_{c,t} B)[i, j] for every tile t = (n, ty, tx) of the padded
    input (`padded_input_shape`): the a x a window's rows (B^T d), then its columns, unrolled,
    the constant coefficients folded into adds and scalings."""
    a, (n, c, _, _), th, tw = conv.alg.alpha, conv.data, conv.tiles[0], conv.stored_columns
    return _specialised(_input_kernel(conv.alg, conv.out_dtype, _width(conv, tw)),
                        conv.out_dtype, padded_input_shape(conv), (c, a * a, n * th * tw))


@functools.lru_cache(maxsize=None)
def _output_kernel(alg: Algorithm, dtype: str, lanes: int, guarded: bool
                   ) -> tvm.tirx.PrimFunc:
    m, a = alg.m, alg.alpha
    th, tw = f"((oh + {m - 1}) // {m})", f"((ow + {m - 1}) // {m})"
    tile = f"nc // f * (t // n) + ty * (t // (n * {th})) + tx"  # t // (n th): stored columns
    lines = _staged(
        alg.at, alg.at, lambda i, j: f"mm[{i * a + j}, nc % f, {tile}]",
        (a, a), dtype, lambda k, l: f"y[nc // f, nc % f, ty * {m} + {k}, tx * {m} + {l}]",
        # Tiles past the output's edge: each store only where its output exists (the
        # vectorised loop is then split by lane; such maps are rare and small).
        (lambda k, l: f"ty * {m} + {k} < oh and tx * {m} + {l} < ow") if guarded else None)
    return _kernel([("mm", "k2, f, t"), ("y", "n, f, oh, ow")], dtype, lanes, "n * f", th, tw,
                   (m, a), lines)


def output_transform(conv: "WinogradConv") -> tvm.tirx.PrimFunc:
    """y[n, f, ty m + k, tx m + l] = (A^T M_{f,t} A)[k, l] for every tile t = (n, ty, tx),
    outputs past the convolution's size skipped: rows, then columns, unrolled."""
    alg, (n, _, _, _), f = conv.alg, conv.data, conv.weight[0]
    (th, tw), (oh, ow) = conv.tiles, conv.out_hw
    guarded = bool(oh % alg.m or ow % alg.m)
    return _specialised(_output_kernel(alg, conv.out_dtype, _width(conv, tw), guarded),
                        conv.out_dtype, (alg.alpha ** 2, f, n * th * conv.stored_columns),
                        (n, f, oh, ow))


def _constant(rows, dtype: str) -> relax.Constant:
    return relax.const(np.array([[float(v) for v in row] for row in rows], dtype), dtype)


def emit(bb: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, conv: WinogradConv
         ) -> relax.Expr:
    """The Winograd program of `conv` on data `x` and weights `w`, emitted into `bb`: the
    input transform and output transform as kernels of their own (`input_transform`,
    `output_transform`), the weight transform and the batched matmul as Relax operators; a
    dilated convolution through its phases (space-to-batch before, batch-to-space after)."""
    if conv.dilation > 1:
        d, (n, c, h, wd), f = conv.dilation, conv.data, conv.weight[0]
        top, left, bottom, right = conv.padding
        hp, wp = h + top + bottom, wd + left + right
        xp = bb.emit(relax.op.nn.pad(x, [0, 0, 0, 0, top, bottom, left, right]))
        xp = bb.emit(relax.op.reshape(xp, (n, c, hp // d, d, wp // d, d)))
        xp = bb.emit(relax.op.permute_dims(xp, [3, 5, 0, 1, 2, 4]))
        xp = bb.emit(relax.op.reshape(xp, conv.phases.data))
        y = emit(bb, xp, w, conv.phases)  # [d d n, f, oh / d, ow / d], phase-major
        oh, ow = conv.out_hw
        y = bb.emit(relax.op.reshape(y, (d, d, n, f, oh // d, ow // d)))
        y = bb.emit(relax.op.permute_dims(y, [2, 3, 4, 0, 5, 1]))
        return bb.emit(relax.op.reshape(y, (n, f, oh, ow)))
    alg, dtype = conv.alg, conv.out_dtype
    a, f, c = alg.alpha, conv.weight[0], conv.data[1]
    tiles = conv.data[0] * conv.tiles[0] * conv.stored_columns
    tag = f"winograd_f{alg.m}_{alg.r}"
    # Zero padding: the convolution's own in front, to whole tiles' windows behind.
    (_, _, h, wd), (top, left) = conv.data, conv.padding[:2]
    _, _, hp, wp = padded_input_shape(conv)
    xp = bb.emit(relax.op.nn.pad(x, [0, 0, 0, 0, top, hp - h - top, left, wp - wd - left]))
    v = bb.emit(relax.call_tir(bb.add_func(input_transform(conv), f"{tag}_input"), [xp],
                               relax.TensorType((c, a * a, tiles), dtype)))
    # U_ij = (G w G^T)_ij: constant weights make it a folded constant.
    g = _constant(alg.g, dtype)
    u = bb.emit(relax.op.matmul(g, w))  # [F, C, a, r]
    u = bb.emit(relax.op.matmul(u, relax.op.permute_dims(g, [1, 0])))  # [F, C, a, a]
    u = bb.emit(relax.op.permute_dims(u, [2, 3, 0, 1]))
    u = bb.emit(relax.op.reshape(u, (a * a, f, c)))
    mm = bb.emit(relax.op.einsum((u, v), "kfc,ckt->kft"))  # [a^2, F, tiles]
    oh, ow = conv.out_hw
    return bb.emit(relax.call_tir(bb.add_func(output_transform(conv), f"{tag}_output"), [mm],
                                  relax.TensorType((conv.data[0], f, oh, ow), dtype)))


def identity_proof(alg: Algorithm) -> ProofResult:
    """`exact_identity` as the side condition of a Winograd candidate."""
    start = time.perf_counter()
    status = "proven" if exact_identity(alg) else "refuted"
    return ProofResult(status, f"Winograd {alg.name}: A^T[(G g)(B^T d)] is the correlation on "
                       "every basis pair (exact rationals; bilinear, so for all inputs)",
                       seconds=time.perf_counter() - start)


def roofline_seconds(conv: WinogradConv, peaks: Peaks) -> float:
    """A lower bound of the Winograd form's time: the batched matmul's FLOPs at the compute
    peak (its columns, the tiles, rounded up to the GEMM micro-kernel's panel of two vectors:
    fewer tiles still cost a panel) or its transformed weights U read at the copy bandwidth
    (a^2 / r^2 times the weights: in a model of several such layers they come from memory),
    whichever is longer, plus the bytes the transforms move."""
    item = np.dtype(conv.out_dtype).itemsize
    if conv.dilation > 1:  # the phases, and the input and output rearranged around them
        n = conv.data[0]
        return roofline_seconds(conv.phases, peaks) + item * 2 * (
            math.prod(conv.phases.data) + n * conv.weight[0] * math.prod(conv.out_hw)) / \
            peaks.bandwidth
    a, (n, c, _, _), f = conv.alg.alpha, conv.data, conv.weight[0]
    (th, tw), (oh, ow) = conv.tiles, conv.out_hw
    tiles = n * th * tw  # (the stored columns beyond tw fall inside the panels' rounding)
    panel = 2 * conv.lanes
    columns = math.ceil(tiles / panel) * panel
    gemm = max(2 * a * a * f * c * columns / peaks.flops, a * a * f * c * item / peaks.bandwidth)
    moved = item * (math.prod(padded_input_shape(conv)) + 2 * a * a * (c + f) * tiles +
                    n * f * oh * ow)
    return gemm + moved / peaks.bandwidth


def direct_roofline_seconds(conv: WinogradConv, peaks: Peaks) -> float:
    """The same bound for the direct convolution: its FLOPs or weights, plus data and output."""
    item = np.dtype(conv.out_dtype).itemsize
    (n, c, h, w), f, r = conv.data, conv.weight[0], conv.alg.r
    oh, ow = conv.out_hw
    compute = max(2 * n * f * c * oh * ow * r * r / peaks.flops, f * c * r * r * item /
                  peaks.bandwidth)
    return compute + item * (n * c * h * w + n * f * oh * ow) / peaks.bandwidth


def plans(call: relax.Call, target: tvm.target.Target, peaks: Peaks) -> List[WinogradConv]:
    """The Winograd form of `call` worth costing on a CPU `target`: of the algorithms that
    apply, the one with the lowest `roofline_seconds`, if that bound is below the direct
    convolution's (vectorised at the target's width; none for other targets: the transforms
    are CPU kernels). One candidate, not all: each is built and timed while compiling."""
    if target.kind.name != "llvm":
        return []
    from ..tir_passes.rules.cpu.isa import vector_isa

    found = [replace(p, lanes=vector_isa(target).lanes(p.out_dtype))
             for p in (match(call, alg) for alg in ALGORITHMS) if p]
    if not found:
        return []
    best = min(found, key=lambda p: roofline_seconds(p, peaks))
    return [best] if roofline_seconds(best, peaks) < direct_roofline_seconds(best, peaks) else []
