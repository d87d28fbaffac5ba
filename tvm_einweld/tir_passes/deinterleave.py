"""Strided vector loads as contiguous loads plus a shuffle: a TIR pass for CPU code generation.

What it rewrites
----------------
A vectorised loop that reads every s-th element (`A[Ramp(base, s, L)]`: a stride-2
convolution's or pooling's columns, the column-phase copy of a strided convolution) reaches
TVM's LLVM code generator as one load per lane: L scalar loads and L inserts (on a Zen 5 a
stride-2 depthwise 3x3 conv at 56x56 took longer than the stride-1 conv with four times its
outputs). Here such a load becomes

    Shuffle([A[Ramp(base + start_j, 1, L)] for each chunk j], [s*k mapped into the chunks])

the contiguous span [base, base + s*(L-1)] read as ceil(span / L) vectors of L lanes (the
last one ending exactly at the span's end), from which lane k takes element s*k: LLVM emits
vector loads and two-source permutes (vpermt2ps on AVX-512).

Why it is correct
-----------------
- Values: lane k of the shuffle is element base + s*k of A, the same element lane k of the
  strided load reads, and nothing is stored. The lane -> chunk map is checked by the tests
  for every stride and width it can be given.
- Memory: every address read lies between the strided load's first and last lane (the last
  chunk ends at the last lane, it never runs past it), which are both read whenever the load
  is evaluated; the buffer is one contiguous allocation, so the new loads touch only memory
  the original touched the bounds of. Only flattened (1-D) loads are rewritten, after
  `FlattenBuffer`, with a constant stride in [2, MAX_STRIDE], constant lanes and scalar
  elements of at least a byte (a buffer of vectors, or of int4 packed two to a byte, is
  addressed otherwise); a load under `address_of` names an address and is left alone.

When: after TVM's whole TIR lowering (`register_tir_pipeline`: the default pipeline, then this
pass, `interleave_stores` and `widen_loads`), so that it sees the loads `VectorizeLoop` made.
`parallel_build` builds the CPU kernels with that pipeline.
"""
from __future__ import annotations

import tvm
from tvm import ir, tirx
from tvm_ffi import structural_mutate

# Strides rewritten: a stride s costs about s vector loads and s - 1 two-source permutes per
# L lanes, against L scalar loads and inserts; beyond a few the permute chain gains little.
MAX_STRIDE = 4
MIN_LANES = 4

TIR_PIPELINE = "einweld"


def chunk_plan(stride: int, lanes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(chunk starts, shuffle indices) for reading lanes `base + stride*k`, k < lanes, as
    contiguous `lanes`-wide chunks: chunk j starts at base + starts[j]; lane k is element
    indices[k] of the chunks' concatenation."""
    span = stride * (lanes - 1) + 1
    count = -(-span // lanes)
    starts = tuple(j * lanes for j in range(count - 1)) + (span - lanes,)
    indices = []
    for k in range(lanes):
        offset = stride * k
        j = min(offset // lanes, count - 1)
        indices.append(j * lanes + offset - starts[j])
    return starts, tuple(indices)


def flat_vector_ramp(indices, ty) -> tuple[tirx.Ramp, int, int] | None:
    """(ramp, stride, lanes) of a flattened (1-D) vector access `X[Ramp(base, stride, lanes)]`
    with constant stride and lanes whose elements are scalars of at least a byte; None for any
    other access (elements that are vectors themselves, or packed below a byte, are addressed
    otherwise). Shared with `widen_loads`."""
    if len(indices) != 1 or not isinstance(indices[0], tirx.Ramp):
        return None
    ramp = indices[0]
    if not isinstance(ramp.stride, tirx.IntImm) or not isinstance(ramp.lanes, tirx.IntImm):
        return None
    element = tvm.runtime.DataType(str(ty))
    if element.lanes != int(ramp.lanes) or element.bits < 8:
        return None
    return ramp, int(ramp.stride), int(ramp.lanes)


def skip_address_of(node, mutator):
    """structural_mutate callback for calls: a load under `address_of` names an address, it
    is not descended (shared with `widen_loads`)."""
    if isinstance(node.op, ir.Op) and node.op.name == "tirx.address_of":
        return node
    return mutator.default_mutate(node)


def strided_access(indices, ty) -> tuple[tirx.Ramp, int, int] | None:
    """`flat_vector_ramp` of an access whose constant stride is in [2, MAX_STRIDE] and lanes at
    least MIN_LANES (what this pass reads as chunks, and `interleave_stores` writes so), else
    None."""
    access = flat_vector_ramp(indices, ty)
    if access is None or not 2 <= access[1] <= MAX_STRIDE or access[2] < MIN_LANES:
        return None
    return access


def deinterleave_load(load: ir.TensorLoad) -> tirx.Expr:
    """`load` as contiguous loads and a shuffle, or `load` itself where it is not a flattened
    strided vector load with a constant stride in [2, MAX_STRIDE] (see the module docstring)."""
    access = strided_access(load.indices, load.ty)
    if access is None:
        return load
    ramp, stride, lanes = access
    starts, indices = chunk_plan(stride, lanes)
    chunks = [tirx.BufferLoad(load.source, [tirx.Ramp(ramp.base + start, 1, lanes)])
              for start in starts]
    return tirx.Shuffle(chunks, [tirx.IntImm("int32", i) for i in indices])


@tvm.transform.module_pass(opt_level=0, name="DeinterleaveStridedLoads")
class DeinterleaveStridedLoads:  # pylint: disable=too-few-public-methods
    """Module pass: `deinterleave_load` on every load of every function (lowered TIR)."""

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        def load(node, mutator):  # its indices first (a load may index by a load)
            return deinterleave_load(mutator.default_mutate(node))

        return structural_mutate(mod, [(ir.Call, skip_address_of), (ir.TensorLoad, load)])


def register_tir_pipeline() -> None:
    """Register `TIR_PIPELINE` ("einweld") for `tvm.tirx.build(..., pipeline=...)`:
    `lane_predicates.SplitLanePredicates`, TVM's default TIR pipeline, then
    `stack_buffers.StackLocalBuffers`, `DeinterleaveStridedLoads`,
    `interleave_stores.InterleaveStridedStores` and `widen_loads.WidenPartialLoads`
    (idempotent)."""
    pipelines = tvm.tirx.compilation_pipeline.PIPELINE_MAP
    if TIR_PIPELINE in pipelines:
        return

    def factory():
        lower, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")
        # pylint: disable=import-outside-toplevel
        from .interleave_stores import InterleaveStridedStores
        from .lane_predicates import SplitLanePredicates
        from .stack_buffers import StackLocalBuffers
        from .widen_loads import WidenPartialLoads

        return (tvm.transform.Sequential([SplitLanePredicates(), lower, StackLocalBuffers(),
                                          DeinterleaveStridedLoads(),
                                          InterleaveStridedStores(), WidenPartialLoads()],
                                         name="einweld_tir"), finalize_host, finalize_device)

    tvm.tirx.compilation_pipeline.register_tir_pipeline(TIR_PIPELINE, factory)
