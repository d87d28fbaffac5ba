"""CPU schedule rule for row reductions and what is fused around them: sum / mean / max over the
innermost axes, softmax, layer norm, group norm, RMS norm.

The schedule (one "row" = one value of the leading output axes the reductions are indexed by):
    parallel  row                      fused leading axes of the output block
      per reduction block:   vector accumulators: rfactor over a (k x lanes)-wide split of the
                             reduction axis, k vectors of partial results, each updated by one
                             vector instruction per step, then combined by halving, one
                             vector operation a level (`_tree_combine`); k independent chains
                             hide the add latency (`accumulators`)
      per spatial block:     the row's elements in vectors (as in injective.py)
Every block of the function runs inside the row loop (compute_at), so a row is read from memory
once and its intermediates (softmax's exponentials, the mean) stay in cache.
Ragged rows (a length that is not a multiple of k x lanes, ViT's 197 tokens) are split with a
predicate on the last chunk; its full chunks run in vectors, the last lane by lane
(`_vectorize_partial`), and the blocks are put in the row loop by `merge` instead of compute_at
(`_merge_rows`: TVM 0.27's compute_at drops a block's predicate).

Why it is correct:
- compute_inline, compute_at, fuse, split, reorder, rfactor, loop_partition, vectorize and
  parallel are TensorIR primitives that check their own preconditions; a failing one raises
  and the rule returns None, so the function is left as it was.
- rfactor re-associates the reduction: lane j accumulates elements j, j + lanes, j + 2 lanes...
  and the lanes are combined at the end. That is exact for max/min and changes only the
  rounding of a float sum (the same re-association every vectorised BLAS/numpy sum makes); the
  tests compare with numpy in float64 to the usual float32 tolerance.
- `parallel` is applied to the row loop only: rows are independent (each reduction writes its own
  row's result), which compute_at's region analysis guarantees, or, for ragged rows,
  `_merge_rows`'s own check (merge checks no dependences).
- `_tree_combine` is rfactor again, on the combine of the partials: the same re-association
  argument (the halving order instead of the serial one).
- The predicate rfactor gives a ragged row's last chunk keeps its lanes past the row's end from
  loading or accumulating; the chunk loop is cut only after decompose_reduction moved the
  accumulators' init out of it, so each accumulator is initialised once.
- Spatial intermediates are inlined into their consumers unless they call a transcendental
  function and feed more than one block (softmax's exp): those are computed once per row.

Not handled (the rule returns None, the function stays as it was): reductions over a non-innermost
axis followed by other blocks (a lone one is injective.py's), GEMM-class reductions (gemm.py)
other than a gathered contraction whose reduced loads all run along their last index
(`injective.gathered_contraction`, `injective.reduces_innermost`: a dot product per
output), symbolic shapes.
"""
from __future__ import annotations

from tvm import ir, s_tir, tirx
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target

from .gemm import get_sblock_realize
from .injective import (COMM_REDUCE, DATA_PAR, CpuParams, block_bytes, cpu_params,
                        gathered_contraction, is_gemm_like, is_param, is_partition_scope,
                        is_reduction, is_row_reduction, loop_extent, loops_match_iters,
                        inline_spatial, reads_through_index, reduces_innermost, try_vectorize,
                        vectorize_chunks, visit_exprs)

# Calls that make an element worth computing once and keeping for the row.
EXPENSIVE_CALLS = frozenset({"tirx.exp", "tirx.erf", "tirx.tanh", "tirx.sigmoid", "tirx.log",
                             "tirx.pow", "tirx.exp2", "tirx.log2"})


def _calls_expensive(block: s_tir.SBlock, calls: frozenset = EXPENSIVE_CALLS) -> bool:
    """Whether the block's body calls one of `calls`."""
    found = []
    visit_exprs(block.body, lambda e: found.append(e) if isinstance(e, ir.Call) and isinstance(
        e.op, ir.Op) and e.op.name in calls else None)
    return bool(found)


def _consumers(sch: s_tir.Schedule, block: s_tir.SBlock) -> int:
    root = sch.get_sblock("root")
    count = 0
    for rv in sch.get_child_blocks(root):
        other = sch.get(rv)
        if other.same_as(block):
            continue
        if any(r.source.same_as(w.source) for r in other.reads for w in block.writes):
            count += 1
    return count


def _row_axes(anchor: s_tir.SBlock, intermediates: list) -> int:
    """Leading axes of the output block that index every intermediate as plain, in-order
    leading indices: the loops one row's reductions can be computed under without repeating
    work for another row (group norm reads stats[n, c // 2]: rows = (n,))."""
    axes = [iv.var for iv in anchor.iter_vars]
    rows = len(axes)
    for region in anchor.reads:
        if not any(region.source.same_as(b) for b in intermediates):
            continue
        prefix = 0
        for rng, var in zip(region.region, axes):
            if isinstance(rng.min, tirx.Var) and rng.min.same_as(var):
                prefix += 1
            else:
                break
        rows = min(rows, prefix)
    return rows


def _loops_below(sch: s_tir.Schedule, block_rv, depth: int):
    """The loops of a block under the first `depth` loops, split by the kind of block axis each
    one drives: (spatial loops, reduction loops), outer to inner."""
    block = sch.get(block_rv)
    realize = get_sblock_realize(sch, block_rv)
    spatial, reduce = [], []
    for loop in sch.get_loops(block_rv)[depth:]:
        var = sch.get(loop).loop_var
        kinds = {int(iv.iter_type) for iv, value in zip(block.iter_vars, realize.iter_values)
                 if any(v.same_as(var) for v in _vars(value))}
        if loop_extent(sch, loop) == 1:
            continue
        (reduce if COMM_REDUCE in kinds else spatial).append(loop)
    return spatial, reduce


def _vars(expr) -> list:
    found = []
    visit_exprs(expr, lambda e: found.append(e) if isinstance(e, tirx.Var) else None)
    return found


# Fewest steps of the chunk loop worth k accumulators: below it the final combine of k x lanes
# partial results costs more than the latency it hides. Measured on a Zen 1 core, when that
# combine was one serial scalar chain (it is a halving tree since `_tree_combine`; not
# re-measured):
# LayerNorm 128x768 66 -> 49 us with 4 accumulators (24 steps), 60 us with 8 (12 steps);
# softmax rows of 128: 2 accumulators (8 steps) 3 % faster, 4 (4 steps) 3 % slower.
MIN_CHUNKS = 8


def accumulators(extent: int, lanes: int, latency: int) -> int:
    """Independent vector accumulators for a row reduction of `extent` elements: the largest
    power of two k <= the add latency (one chain per cycle of latency keeps the adder busy)
    that divides the row into whole k x lanes chunks, at least MIN_CHUNKS of them; 1 if none."""
    k = 1
    while (2 * k <= latency and extent % (2 * k * lanes) == 0
           and extent // (2 * k * lanes) >= MIN_CHUNKS):
        k *= 2
    return k


def _rfactor(sch: s_tir.Schedule, block_rv, lanes: int, latency: int, ragged: bool = True):
    """Split the (fused) reduction axes of a row reduction by k x `lanes` (k `accumulators`)
    and rfactor the lane loop: returns the rf block, or None when the reduction is too short or
    rfactor refuses (e.g. a reduction with several accumulators that TVM cannot factor).
    A ragged row (its length not a multiple of k x `lanes`) leaves the rf block a predicate
    on its last chunk (`T.where`), which `_merge_rows` and `_vectorize_partial` handle; with
    `ragged` False such rows are not factored (None)."""
    block = sch.get(block_rv)
    loops = sch.get_loops(block_rv)
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    red = [lp for lp, k in zip(loops, kinds) if k == COMM_REDUCE]
    extent = 1
    for lp in red:
        extent *= loop_extent(sch, lp)
    if extent < 2 * lanes or (extent % lanes and not ragged):
        return None  # short rows gain nothing
    lanes *= accumulators(extent - extent % lanes, lanes, latency)
    state = sch.mod
    try:
        fused = sch.fuse(*red) if len(red) > 1 else red[0]
        _, lane = sch.split(fused, [None, lanes])
        return sch.rfactor(lane, factor_axis=0)
    except ScheduleError:
        del state
        return None


def _tree_combine(sch: s_tir.Schedule, combine_rv) -> list:
    """Combine the rf block's partial results (lanes x accumulators of them) by halving instead
    of one serial scalar chain: the combine's reduction loop (extent e, a power of two) is split
    into [2, e/2] and the e/2 loop rfactored, a block that adds (or max-es) the upper half of
    the partials onto the lower half, one vector operation; repeated down to 2 partials, which
    the original block combines. 64 partials (LayerNorm's 4 accumulators of 16 lanes) take 6
    dependent vector steps instead of 64 dependent scalar ones. Exact for max/min; for a sum
    only the order of the additions changes, as rfactor's own does. Returns the new rf blocks
    (each [half spatial, 2 reduction]), outermost level first; none when rfactor refuses."""
    made = []
    while True:
        _, red = _loops_below(sch, combine_rv, 0)
        extent = loop_extent(sch, red[0]) if len(red) == 1 else None
        if extent is None or extent <= 2 or extent & (extent - 1):
            return made
        try:
            _, half = sch.split(red[0], [2, None])
            made.append(sch.rfactor(half, factor_axis=0))
        except ScheduleError:
            return made


def _predicated(sch: s_tir.Schedule, block_rv) -> bool:
    predicate = get_sblock_realize(sch, block_rv).predicate
    return not (isinstance(predicate, tirx.IntImm) and predicate.value == 1)


def _row_signature(indices, row_vars: list) -> tuple | None:
    """Per index of an access, which row axis it is (its position in `row_vars`) or None;
    None overall if a row variable occurs in an index other than alone."""
    sig = []
    for index in indices:
        used = _vars(index)
        hit = [j for j, var in enumerate(row_vars) if any(var.same_as(u) for u in used)]
        if not hit:
            sig.append(None)
        elif len(hit) == 1 and index.same_as(row_vars[hit[0]]):
            sig.append(hit[0])
        else:
            return None
    return tuple(sig)


def _accesses(block: s_tir.SBlock) -> list | None:
    """(buffer, indices, is_store) of every element the block's body and init load or store,
    read off the statements themselves: a block's declared regions may be wider (loop_partition
    widens them to whole buffers). None for a body that is not plain stores."""
    out = []
    def loads(expr):
        visit_exprs(expr, lambda e: out.append((e.source, list(e.indices), False))
                    if isinstance(e, ir.TensorLoad) else None)  # TVM 0.27's BufferLoad
    for stmt in (block.init, block.body):
        if stmt is None:
            continue
        for store in (stmt.seq if isinstance(stmt, tirx.SeqStmt) else [stmt]):
            if not isinstance(store, tirx.BufferStore):
                return None
            out.append((store.buffer, list(store.indices), True))
            for index in store.indices:
                loads(index)
            loads(store.value)
    return out


def _leaf_blocks(sch: s_tir.Schedule) -> list:
    """(outer, block) for every computing block in program order: `outer` is the root's child
    that holds it, itself or the scope block loop_partition made around it (whose loops are
    the block's outer loops)."""
    out = []
    def visit(top, parent):
        for rv in sch.get_child_blocks(parent):
            if is_partition_scope(sch.get(rv)):
                visit(top or rv, rv)
            else:
                out.append((top or rv, rv))
    visit(None, sch.get_sblock("root"))
    return out


def _merge_rows(sch: s_tir.Schedule, func: tirx.PrimFunc, rows: int):
    """Merge the leading `rows` loops of every block (in program order) into one loop nest and
    fuse it: the row loop. Used instead of compute_at when a block carries a predicate, which
    compute_at drops (TVM 0.27 rebuilds a moved block's loops from the region it must cover,
    without its `T.where`: a ragged rf block would then read past its row). `merge` checks no
    dependences, so this does first: every store, and every load of a buffer that is not a
    parameter, indexes each row axis once, alone, and in the same dimensions for every access
    to that buffer; no parameter is both loaded and stored. Then the elements row r touches
    are touched by no other row, and the merged loop, which runs the blocks' row-r iterations
    in program order, computes what the blocks did one after the other.
    Returns the row loop, or None (nothing merged) when the check fails."""
    pairs = _leaf_blocks(sch)
    outer_loops = [sch.get_loops(outer)[:rows] for outer, _ in pairs]
    extents = [[loop_extent(sch, lp) for lp in loops] for loops in outer_loops]
    if any(len(e) != rows or e != extents[0] or None in e for e in extents):
        return None
    written, read_params = set(), set()
    signature: dict = {}
    for (_, rv), loops in zip(pairs, outer_loops):
        block = sch.get(rv)
        realize = get_sblock_realize(sch, rv)
        row_vars = []
        for loop in loops:
            bound = [iv.var for iv, value in zip(block.iter_vars, realize.iter_values)
                     if isinstance(value, tirx.Var) and value.same_as(sch.get(loop).loop_var)]
            if len(bound) != 1:
                return None
            row_vars.append(bound[0])
        accesses = _accesses(block)
        if accesses is None:
            return None
        for buffer, indices, is_store in accesses:
            if is_store:
                written.add(buffer)
            elif is_param(buffer, func):
                read_params.add(buffer)
                continue  # an input: read-only (checked below)
            sig = _row_signature(indices, row_vars)
            if sig is None or sorted(j for j in sig if j is not None) != list(range(rows)) or \
                    signature.setdefault(buffer, sig) != sig:
                return None
    if any(buffer in written for buffer in read_params):
        return None  # a parameter both read and written: rows would see each other's writes
    for depth in range(rows):
        distinct = []
        for outer, _ in _leaf_blocks(sch):  # merge replaces the blocks above the loops
            loop = sch.get_loops(outer)[depth]
            if not any(sch.get(loop).same_as(sch.get(other)) for other in distinct):
                distinct.append(loop)
        if len(distinct) > 1:
            sch.merge(*distinct)
    loops = sch.get_loops(_leaf_blocks(sch)[0][0])[:rows]
    return sch.fuse(*loops) if rows > 1 else loops[0]


def row_count(sch: s_tir.Schedule, names: list, func: tirx.PrimFunc) -> int:
    """How many leading axes of the anchor (the last of the blocks `names`, program order)
    index its rows: 0 unless the anchor writes the function's one output and no other of
    the blocks writes a parameter. A lone reduction (sum/mean/max) has one output element a
    row; otherwise the rows are the axes every intermediate is indexed by (`_row_axes`)."""
    blocks = [sch.get(sch.get_sblock(n)) for n in names]
    anchor, others = blocks[-1], blocks[:-1]
    if not all(is_param(w.source, func) for w in anchor.writes) or any(
            is_param(w.source, func) for b in others for w in b.writes):
        return 0  # not one output
    if is_reduction(anchor):
        if not is_row_reduction(anchor):
            return 0
        return sum(int(iv.iter_type) == DATA_PAR for iv in anchor.iter_vars)
    return _row_axes(anchor, [w.source for b in others for w in b.writes])


def schedule_rows(sch: s_tir.Schedule, names: list, rows: int, params: CpuParams,
                  ragged_func: tirx.PrimFunc | None = None):
    """Put the blocks `names` (program order; the last one, the anchor, indexes its first
    `rows` axes by row) in one fused, serial row loop and vectorise them there: reductions in
    vector accumulators (`_rfactor`, `_tree_combine`), spatial blocks in vector chunks.
    Returns the row loop (the caller parallelises it or merges it into another loop), or None
    when rows are ragged and `_merge_rows` refused. With `ragged_func` (the function whose every
    block is in `names`) rows whose length is not a multiple of the vector are vectorised
    too (`_vectorize_partial`, `_merge_rows`); without, their reductions stay scalar. Every
    consumer of a block in `names` must be in `names` (compute_at's condition)."""
    anchor_name = names[-1]
    root = sch.get_sblock("root")
    # By sref (rfactor adds rf blocks and combine levels beside each reduction; srefs
    # survive the changes): the root's blocks that are not to move.
    staying = [sch.get_sref(rv) for rv in sch.get_child_blocks(root)
               if sch.get(rv).name_hint not in names]
    # rfactor while every block still has its own loop nest (rfactor needs the reduction block
    # to be the first child of its loop, which compute_at would break).
    factored = {}
    ragged = False
    for name in names:
        rv = sch.get_sblock(name)
        if is_row_reduction(sch.get(rv)):
            rf = _rfactor(sch, rv, params.lanes(str(sch.get(rv).writes[0].source.dtype)),
                          params.latency, ragged_func is not None)
            if rf is not None and _predicated(sch, rf):
                # No tree here: the partial last chunk stores its lanes one by one, and a
                # vector load of those just-stored scalars waits for them (no store-to-load
                # forwarding): ViT's 6x197x197 softmax ran 10 % slower with the tree.
                _vectorize_partial(sch, rf)
                ragged = True
            elif rf is not None:
                factored[sch.get(rf).name_hint] = name
                for level in _tree_combine(sch, sch.get_sblock(name)):  # (all named <rf's>)
                    factored[sch.get(level).name_hint] = name

    anchor_rv = sch.get_sblock(anchor_name)  # after rfactor: the lanes' final combine
    if ragged:
        row = _merge_rows(sch, ragged_func, rows)
        if row is None:
            return None
    else:
        anchor_loops = sch.get_loops(anchor_rv)
        row = sch.fuse(*anchor_loops[:rows]) if rows > 1 else anchor_loops[0]
        # In reverse program order, so that each block's consumers are in the loop already.
        for rv in reversed(sch.get_child_blocks(root)):
            if not any(sch.get_sref(rv).same_as(other) for other in staying) and \
                    not sch.get(rv).same_as(sch.get(anchor_rv)):
                sch.compute_at(rv, row, preserve_unit_loops=True)

    for rv in sch.get_child_blocks(row):
        block = sch.get(rv)
        spatial, reduce = _loops_below(sch, rv, 1)
        if block.name_hint in factored:  # vector accumulators: [reduction chunk, lanes]
            if len(spatial) == 1 and len(reduce) == 1:
                sch.reorder(reduce[0], spatial[0])
                try_vectorize(sch, spatial[0])
        elif is_reduction(block):
            continue  # the lanes' final combine, or a reduction rfactor refused: scalar
        elif spatial:
            run = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
            vectorize_chunks(sch, rv, run, params.lanes(str(block.writes[0].source.dtype)),
                             params)
    return row


def _vectorize_partial(sch: s_tir.Schedule, rf_rv) -> None:
    """Vectorise the accumulators of a ragged rf block: the init moves above the chunk loop
    (decompose_reduction), which is then cut before its last, partial chunk (loop_partition);
    the full chunks' lane loop is unrolled (TVM's vectorize refuses a loop under a reduction
    loop whose init was decomposed; LLVM's SLP vectoriser takes the unrolled body), the last
    chunk runs lane by lane under its predicate. Cutting the loop with the init still inside
    would give each piece its own init (a reset sum).
    Measured on this project's Zen 3 (2 cores): softmax 6x197x197 237 -> 126 us, LayerNorm
    197x383 92 -> 18 us, against the scalar reduction ragged rows had before."""
    chunk = sch.get_loops(rf_rv)[-2]  # rfactor's loops end [chunk, lane]
    chunks = loop_extent(sch, chunk)
    sch.decompose_reduction(rf_rv, chunk)  # its init is a spatial block, vectorised later
    if chunks < 2:
        return
    full, _ = sch.loop_partition(chunk, [chunks - 1, None])
    for leaf in sch.get_child_blocks(full):
        sch.unroll(sch.get_loops(leaf)[-1])


def schedule_reduction(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The rule: a Schedule for a row-reduction `func`, or None when it is not one."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None
    try:
        return _schedule(func, cpu_params(target))
    except ScheduleError:
        return None


def _schedule(func: tirx.PrimFunc, params: CpuParams, ragged_rows: bool = True
              ) -> s_tir.Schedule | None:
    """`ragged_rows`: vectorise reductions over rows whose length is not a multiple of the
    vector (`_vectorize_partial`, `_merge_rows`); without, or when `_merge_rows` refuses,
    those reductions stay scalar."""
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    blocks = [sch.get(rv) for rv in sch.get_child_blocks(root)]
    if not any(is_row_reduction(b) for b in blocks):
        return None
    gathers = any(reads_through_index(b) for b in blocks)  # judged once inlined, below
    if any(is_gemm_like(b) for b in blocks) and not gathers:
        return None
    if not all(loops_match_iters(sch, rv) for rv in sch.get_child_blocks(root)):
        return None
    inline_spatial(sch, func, keep=lambda b: _calls_expensive(b) and _consumers(sch, b) > 1)
    rvs = sch.get_child_blocks(root)
    if any(is_gemm_like(b) and not (gathered_contraction(b) and reduces_innermost(b))
           for b in map(sch.get, rvs)):
        return None
    # The row loop's work: the bytes of its largest block. The anchor alone can be a few
    # bytes (a mean's division of each row's sum: NAFNet's 32 x 128 x 128 global pool ran its
    # 2 MiB on one core).
    work = max(block_bytes(sch.get(rv)) for rv in rvs)
    names = [sch.get(rv).name_hint for rv in rvs]
    rows = row_count(sch, names, func)
    if rows == 0:
        return None

    row = schedule_rows(sch, names, rows, params, func if ragged_rows else None)
    if row is None:
        return _schedule(func, params, ragged_rows=False)
    if params.tasks(work) > 1 and loop_extent(sch, row) > 1:
        sch.parallel(row)
    return sch
