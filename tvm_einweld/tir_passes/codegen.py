"""Code generation for a tiled sub-graph (Welder §3.3, §4.2): one PrimFunc per group.

1. `group_prim_func` merges the nodes' PrimFuncs into one (stock `FuseTIR` over a Relax function
   marked Primitive that calls them in order); intermediates become root-allocated buffers.
2. `schedule_group` (on CPU after `inline_cheap_spatial` has recomputed cheap intermediates
   where they are read) tiles the output block by the planned output tile, computes every
   producer at the tile loop (`compute_at` derives the regions itself; localize.py checks
   them against the plan's tile propagation), and maps the tile loop to the device: a
   parallel loop with vectorised inner loops on CPU, `blockIdx.x` with `threadIdx.x` inner
   loops on CUDA.
   The scheduler's upper-level sub-tiles (one per node, see scheduler.py) shape the loops under
   the tile loop of the block that writes each node's output (`block_sub_tiles`): its spatial loops
   are split by the sub-tile, sub-tile loops outside, the sub-tile's own loops and reductions
   inside. On CPU the inner nest then works on an L1-sized sub-tile and vectorises its innermost
   dimension as before. On CUDA a reduction block gets a per-thread register tile: the sub-tile
   loops are the block's `threadIdx.x` (threads = tile / sub-tile), each thread accumulates its
   sub-tile in `local` registers and writes it once to the shared (or global) tile. Blocks without
   a sub-tile, and CUDA blocks without a reduction (no reuse to gain, and a contiguous chunk per
   thread would break coalescing), keep the plain mapping; intermediates stay in the fuse level's
   tile buffers either way.
3. `LocalizeIntermediates` (localize.py) turns the global intermediates into tile buffers.
4. On CUDA, `cuda_kernel_problem` checks the kernel as it will be emitted: well formed, lowered
   by TVM's own TIR pipeline and code generator (what `tvm.compile` runs on it), and within the
   device's shared-memory limits, counted exactly on the lowered device functions.

A pattern the schedule primitives reject raises `Unsupported`; the caller leaves it unfused.
"""
from __future__ import annotations

import logging

import tvm
from tvm import relax, s_tir, tirx

from .cost import TileConfig, propagate_subgraph
from .device import Device, shared_limits
from .localize import LocalizeError, localize
from .lane_predicates import uses_var
from .propagate import leaf_block_rvs, leaf_blocks
from .rules.cpu.gemm import get_sblock_realize
from .rules.cpu.fast_math import visit_exprs
from .rules.cpu.injective import inline_spatial, is_gemm_like, loop_extent
from .rules.cpu.reduction import EXPENSIVE_CALLS, _calls_expensive
from .tile_graph import SubGraph, TileGraph


class Unsupported(RuntimeError):
    """The group cannot be generated as one tiled kernel; it stays as it was."""


def group_prim_func(graph: TileGraph, sub: SubGraph) -> tirx.PrimFunc:
    """One PrimFunc computing `sub`: params are sub.inputs then the output."""
    mod = tvm.IRModule({n.gvar: n.func for n in sub.nodes})
    bb = relax.BlockBuilder(mod)
    params = {t: relax.Var(t, _tensor_type(graph, t)) for t in sub.inputs}
    values = dict(params)
    with bb.function("tile_group", list(params.values()), attrs={"Primitive": True},
                     private=True):
        with bb.dataflow():
            for node in sub.nodes:
                call = relax.call_tir(node.gvar, [values[t] for t in node.inputs],
                                      _tensor_type(graph, node.output))
                emit = bb.emit_output if node is sub.nodes[-1] else bb.emit
                values[node.output] = emit(call)
        bb.emit_func_output(values[sub.output])
    group = bb.get()
    caller = relax.BlockBuilder(group)
    args = [relax.Var(t, _tensor_type(graph, t)) for t in sub.inputs]
    with caller.function("main", args):
        with caller.dataflow():
            out = caller.emit_output(relax.Call(group.get_global_var("tile_group"), args))
        caller.emit_func_output(out)
    fused = relax.transform.FuseTIR()(caller.get())
    main = fused["main"]
    call = main.body.blocks[0].bindings[0].value
    func = fused[call.args[0]]
    return func.with_attr("tirx.noalias", True)


def _tensor_type(graph: TileGraph, name: str) -> relax.TensorType:
    tensor = graph.tensors[name]
    return relax.TensorType(tensor.shape, tensor.dtype)


def _writes_output(block, out_buffer) -> bool:
    return any(w.source.same_as(out_buffer) for w in block.writes)


def block_sub_tiles(graph: TileGraph, sub: SubGraph, func: tirx.PrimFunc, config: TileConfig,
                    inner) -> dict:
    """{block index: (tile extents, sub-tile)} for `schedule_group`, from scheduler SubTiles.

    FuseTIR inlines the nodes' blocks in node order, so the block writing node n's output is the
    last of n's blocks; its spatial loops under the tile loop span the node's propagated tile.
    Only the first upper level is generated (the devices modelled have one above the fuse level).
    Empty when the merged func's blocks do not line up with the nodes' (nothing is sub-tiled).
    """
    if not inner:
        return {}
    plan = propagate_subgraph(graph, sub, config)
    by_node = {t.node: t for t in inner}
    out, index = {}, 0
    for node in sub.nodes:
        index += len(leaf_blocks(node.func))
        if node.name in by_node:
            out[index - 1] = (tuple(plan.tiles[node.output]), by_node[node.name].config.tile)
    return out if index == len(leaf_blocks(func)) else {}


def schedule_group(func: tirx.PrimFunc, tile, device: Device,
                   planned_bytes: int | None = None, sub_tiles: dict | None = None
                   ) -> tirx.PrimFunc:
    """Tile `func`'s output by `tile`, compute producers at the tile loop, map to the device
    (on CPU, cheap intermediates inlined first: `inline_cheap_spatial`).

    `planned_bytes`: the model's bytes of all intermediate tiles of one tile; the generated
    kernel may not need more (see localize.py). `sub_tiles`: `block_sub_tiles`' map of the
    upper-level sub-tile per block (module docstring); a block whose loops under the tile loop do
    not match its entry is left as without one.
    """
    sch = s_tir.Schedule(func)
    out_buffer = func.params[-1]
    rvs = leaf_block_rvs(sch)
    if device.kind == "cpu":
        # Sub-tiles follow their blocks by name through the inlining (an inlined block's
        # goes with it).
        by_name = {sch.get(rvs[index]).name_hint: spec
                   for index, spec in (sub_tiles or {}).items() if index < len(rvs)}
        inline_cheap_spatial(sch, func)
        rvs = leaf_block_rvs(sch)
        sub_tiles = {index: by_name[sch.get(rv).name_hint] for index, rv in enumerate(rvs)
                     if sch.get(rv).name_hint in by_name}
    sub_tiles = sub_tiles or {}
    writers = [rv for rv in rvs if _writes_output(sch.get(rv), out_buffer)]
    if len(writers) != 1 or not writers[0].same_as(rvs[-1]):
        raise Unsupported("the output must be written by the last block only")
    out_rv = rvs[-1]
    try:
        tile_loop = _tile_output(sch, out_rv, out_buffer, tile)
        for rv in reversed(rvs[:-1]):
            sch.compute_at(rv, tile_loop, preserve_unit_loops=True)
        outer = sch.get_loops(out_rv)[: len(tile)]
        tile_loop = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        depth = 1  # the fused tile loop is the outermost loop of every block
        if device.kind == "cpu":
            sch.parallel(tile_loop)
            for index, rv in enumerate(rvs):
                outers = _split_sub_tile(sch, rv, depth, sub_tiles.get(index))
                _vectorize_inner(sch, rv, depth + len(outers))
        else:
            sch.bind(tile_loop, "blockIdx.x")
            for index, rv in enumerate(rvs):
                spec = sub_tiles.get(index)
                if spec is not None and _count(*spec) == device.threads and (
                        _split_loops(sch, rv, depth)[1]):
                    outers = _split_sub_tile(sch, rv, depth, spec)
                    if outers:
                        _bind_register_tile(sch, rv, depth, outers)
                        continue
                _bind_threads(sch, rv, depth, device.threads)
        scope = "local" if device.kind == "cpu" else "shared"
        return localize(sch.mod["main"], scope, planned_bytes)
    except LocalizeError:
        raise
    except (RuntimeError, ValueError) as err:  # ScheduleError and FFI errors
        raise Unsupported(f"schedule primitive failed: {str(err).splitlines()[0]}") from err


# Calls whose result a tile keeps rather than recomputes in each consumer.
KEPT_CALLS = EXPENSIVE_CALLS | {"tirx.sqrt", "tirx.rsqrt"}


def _cheap(block: s_tir.SBlock) -> bool:
    """Whether recomputing the block's value where it is read costs about as little as a load:
    no transcendental or square-root call and no division by anything but a constant (which
    `fast_math` makes a multiplication)."""
    divisions = []
    visit_exprs(block.body, lambda e: divisions.append(e) if isinstance(
        e, (tirx.Div, tirx.FloorDiv)) and not isinstance(e.b, (tirx.IntImm, tirx.FloatImm))
        and str(e.b.ty).startswith("float") else None)
    return not divisions and not _calls_expensive(block, KEPT_CALLS)


def _iterations(block: s_tir.SBlock) -> int:
    """How many times the block's body runs (every iteration variable's extent multiplied)."""
    count = 1
    for iv in block.iter_vars:
        count *= int(iv.dom.extent) if isinstance(iv.dom.extent, tirx.IntImm) else 1 << 30
    return count


def inline_cheap_spatial(sch: s_tir.Schedule, func: tirx.PrimFunc) -> None:
    """CPU: compute_inline the group's spatial intermediates that no GEMM-class block reads
    and that are `_cheap`, or read by one block once per element (it runs no more often than
    the producer). Kept, each is a tile buffer written and read back: NAFNet's channel
    LayerNorm (the mean, x - mean, its square, the division by the deviation, the scaling by
    gamma and beta) kept five 32 KiB tiles, beyond L1, for one operation each. Its square
    root, one per position and read by every channel, stays computed once; a padded input
    stays a tile, as a convolution reads each of its elements for many taps.
    compute_inline rewrites each consumer to evaluate the producer's expression at the
    indices it read, so every value is the same operations on the same operands as before."""
    def keep(block: s_tir.SBlock) -> bool:
        consumers = [sch.get(c) for c in sch.get_consumers(sch.get_sblock(block.name_hint))]
        if any(is_gemm_like(c) for c in consumers):
            return True
        # An expensive value is inlined only where each element is read once, by one block.
        return not _cheap(block) and (len(consumers) > 1 or any(
            _iterations(c) > _iterations(block) for c in consumers))

    inline_spatial(sch, func, keep)


def _tile_output(sch, out_rv, out_buffer, tile):
    """Split the output block's spatial loops by `tile`; return the innermost tile loop."""
    block = sch.get(out_rv)
    loops = sch.get_loops(out_rv)
    ndim = len(out_buffer.shape)
    if ndim == 0:
        raise Unsupported(f"block {block.name_hint}: a scalar output has nothing to tile")
    write = [w for w in block.writes if w.source.same_as(out_buffer)][0]
    spatial = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    # Legalized blocks bind iteration variables to loops in order (T.axis.remap): check that the
    # output is indexed by the first ndim of them, in order, one per loop.
    if len(loops) != len(block.iter_vars) or len(spatial) < ndim:
        raise Unsupported(f"block {block.name_hint}: loops do not map to output dimensions")
    for rng, iv, loop in zip(write.region, block.iter_vars[:ndim], loops[:ndim]):
        if not (rng.min.same_as(iv.var) and iv.iter_type == tirx.IterVar.DataPar
                and int(sch.get(loop).extent) == int(iv.dom.extent)):
            raise Unsupported(f"block {block.name_hint}: output not indexed by its loops")
    outers, inners = [], []
    for loop, size in zip(loops[:ndim], tile):
        outer, inner = sch.split(loop, [None, int(size)])
        outers.append(outer)
        inners.append(inner)
    sch.reorder(*outers, *inners)
    return outers[-1]


def _count(extents, sizes) -> int:
    out = 1
    for e, s in zip(extents, sizes):
        out *= -(-int(e) // int(s))
    return out


def _split_sub_tile(sch, rv, depth, spec) -> list:
    """Split the block's spatial loops under the tile loop by the sub-tile of `spec`.

    Returns the sub-tile loops (outermost first), placed above the sub-tile's own spatial loops
    and its reductions; [] (and no change) when the loops do not span the expected tile or the
    sub-tile does not divide it, or when it is the whole tile.
    """
    if spec is None:
        return []
    extents, sizes = spec
    spatial, reduce = _split_loops(sch, rv, depth)
    # None where an extent is not a constant (`_vectorize_inner`): no sub-tile then.
    have = [loop_extent(sch, l) for l in spatial]
    if (have != [int(e) for e in extents] or len(sizes) != len(have)
            or any(e % int(s) for e, s in zip(have, sizes)) or list(sizes) == have):
        return []
    outers, inners = [], []
    for loop, size in zip(spatial, sizes):
        outer, inner = sch.split(loop, [None, int(size)])
        outers.append(outer)
        inners.append(inner)
    sch.reorder(*outers, *inners, *reduce)
    return outers


def _bind_register_tile(sch, rv, depth, outers) -> None:
    """CUDA: one sub-tile per thread, accumulated in registers and written back once.

    The reduction loops go outside the sub-tile's unrolled loops, so each step's operands are
    loaded once and reused by all accumulators of the sub-tile (an outer product per step), and
    the accumulator array is indexed by constants only (registers, not local memory).
    """
    thread = sch.fuse(*outers) if len(outers) > 1 else outers[0]
    sch.bind(thread, "threadIdx.x")
    inners, reduce = _split_loops(sch, rv, depth + 1)  # the loops under the thread loop
    sch.reorder(*reduce, *inners)
    write_back = sch.cache_write(rv, 0, "local")
    sch.reverse_compute_at(write_back, thread, preserve_unit_loops=True)
    sch.decompose_reduction(rv, reduce[0])
    for loop in inners:
        sch.unroll(loop)


def _split_loops(sch, rv, depth):
    """The block's loops below the tile loop, as (spatial, reduction) lists."""
    loops = sch.get_loops(rv)[depth:]
    kinds = _loop_kinds(sch, rv)[depth:]
    return ([l for l, k in zip(loops, kinds) if k == "S"],
            [l for l, k in zip(loops, kinds) if k == "R"])


def _loop_kinds(sch, rv):
    """'S' or 'R' per loop of a block: does the loop feed a reduction iteration variable?"""
    realize = get_sblock_realize(sch, rv)
    loop_vars = [sch.get(l).loop_var for l in sch.get_loops(rv)]
    kinds = ["S"] * len(loop_vars)
    for iv, value in zip(realize.block.iter_vars, realize.iter_values):
        if iv.iter_type != tirx.IterVar.CommReduce:
            continue
        used = tvm.tirx.analysis.undefined_vars(value, [])
        for i, var in enumerate(loop_vars):
            if any(var.same_as(u) for u in used):
                kinds[i] = "R"
    return kinds


def _walks_contiguously(sch, rv, loop) -> bool:
    """Does `loop` only ever move the last index of the buffers the block reads?"""
    realize = get_sblock_realize(sch, rv)
    loop_var = sch.get(loop).loop_var
    block_vars = [iv.var for iv, value in zip(realize.block.iter_vars, realize.iter_values)
                  if uses_var(value, loop_var)]
    for read in realize.block.reads:
        for var in block_vars:
            if any(uses_var(r.min, var) for r in list(read.region)[:-1]):
                return False
    return True


def _lanes(extent: int) -> int:
    return next((v for v in (16, 8, 4) if extent % v == 0), 0)


def _vectorize_inner(sch, rv, depth) -> None:
    """CPU: vectorise the innermost spatial loop; reductions get a register tile around it.

    For a reduction whose innermost spatial loop walks its inputs contiguously (matmul's j, a
    conv's output column) the reduction loops move outside a rows x lanes block of accumulators,
    unrolled and vectorised so LLVM keeps them in registers. A reduction along the contiguous
    axis (softmax's row max and sum) keeps its order: vectorising across rows would gather.
    """
    spatial, reduce = _split_loops(sch, rv, depth)
    if not spatial or (reduce and not _walks_contiguously(sch, rv, spatial[-1])):
        return
    inner = spatial[-1]
    # compute_at gives a producer the region one tile reads, which varies from tile to tile
    # where the consumer reads it through a reshape (CSRNet's density map: `(tile % 10 % 9 +
    # 6) % 7 + 1` rows): no whole vectors to split off such a loop; it stays scalar.
    extent = loop_extent(sch, inner)
    if extent is None:
        return
    lanes = _lanes(extent)
    vec = None
    if lanes:
        inner, vec = sch.split(inner, [None, lanes]) if extent > lanes else (None, inner)
    if not reduce:
        if vec is not None:
            sch.vectorize(vec)
        return
    rows = spatial[:-1]
    row_tile = []
    if rows:
        extent = loop_extent(sch, rows[-1]) or 1
        factor = next((v for v in (8, 4, 2) if extent % v == 0 and extent > v), 0)
        if factor:
            row_outer, row_inner = sch.split(rows[-1], [None, factor])
            rows = rows[:-1] + [row_outer]
            row_tile = [row_inner]
    outer = rows + ([inner] if inner is not None else [])
    sch.reorder(*outer, *reduce, *row_tile, *([vec] if vec is not None else []))
    for loop in row_tile:
        sch.unroll(loop)
    if vec is not None:
        sch.vectorize(vec)
    sch.decompose_reduction(rv, reduce[0])  # after vectorising, as MetaSchedule's postprocs do


def _bind_threads(sch, rv, depth, threads: int) -> None:
    """CUDA: the spatial loops of a block under the tile loop run on threadIdx.x.

    A reduction accumulates in a per-thread register and writes its result once, so the shared
    tile it produces is not read and written back (with a barrier) at every reduction step.
    The write-back is placed under the fused spatial loop before that loop is split by the
    threads, so the split's predicate (a tile of fewer elements than threads, or of a number
    that is not a multiple of them) guards it as it guards the block: placed under the thread
    loop after the split it had none, and the surplus threads wrote their unset registers past
    the tile (FSRCNN's 2x4 convolution tiles: into other tiles' rows and past the output's end;
    wrong on an H200), and compaction sized shared buffers for them.
    """
    spatial, reduce = _split_loops(sch, rv, depth)
    if not spatial:
        raise Unsupported("a block without spatial loops under the tile loop")
    if reduce:
        sch.reorder(*spatial, *reduce)
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    if reduce:
        write_back = sch.cache_write(rv, 0, "local")
        sch.reverse_compute_at(write_back, fused, preserve_unit_loops=True)
    _, thread = sch.split(fused, [None, threads])
    sch.bind(thread, "threadIdx.x")
    if reduce:
        sch.decompose_reduction(rv, reduce[0])


def serial_threads(func: tirx.PrimFunc, blocks: tuple[int, int] = (1, 0)) -> tirx.PrimFunc:
    """`func` with every thread-bound loop a serial loop, and of the thread blocks (the
    blockIdx.x loop) only those `offset + k * stride`, for `blocks` = (stride, offset): the
    CUDA kernel's own TIR, part by part, to be built and run on a CPU
    (`measure.check_parts`, from `fusion.TileGraphFusion._check`).

    In the tile kernels the threads of a block meet only between thread loops (each a phase:
    one block of the schedule; TVM's ThreadSync puts a barrier between phases that share a
    shared buffer) and blocks never meet. Running the phases one after another, each thread's
    iteration in turn, is therefore one of the executions the barriers allow, and computes
    what the kernel computes: its index arithmetic, predicates, buffer shapes and offsets are
    the ones the GPU runs. A block that writes outside its own tile is what a serial run
    hides (the owner runs later and overwrites it); the blocks of different parts run in
    different calls, so `check_parts` sees such a write as an element two parts wrote. What
    this cannot show is a race TVM's barriers miss, or an error of the CUDA code generator.
    A per-thread (local) buffer allocated outside its thread loop is shared by the serial
    iterations: a kernel relying on such a buffer across phases fails the check, never
    passes it wrongly. (The parts are strided, not reversed: a loop counting down, as
    `extent - 1 - k`, made TVM's CPU lowering write outside a shared buffer.)
    """
    from tvm_ffi import structural_mutate

    stride, offset = blocks

    def serial(loop, mutator):
        loop = mutator.default_mutate(loop)
        if loop.kind != tirx.ForKind.THREAD_BINDING:
            return loop
        var, extent, body = loop.loop_var, loop.extent, loop.body
        if loop.thread_binding.thread_tag == "blockIdx.x" and (stride, offset) != (1, 0):
            total = int(loop.extent)
            var = tirx.Var(loop.loop_var.name + "_part", loop.loop_var.ty)
            extent = tirx.IntImm(loop.loop_var.ty, max(0, -(-(total - offset) // stride)))
            block = var * stride + offset
            body = structural_mutate(body, [(tirx.Var, lambda v, m: block if v.same_as(
                loop.loop_var) else v)])
        return tirx.For(var, loop.min, extent, tirx.ForKind.SERIAL, body, None,
                        loop.annotations)

    return structural_mutate(func, [(tirx.For, serial)])


# ----------------------------------------------------------------- the check of what is emitted
_KERNEL_SYMBOL = "tile_group"


def lower_device_kernels(func: tirx.PrimFunc, target) -> dict:
    """{device target: device module} as `tvm.tirx.build(func, target)` generates code from
    them: `func` bound to the target, lowered by TVM's "default" TIR pipeline (the one
    `tvm.compile` uses), split into host and device functions, the device finalisation passes
    applied. Raises what that lowering raises (e.g. "variable ... used before definition")."""
    from tvm.tirx.build import split_host_device_mods

    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    host = target.host or tvm.target.Target("llvm")
    mod = tvm.IRModule({_KERNEL_SYMBOL: func.with_attr("global_symbol", _KERNEL_SYMBOL)})
    mod = tirx.transform.BindTarget(target.with_host(host))(mod)
    lower, _, finalize_device = tvm.tirx.get_tir_pipeline("default")
    _, device_mods = split_host_device_mods(lower(mod))
    return {t: finalize_device()(m) for t, m in device_mods.items()}


def shared_bytes(device_mods) -> dict[str, dict[str, int]]:
    """{kernel: {scope: bytes}} of the shared-memory allocations ("shared": static
    `__shared__` arrays; "shared.dyn": dynamic) of every lowered device function (modules as
    `lower_device_kernels` returns them).

    Each allocation counts its elements times their size, rounded up to its data alignment
    (the code generator declares `__shared__ alignas(64)` arrays): never less than ptxas
    allocates for them, and more by under one alignment per array (checked with nvcc on 30
    tile kernels: equal on 25, e.g. 66,048 B for the H100 run's matmul+softmax; on the other 5,
    ptxas left off the last array's padding: 42,388 B where this counts 42,432). The walk is
    checked against TVM's own `calculate_allocated_bytes` (the same sum without the
    alignment); an allocation the walk missed raises `Unsupported`.
    """
    out: dict[str, dict[str, int]] = {}
    for mod in device_mods:
        tvm_counts = s_tir.analysis.calculate_allocated_bytes(mod)
        for gvar, func in mod.functions.items():
            name = gvar.name_hint
            raw: dict[str, int] = {}
            aligned: dict[str, int] = {}
            for buffer in _allocated_buffers(func.body):
                scope = str(buffer.scope())
                size = _elements(buffer) * tvm.runtime.DataType(str(buffer.dtype)).bits // 8
                align = max(1, int(buffer.data_alignment))
                raw[scope] = raw.get(scope, 0) + size
                aligned[scope] = aligned.get(scope, 0) + -(-size // align) * align
            expected = {str(k): int(v) for k, v in dict(tvm_counts.get(name, {})).items()}
            if {k: v for k, v in raw.items() if v} != {k: v for k, v in expected.items() if v}:
                raise Unsupported(f"allocations of {name} not counted: {raw} against TVM's "
                                  f"{expected}")
            out[name] = {k: v for k, v in aligned.items() if k.startswith("shared")}
    return out


def _allocated_buffers(stmt) -> list[tirx.Buffer]:
    """The buffers of every AllocBuffer statement in a lowered function body."""
    found = []

    def walk(node) -> None:
        if isinstance(node, tirx.AllocBuffer):
            found.append(node.buffer)
        if isinstance(node, tirx.SeqStmt):
            for child in node.seq:
                walk(child)
            return
        for attr in ("body", "then_case", "else_case", "block"):
            child = getattr(node, attr, None)
            if isinstance(child, tirx.Stmt):
                walk(child)

    walk(stmt)
    return found


def _elements(buffer: tirx.Buffer) -> int:
    count = 1
    for dim in buffer.shape:
        count *= int(dim)
    return count


def _unexpected(err: Exception) -> str:
    """`_last_line(err)`, with a warning where the error is not one TVM raises for a kernel
    it refuses (RuntimeError / ValueError and their subclasses): a bug of ours must not pass
    silently as a refused tile."""
    if not isinstance(err, (RuntimeError, ValueError)):
        logging.getLogger(__name__).warning("CUDA kernel check: unexpected %s: %s",
                                            type(err).__name__, err)
    return _last_line(err)


def cuda_kernel_problem(func: tirx.PrimFunc, target, device: Device) -> str | None:
    """Why the scheduled tile kernel `func` must not be emitted for the CUDA `target`, or None.

    Exact, not modelled: `func` must pass TVM's well-formedness check, lower through TVM's
    TIR pipeline and generate its device code (`lower_device_kernels`, then the target's code
    generator: CUDA source, or a binary where TVM compiles it), and each device kernel's
    shared memory, summed over its lowered allocations (`shared_bytes`), must keep to
    `device.shared_limits(device)`: static shared memory within what a block may declare,
    static plus dynamic within the device model's budget. Those allocations are the ones the code
    generator emits, so a kernel that passes declares no more than the limits; one that fails
    any step is reported and never used (its group keeps its unfused kernels).
    """
    from tvm.tirx.build import codegen_build

    try:
        s_tir.analysis.verify_well_formed(func)
    except Exception as err:  # pylint: disable=broad-except  # ill-formed: not emitted
        return f"not well formed: {_unexpected(err)}"
    try:
        device_mods = lower_device_kernels(func, target)
        for device_target, mod in device_mods.items():
            codegen_build(mod, device_target)
    except Exception as err:  # pylint: disable=broad-except  # does not build: not emitted
        return f"does not lower or build: {_unexpected(err)}"
    try:
        counted = shared_bytes(device_mods.values())
    except Unsupported as err:
        return str(err)
    static_limit, total_limit = shared_limits(device)
    for kernel, scopes in counted.items():
        static = scopes.get("shared", 0)
        total = static + scopes.get("shared.dyn", 0)
        if static > static_limit:
            return (f"{_kernel(kernel)} {static:,} B of static shared memory; a CUDA block "
                    f"may declare at most {static_limit:,} B")
        if total > total_limit:
            return (f"{_kernel(kernel)} {total:,} B of shared memory, over the "
                    f"{total_limit:,} B the device model budgets per block")
    return None


def _kernel(name: str) -> str:
    """How a message names a lowered kernel: the group's, or one of several it was split to."""
    return "its kernel allocates" if name == f"{_KERNEL_SYMBOL}_kernel" else \
        f"its kernel {name} allocates"


def _last_line(err: Exception) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else type(err).__name__
