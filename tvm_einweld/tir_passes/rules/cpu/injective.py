"""CPU schedule rule for spatial memory-bound kernels: element-wise and broadcast chains,
transposes and reshapes, concat / slice / pad, and "window" reductions whose output axes walk the
input contiguously (max/avg pooling, sums over a non-innermost axis).

The schedule, for the one block left after inlining:
    parallel  outer      the leading output axes, fused (plus, for a short outer, a part of the run)
    serial    chunk      the contiguous run split into vectors of the target's lanes
    serial    r...       window/reduction axes, if any (accumulate a whole vector per step)
    vectorize lane       `vector_isa(target).lanes(dtype)` wide

Why it is correct:
- compute_inline, fuse, split, reorder, loop_partition, vectorize and parallel are TensorIR
  schedule primitives; each checks its own preconditions (an illegal one raises and the rule
  returns None, leaving the function as it was). None of them changes what a block computes, only
  the order and the loops it runs in. Reduction axes are only moved inside spatial ones, which
  keeps every output's accumulation order; `parallel` is applied to spatial axes only.
- The run (the axes fused into the vector loop) is chosen so that every buffer access is either
  contiguous along it or does not depend on it (`contiguous_run`); that is a speed argument, not
  a correctness one: any fusion is legal.
- A vector chunk whose block has a condition (padding, concat, the tail of a split) that changes
  inside the chunk would make TVM's vectoriser fall back to scalar code; `vectorize_chunks` asks
  TVM's arithmetic analyzer which chunks have all conditions constant and partitions the chunk
  loop so that only the other chunks (usually the first and last) run scalar. The analyzer only
  decides where to cut; the conditions stay in the code, so a wrong answer would cost speed only.

Why it is fast: one pass over memory (intermediates inlined), unit-stride vector loads and
stores, and parallel chunks no smaller than `Grain.min_task_bytes` so that the pool's fork/join is
amortised.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import tvm
from tvm import ir, s_tir, tirx
from tvm.s_tir.schedule import ScheduleError
from tvm.sym import Analyzer, detect_linear_equation
from tvm.target import Target

from . import gemm
from ...deinterleave import MAX_STRIDE
from .fast_math import visit_exprs  # re-exported: the rules import it from here
from .isa import vector_isa


DATA_PAR, COMM_REDUCE = 0, 2  # tirx.IterVar kinds

# `vectorize_segments` vectorises a piece of a row as one vector of up to this many registers
# (a power of two: LLVM's code for a 3-register copy made a depthwise conv 1.6x slower), and
# cuts a row into at most MAX_PIECES pieces (longer rows lose little to `vectorize_chunks`'s
# whole edge chunks, and each piece is a loop of its own in the code).
WIDE_VECTORS = 2
MAX_PIECES = 12


# ----------------------------------------------------------------------------------- params
@dataclass(frozen=True)
class Grain:
    """How much work one parallel task must have. A fork/join on TVM's pool costs a few
    microseconds, the time a 36 GB/s memory system moves ~64 KiB; smaller kernels run serial."""

    min_task_bytes: int = 64 * 1024
    tasks_per_core: int = 4  # more tasks than cores evens out cores slowed by neighbours
    max_irregular_scan: int = 4096  # chunks examined for conditions; beyond, no partitioning


@dataclass(frozen=True)
class CpuParams:
    """What the schedules need to know about the target."""

    bits: int  # vector register width
    cores: int
    grain: Grain = Grain()
    latency: int = 4  # cycles of a vector add/FMA: independent chains a loop needs to stream

    def lanes(self, dtype: str) -> int:
        return max(1, self.bits // tvm.runtime.DataType(dtype).bits)

    def tasks(self, total_bytes: int) -> int:
        """Parallel tasks worth having for a kernel that moves `total_bytes`."""
        if self.cores < 2:
            return 1
        return max(1, min(self.cores * self.grain.tasks_per_core,
                          total_bytes // self.grain.min_task_bytes))


def cpu_params(target: Target) -> CpuParams:
    """Vector width from the target's -mcpu/-mattr, cores from its num-cores (else this host's,
    which is what TVM's thread pool uses)."""
    cores = int(target.attrs.get("num-cores", 0) or 0) or os.cpu_count() or 1
    isa = vector_isa(target)
    return CpuParams(bits=isa.bits, cores=cores, latency=isa.fma_latency)


# --------------------------------------------------------------------------------- IR walks


def expr_vars(expr) -> set:
    found = set()
    visit_exprs(expr, lambda e: found.add(e) if isinstance(e, tirx.Var) else None)
    return found


def loads(block: s_tir.SBlock) -> list:
    found: list = []
    visit_exprs(block.body, lambda e: found.append(e) if isinstance(e, ir.TensorLoad) else None)
    return found


def stores(block: s_tir.SBlock) -> list[tirx.BufferStore]:
    out: list = []

    def walk(s):
        if isinstance(s, tirx.SeqStmt):
            for x in s.seq:
                walk(x)
        elif isinstance(s, tirx.BufferStore):
            out.append(s)
        elif isinstance(s, tirx.IfThenElse):
            walk(s.then_case)
            walk(s.else_case)

    walk(block.body)
    return out


def condition_atoms(block: s_tir.SBlock) -> list[tirx.Expr]:
    """The comparisons inside the conditions of if_then_else / select in the block body."""
    atoms: list = []

    def split(c):
        if isinstance(c, (tirx.And, tirx.Or)):
            split(c.a)
            split(c.b)
        elif isinstance(c, tirx.Not):
            split(c.a)
        else:
            atoms.append(c)

    def visit(e):
        if isinstance(e, ir.Call) and isinstance(e.op, ir.Op) and e.op.name in ("prim.if_then_else", "tirx.if_then_else"):
            split(e.args[0])
        elif isinstance(e, tirx.Select):
            split(e.condition)

    visit_exprs(block.body, visit)
    return atoms


# ------------------------------------------------------------------------------ block facts
def is_reduction(block: s_tir.SBlock) -> bool:
    return any(int(iv.iter_type) == COMM_REDUCE for iv in block.iter_vars)


def is_gemm_like(block: s_tir.SBlock) -> bool:
    """A reduction whose update multiplies two loads of different tensors that both depend on
    the reduction axes (matmul, conv, batched GEMV): the GEMM rule's business, not ours."""
    if not is_reduction(block):
        return False
    rvars = {iv.var for iv in block.iter_vars if int(iv.iter_type) == COMM_REDUCE}
    found = []

    def visit(e):
        if isinstance(e, tirx.Mul):
            sides = []
            for side in (e.a, e.b):
                side_loads = []
                visit_exprs(side, lambda x: side_loads.append(x)
                            if isinstance(x, ir.TensorLoad) else None)
                sides.append({ld.source.name for ld in side_loads
                              if any(expr_vars(i) & rvars for i in ld.indices)})
            if sides[0] and sides[1] and sides[0] != sides[1]:
                found.append(e)

    for st in stores(block):
        visit_exprs(st.value, visit)
    return bool(found)


def is_row_reduction(block: s_tir.SBlock) -> bool:
    """A reduction some read of which has a reduction axis, and no spatial axis, as its
    innermost index (sum over the last axis, softmax, norms): the reduction rule's business.
    Pooling windows (index ox*2 + kx) and sums over outer axes are not."""
    if not is_reduction(block):
        return False
    rvars = {iv.var for iv in block.iter_vars if int(iv.iter_type) == COMM_REDUCE}
    svars = {iv.var for iv in block.iter_vars if int(iv.iter_type) == DATA_PAR}
    for ld in loads(block):
        if len(ld.indices) == 0:
            continue
        used = expr_vars(ld.indices[-1])
        if used & rvars and not used & svars:
            return True
    return False


def reads_through_index(block: s_tir.SBlock) -> bool:
    """Whether some load of `block` is indexed by another load (a gather, x[index[s, w], d])."""
    nested: list = []
    for ld in loads(block):
        for index in ld.indices:
            visit_exprs(index, lambda e: nested.append(e) if isinstance(e, ir.TensorLoad)
                        else None)
    return bool(nested)


def gathered_contraction(block: s_tir.SBlock) -> bool:
    """A GEMM-class reduction with a gathered operand (`relay_passes.gather_contraction`
    inlined): not the GEMM rule's (its operands are not affine in the block's axes, nothing to
    pack), but a memory-bound one that this rule or the reduction rule takes by its access
    pattern (`innermost_contiguous`, `reduces_innermost`)."""
    return is_gemm_like(block) and reads_through_index(block)


def runs_along(accesses: Iterable[Sequence[tirx.Expr]], axes: set) -> bool:
    """Every access (its indices) that uses one of `axes` has one of them, alone, as its last
    index and none in its other indices: vectors along that axis are contiguous."""
    for indices in accesses:
        if not any(expr_vars(i) & axes for i in indices):
            continue
        last = indices[-1]
        if not (isinstance(last, tirx.Var) and last in axes) or \
                any(expr_vars(i) & axes for i in indices[:-1]):
            return False
    return True


def innermost_contiguous(block: s_tir.SBlock) -> bool:
    """The block's innermost spatial axis runs along every access that uses it (`runs_along`):
    vectors along it are contiguous loads and stores (a window reduction's schedule fits)."""
    spatial = [iv.var for iv in block.iter_vars if int(iv.iter_type) == DATA_PAR]
    accesses = [ld.indices for ld in loads(block)] + [st.indices for st in stores(block)]
    return bool(spatial) and runs_along(accesses, {spatial[-1]})


def reduces_innermost(block: s_tir.SBlock) -> bool:
    """The reduction axes run along every load that uses them (`runs_along`): a dot product
    along contiguous rows, the lanes of an rfactor contiguous loads."""
    reduce = {iv.var for iv in block.iter_vars if int(iv.iter_type) == COMM_REDUCE}
    return runs_along((ld.indices for ld in loads(block)), reduce)


def is_param(buffer, func: tirx.PrimFunc) -> bool:
    """Whether `buffer` is one the function takes (TVM 0.27: its params are the buffers).
    By identity: FuseTIR can give an intermediate the same name as an output."""
    return any(buffer.same_as(p) for p in func.params)


def block_bytes(block: s_tir.SBlock) -> int:
    """Bytes a block's loop nest moves: every buffer it reads or writes, whole, counted once
    (an upper bound for slices, exact for the common case)."""
    total = 0
    seen = set()
    for region in list(block.reads) + list(block.writes):
        buf = region.source
        if buf.name in seen:
            continue
        seen.add(buf.name)
        elems = 1
        for dim in buf.shape:
            elems *= int(dim) if isinstance(dim, tirx.IntImm) else 1
        total += elems * tvm.runtime.DataType(str(buf.dtype)).bits // 8
    return total


def loop_extent(sch: s_tir.Schedule, loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def loops_match_iters(sch: s_tir.Schedule, block_rv) -> bool:
    """The block sits in its own loop nest, one loop per block axis, bound in order (what
    LegalizeOps/FuseTIR produce); the rules rely on this to map axes to loops."""
    loops = sch.get_loops(block_rv)
    realize = gemm.get_sblock_realize(sch, block_rv)
    if len(loops) != len(realize.iter_values):
        return False
    for loop, value in zip(loops, realize.iter_values):
        if not (isinstance(value, tirx.Var) and value.same_as(sch.get(loop).loop_var)):
            return False
        if loop_extent(sch, loop) is None:
            return False
    return True


def inline_spatial(sch: s_tir.Schedule, func: tirx.PrimFunc,
                   keep: Callable[[s_tir.SBlock], bool] = lambda b: False) -> None:
    """compute_inline every spatial block that writes an intermediate (not an output) and that
    `keep` does not want kept; what cannot be inlined stays."""
    changed = True
    while changed:  # inlining a block can make its producer inlinable (one consumer fewer)
        changed = False
        names = [sch.get(rv).name_hint for rv in sch.get_child_blocks(sch.get_sblock("root"))]
        for name in reversed(names):
            block_rv = sch.get_sblock(name)
            block = sch.get(block_rv)
            if is_reduction(block) or any(is_param(w.source, func) for w in block.writes):
                continue
            if keep(block):
                continue
            try:
                sch.compute_inline(block_rv)
                changed = True
            except ScheduleError:
                pass


# ----------------------------------------------------------------------------- vectorising
def contiguous_run(block: s_tir.SBlock, spatial: list[tirx.Var], extents: list[int]) -> int:
    """How many trailing spatial axes can be fused into one vector run: every access (loads and
    stores) must either not depend on them, or index them as its trailing dimensions, in order,
    with the inner ones spanning the whole dimension (so the fused run is one contiguous stream),
    and no condition may depend on them (conditions are cut at chunk boundaries). At least the
    innermost axis (always vectorised, contiguous or not)."""
    accesses = [(ld.source, list(ld.indices)) for ld in loads(block)]
    accesses += [(st.buffer, list(st.indices)) for st in stores(block)]
    cond_vars = set()
    for atom in condition_atoms(block):
        cond_vars |= expr_vars(atom)
    n = len(spatial)
    run = 1
    for k in range(n - 2, -1, -1):
        suffix = spatial[k:]
        if any(v in cond_vars for v in suffix):
            break
        ok = True
        for buf, idx in accesses:
            uses = [bool(expr_vars(i) & set(suffix)) for i in idx]
            if not any(uses):
                continue
            m = len(suffix)
            if len(idx) < m or any(uses[:-m]):
                ok = False
                break
            tail = idx[-m:]
            if not all(isinstance(t, tirx.Var) and t.same_as(v) for t, v in zip(tail, suffix)):
                ok = False
                break
            dims = list(buf.shape)[-m:]
            if not all(isinstance(d, tirx.IntImm) and int(d) == e
                       for d, e in zip(dims[1:], extents[k + 1:])):
                ok = False
                break
        if not ok:
            break
        run = n - k
    return run


def is_partition_scope(block: s_tir.SBlock) -> bool:
    """Whether `block` is one of the scope blocks loop_partition puts around the pieces of a
    cut loop (named by TVM `<loop>_common` and `<loop><i>_partition`), not a computing block."""
    return block.name_hint.endswith(("_partition", "_common"))


def _leaf_blocks_under(sch: s_tir.Schedule, loop) -> list:
    return [b for b in sch.get_child_blocks(loop) if not is_partition_scope(sch.get(b))]


def _lane_conditions(sch: s_tir.Schedule, block_rv, lane_loop):
    """The block's conditions (and predicate) that depend on `lane_loop`, and a function
    giving, for fixed values of some loops (the others over their ranges), each one's truth
    value where TVM's analyzer proves it (None where it does not)."""
    block = sch.get(block_rv)
    realize = gemm.get_sblock_realize(sch, block_rv)
    atoms = condition_atoms(block)
    predicate = realize.predicate
    if not (isinstance(predicate, tirx.IntImm) and int(predicate) == 1):
        atoms.append(predicate)
    lane = sch.get(lane_loop).loop_var
    bindings = dict(zip([iv.var for iv in block.iter_vars], realize.iter_values))
    relevant = []
    for atom in atoms:
        used = expr_vars(atom)
        for var in list(used):
            if var in bindings:
                used |= expr_vars(bindings[var])
        if lane in used:
            relevant.append(atom)
    loops = [sch.get(lp) for lp in sch.get_loops(block_rv)]

    def truths(fixed: dict) -> tuple:
        analyzer = Analyzer()
        for lp in loops:
            value = fixed.get(lp.loop_var)
            analyzer.bind(lp.loop_var, tirx.const(value, str(lp.loop_var.ty)) if value is not None
                          else ir.Range.from_min_extent(lp.min, lp.extent))
        for var, value in bindings.items():
            analyzer.bind(var, value)
        return tuple(True if analyzer.can_prove(atom) else
                     False if analyzer.can_prove(tirx.Not(atom)) else None
                     for atom in relevant)

    return relevant, truths


def irregular_chunks(sch: s_tir.Schedule, block_rv, chunk_loop, vector_loop, chunks: int,
                     limit: int) -> list[int] | None:
    """Chunks (values of `chunk_loop`) in which some condition of the block depends on the
    vector lane, so the vectoriser would fall back to scalar code there. None: too many chunks to
    examine (the caller then leaves the loop whole)."""
    relevant, truths = _lane_conditions(sch, block_rv, vector_loop)
    if not relevant:
        return []
    if chunks > limit:
        return None
    chunk_var = sch.get(chunk_loop).loop_var
    return [j for j in range(chunks) if None in truths({chunk_var: j})]


def regular_segments(sch: s_tir.Schedule, block_rv, run, limit: int
                     ) -> list[tuple[int, bool]] | None:
    """Loop `run` cut into consecutive segments (length, regular): in a regular segment every
    condition of the block that depends on `run` has one value the analyzer proves for all its
    positions (and all values of the other loops), so vectors inside it need no per-lane
    condition; the other segments are single positions. None: `run` has no constant extent or
    is longer than `limit` positions."""
    extent = loop_extent(sch, run)
    if extent is None or extent > limit:
        return None
    relevant, truths = _lane_conditions(sch, block_rv, run)
    if not relevant:
        return [(extent, True)]
    run_var = sch.get(run).loop_var
    segments: list[tuple[int, bool]] = []
    previous = None
    for position in range(extent):
        signature = truths({run_var: position})
        regular = None not in signature
        if regular and segments and segments[-1][1] and signature == previous:
            segments[-1] = (segments[-1][0] + 1, True)
        else:
            segments.append((1, regular))
        previous = signature
    return segments


def vectorize_segments(sch: s_tir.Schedule, block_rv, run, lanes: int, params: CpuParams,
                       wide: int = WIDE_VECTORS) -> None:
    """Vectorise the innermost loop `run` of `block_rv` at element granularity: cut it into
    `regular_segments`, each regular one into pieces of whole vectors (a power of two of
    registers, at most `wide`, which LLVM splits into register-wide operations) plus
    one shorter vector, and vectorise the pieces; the positions where a condition changes (a
    padded row's edges) stay scalar. (`vectorize_chunks` cuts at whole chunks instead: with a
    padded row of 29 in vectors of 16 both chunks hold an edge, and the whole row ran scalar.)
    The pieces are vectorised whole because `split` refuses a loop that does not start at 0,
    as loop_partition's pieces do. Rows of more than `MAX_PIECES` pieces go to
    `vectorize_chunks`."""
    segments = regular_segments(sch, block_rv, run, MAX_PIECES * wide * lanes)
    pieces: list[tuple[int, bool]] = []  # (length, vectorised)

    def add(length: int, vector: bool) -> None:
        if not vector and pieces and not pieces[-1][1]:  # neighbouring scalar positions: one loop
            pieces[-1] = (pieces[-1][0] + length, False)
        else:
            pieces.append((length, vector))

    for length, regular in segments or []:
        while regular and length >= lanes:
            vectors = min(length // lanes, wide)
            take = lanes * (1 << (vectors.bit_length() - 1))  # a power of two of registers
            add(take, True)
            length -= take
        if length:
            add(length, regular and length > 1)
    if not pieces or len(pieces) > MAX_PIECES:
        vectorize_chunks(sch, block_rv, run, lanes, params)
        return
    if len(pieces) == 1:
        if pieces[0][1]:
            vectorize_chunks(sch, block_rv, run, lanes, params)
        return
    loops = sch.loop_partition(run, [size for size, _ in pieces[:-1]] + [None])
    for loop, (_, vector) in zip(loops, pieces):
        if vector:
            for leaf in _leaf_blocks_under(sch, loop):
                try_vectorize(sch, sch.get_loops(leaf)[-1])


def vectorize_chunks(sch: s_tir.Schedule, block_rv, run, lanes: int, params: CpuParams,
                     inner: Iterable = (), accumulate: bool = False) -> None:
    """Split loop `run` of `block_rv` into [chunk, lane] (lane `lanes` wide), move the `inner`
    loops (reduction axes) between them, cut the chunk loop around irregular chunks and vectorise
    the lane loop of every piece (see the module docstring). `accumulate`: each chunk's
    reduction accumulates in a vector of its own (`accumulate_in_registers`); only for a run
    that is one axis, see there."""
    inner = list(inner)
    extent = loop_extent(sch, run)
    width = min(lanes, extent)
    if extent <= width:
        if inner:  # one chunk under reduction loops: TVM cannot vectorise it (see below)
            sch.reorder(*inner, run)
        elif width > 1:
            try_vectorize(sch, run)
        return
    chunk, lane = sch.split(run, [None, width])
    if inner:
        sch.reorder(chunk, *inner, lane)
    pieces = vectorize_lanes(sch, block_rv, chunk, lane, params, cut=bool(inner))
    if inner and accumulate:
        for piece in pieces:
            accumulate_in_registers(sch, piece, width)


def accumulate_in_registers(sch: s_tir.Schedule, chunk, lanes: int) -> None:
    """Each window reduction under loop `chunk` accumulates one chunk's outputs in a stack
    buffer of `lanes` values (`cache_write`, copied out after the chunk's reduction loops),
    which LLVM keeps in a register, rather than in the output buffer: there every window tap is
    a load, max/add and store through memory, a chain of store-to-load forwarding (MaxPool
    3x3/s2 64x112x112: 87 -> 58 us). cache_write and reverse_compute_at are schedule
    primitives (the same values are computed and written); it is done per piece after
    loop_partition, which fails on a loop holding two blocks. Only for a chunk of one axis
    (index chunk * lanes + lane): a chunk of axes fused into the run (i // 37, i % 37) spans
    rows, and TVM 0.27's reverse_compute_at then copies out the whole rows, elements not yet
    reduced included (a wrong answer, caught by test_sum_any_axis)."""
    for leaf in _leaf_blocks_under(sch, chunk):
        block = sch.get(leaf)
        if not is_reduction(block) or len(block.writes) != 1:
            continue
        dtype = str(block.writes[0].source.dtype)
        try:
            copy = sch.cache_write(leaf, 0, gemm.accumulator_scope(lanes, dtype))
            sch.reverse_compute_at(copy, chunk)
        except ScheduleError:  # a refused primitive changes nothing; a cache_write left
            continue  # without its reverse_compute_at copies out once after the piece: correct
        inner = sch.get_loops(copy)[-1]
        if not sch.get(inner).same_as(sch.get(chunk)):  # a one-element copy has no loop of its own
            try_vectorize(sch, inner)


def try_vectorize(sch: s_tir.Schedule, loop) -> bool:
    """Vectorise `loop` if TVM allows it here. TVM refuses a spatial loop nested inside the
    reduction loops of its block unless the reduction is local to the scope block; the loop then
    stays serial (LLVM's own vectoriser may still take it). Schedule primitives check before
    they change anything, so a refusal leaves the schedule as it was."""
    try:
        sch.vectorize(loop)
        return True
    except ScheduleError:
        return False


def vectorize_lanes(sch: s_tir.Schedule, block_rv, chunk, lane, params: CpuParams,
                    cut: bool = False) -> list:
    """Vectorise `lane`; first cut `chunk` (a loop above it) into runs of chunks in which every
    condition of the block is constant across the lanes, so that only the others run scalar.

    `cut`: reduction loops sit between `chunk` and `lane`. TVM vectorises a spatial loop nested
    in reduction loops only when the reduction is local to the enclosing scope block, and
    loop_partition makes one scope block per piece; so the chunk loop is cut (at its last chunk)
    even when all chunks are regular. Returns the loops `chunk` became."""
    chunks = loop_extent(sch, chunk)
    irregular = irregular_chunks(sch, block_rv, chunk, lane, chunks,
                                 params.grain.max_irregular_scan)
    if irregular is None and cut:
        irregular = []
    if not irregular and not cut:
        try_vectorize(sch, lane)
        return [chunk]
    if not irregular:
        if chunks < 2:
            return [chunk]
        irregular = [chunks - 1]
    # Runs of equally (ir)regular chunks become separate loops.
    flags = [j in set(irregular) for j in range(chunks)]
    sizes = []
    for j, flag in enumerate(flags):
        if j and flag == flags[j - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    if len(sizes) == 1:
        if not cut:
            try_vectorize(sch, lane)
        return [chunk]
    pieces = sch.loop_partition(chunk, sizes[:-1] + [None])
    for piece in pieces:
        for leaf in _leaf_blocks_under(sch, piece):
            try_vectorize(sch, sch.get_loops(leaf)[-1])
    return list(pieces)


def interleave_factor(block: s_tir.SBlock, var: tirx.Var, extent: int,
                      max_stride: int = MAX_STRIDE) -> int:
    """s > 1 where the block interleaves s sources along its innermost axis `var` (output
    column s*q + r reads column q of source r: a transposed convolution's phases put back
    together, a depth-to-space), else 1. Precisely, the smallest s <= `max_stride` (the
    strides `interleave_stores` merges) dividing `extent` (the run's loop) such that with
    var = s*q + r (0 <= r < s, q below extent / s), by TVM's analyzer over the other axes'
    domains: every condition using `var` no longer uses q, and every load using `var` reads
    along q contiguously (coefficient 1 in its last index, q nowhere else) or every s-th
    element (coefficient s, which `deinterleave` reads as vectors), at least one
    contiguously. `schedule_spatial_block` then runs r as an unrolled loop around vectors of
    q: each phase's loads are whole vectors, and its stores, every s-th element, become one
    contiguous store (`tir_passes.interleave_stores`). Before, the vector lanes read
    `var // s`, which TVM's vectoriser cannot express, and the whole kernel ran scalar."""
    users = [ld for ld in loads(block) if any(var in expr_vars(i) for i in ld.indices)]
    atoms = [a for a in condition_atoms(block) if var in expr_vars(a)]
    if not users:
        return 1
    for stride in range(2, max_stride + 1):
        if extent % stride:
            continue
        q = tirx.Var("q", var.ty)
        r = tirx.Var("r", var.ty)
        analyzer = Analyzer()
        for iv in block.iter_vars:
            if not iv.var.same_as(var):
                analyzer.bind(iv.var, iv.dom)
        analyzer.bind(q, ir.Range(0, extent // stride))
        analyzer.bind(r, ir.Range(0, stride))
        analyzer.bind(var, q * stride + r)  # simplify() substitutes a variable so bound
        rewritten = analyzer.simplify

        if any(q in expr_vars(rewritten(a)) for a in atoms):
            continue
        contiguous, ok = 0, True
        for ld in users:
            indices = [rewritten(i) for i in ld.indices]
            if any(q in expr_vars(i) for i in indices[:-1]):
                ok = False
                break
            linear = detect_linear_equation(indices[-1], [q])
            coefficient = linear[0] if len(linear) == 2 else None
            if not isinstance(coefficient, tirx.IntImm) or \
                    int(coefficient) not in (1, stride) or q in expr_vars(linear[1]):
                ok = False
                break
            contiguous += int(coefficient) == 1
        if ok and contiguous:
            return stride
    return 1


def _interleaved_chunks(sch: s_tir.Schedule, block_rv, run, stride: int, lanes: int,
                        params: CpuParams) -> None:
    """Loop `run` (var = stride*q + r, `interleave_factor`) as chunk, r (unrolled), lane:
    per chunk, r's stores sit next to each other for `interleave_stores` to merge. The lanes
    are a register, or, where a register does not divide q's extent, a narrower power of two
    that does and keeps the merged store at least a register wide; failing both, a register
    with a partial last chunk (cut off by `vectorize_lanes`, as in `vectorize_chunks`)."""
    q, r = sch.split(run, [None, stride])
    extent = loop_extent(sch, q)
    width = lanes
    if extent % lanes:
        fits = [w for w in (lanes >> k for k in range(1, lanes.bit_length()))
                if w * stride >= lanes and w >= 2 and extent % w == 0]
        width = fits[0] if fits else lanes
    width = min(width, extent)
    if extent <= width:
        sch.reorder(r, q)
        sch.unroll(r)
        try_vectorize(sch, q)
        return
    chunk, lane = sch.split(q, [None, width])
    sch.reorder(chunk, r, lane)
    sch.unroll(r)
    vectorize_lanes(sch, block_rv, chunk, lane, params)


def schedule_spatial_block(sch: s_tir.Schedule, block_rv, params: CpuParams) -> None:
    """The loop nest of the module docstring for one spatial or window-reduction block whose
    loops are its axes in order (spatial axes first; `loops_match_iters`)."""
    block = sch.get(block_rv)
    loops = sch.get_loops(block_rv)
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    spatial_loops = [lp for lp, k in zip(loops, kinds) if k == DATA_PAR]
    reduce_loops = [lp for lp, k in zip(loops, kinds) if k != DATA_PAR]
    spatial_vars = [iv.var for iv, k in zip(block.iter_vars, kinds) if k == DATA_PAR]
    extents = [loop_extent(sch, lp) for lp in spatial_loops]
    dtype = str(block.writes[0].source.dtype)
    lanes = params.lanes(dtype)
    if reduce_loops:  # spatial axes outermost, in order, before splitting anything
        sch.reorder(*spatial_loops, *reduce_loops)
    run_len = contiguous_run(block, spatial_vars, extents)
    outer_loops, run_loops = spatial_loops[:-run_len], spatial_loops[-run_len:]
    run = sch.fuse(*run_loops) if len(run_loops) > 1 else run_loops[0]
    run_extent = math.prod(extents[-run_len:])
    outer_extent = math.prod(extents[:-run_len]) if outer_loops else 1
    outer = sch.fuse(*outer_loops) if len(outer_loops) > 1 else (
        outer_loops[0] if outer_loops else None)

    tasks = params.tasks(block_bytes(block))
    if tasks > 1 and outer_extent < tasks and run_extent % lanes == 0:
        # Too few outer iterations: move whole vector chunks of the run into the parallel loop.
        vectors = run_extent // lanes
        split = max((d for d in range(1, vectors + 1) if vectors % d == 0
                     and d * outer_extent <= tasks), default=1)
        if split > 1:
            head, run = sch.split(run, [split, None])
            outer = sch.fuse(outer, head) if outer is not None else head
            outer_extent *= split
    stride = interleave_factor(block, spatial_vars[-1], loop_extent(sch, run)) \
        if run_len == 1 and not reduce_loops else 1
    if stride > 1:
        _interleaved_chunks(sch, block_rv, run, stride, lanes, params)
    else:
        vectorize_chunks(sch, block_rv, run, lanes, params, reduce_loops,
                         accumulate=run_len == 1)
    if outer is not None and tasks > 1 and outer_extent > 1:
        sch.parallel(outer)


# ------------------------------------------------------------------------------------ rule
def schedule_injective(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The rule: a Schedule for a spatial memory-bound `func`, or None when it is not one
    (row reductions, GEMM-class reductions other than a gathered contraction whose innermost
    output axis is contiguous (`gathered_contraction`, `innermost_contiguous`), shapes with
    symbolic extents, non-llvm targets)."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None
    try:
        sch = s_tir.Schedule(func)
        root = sch.get_sblock("root")
        blocks = sch.get_child_blocks(root)
        if not blocks:
            return None
        # A gather feeding a contraction is judged once inlined (`gathered_contraction`).
        gathers = any(reads_through_index(sch.get(rv)) for rv in blocks)
        for rv in blocks:
            block = sch.get(rv)
            if not block.writes:
                return None  # a scope block: part of the function was scheduled already
            if (is_gemm_like(block) or is_row_reduction(block)) and not gathers:
                return None
            if not loops_match_iters(sch, rv):
                return None
        inline_spatial(sch, func)
        remaining = sch.get_child_blocks(root)
        for rv in remaining if gathers else ():
            block = sch.get(rv)
            if (is_gemm_like(block) or is_row_reduction(block)) and not (
                    gathered_contraction(block) and innermost_contiguous(block)):
                return None
        written = [w.source for rv in remaining for w in sch.get(rv).writes]
        for rv in remaining:
            block = sch.get(rv)
            if not all(is_param(w.source, func) for w in block.writes):
                return None  # an intermediate that could not be inlined
            if any(r.source.same_as(w) for r in block.reads for w in written):
                return None  # blocks that feed each other need a joint schedule
        params = cpu_params(target)
        for rv in remaining:
            schedule_spatial_block(sch, rv, params)
        return sch
    except ScheduleError:
        return None
