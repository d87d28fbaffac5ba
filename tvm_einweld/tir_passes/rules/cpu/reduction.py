"""CPU schedule rule for row reductions and what is fused around them: sum / mean / max over the
innermost axes, softmax, layer norm, group norm, RMS norm.

The schedule (one "row" = one value of the leading output axes the reductions are indexed by):
    parallel  row                      fused leading axes of the output block
      per reduction block:   vector accumulators: rfactor over a (k x lanes)-wide split of the
                             reduction axis, k vectors of partial results, each updated by one
                             vector instruction per step, then summed (or max-ed) across them;
                             k independent chains hide the add latency (`accumulators`)
      per spatial block:     the row's elements in vectors (as in injective.py)
Every block of the function runs inside the row loop (compute_at), so a row is read from memory
once and its intermediates (softmax's exponentials, the mean) stay in cache.

Why it is correct:
- compute_inline, compute_at, fuse, split, reorder, rfactor, loop_partition, vectorize and
  parallel are TensorIR primitives that check their own preconditions; a failing one raises
  and the rule returns None, so the function is left as it was.
- rfactor re-associates the reduction: lane j accumulates elements j, j + lanes, j + 2 lanes...
  and the lanes are combined at the end. That is exact for max/min and changes only the
  rounding of a float sum (the same re-association every vectorised BLAS/numpy sum makes); the
  tests compare with numpy in float64 to the usual float32 tolerance.
- `parallel` is applied to the row loop only: rows are independent (each reduction writes its own
  row's result), which compute_at's region analysis guarantees.
- Spatial intermediates are inlined into their consumers unless they call a transcendental
  function and feed more than one block (softmax's exp): those are computed once per row.

Not handled (the rule returns None, the function stays as it was): reductions over a non-innermost
axis followed by other blocks (a lone one is injective.py's), GEMM-class reductions (gemm.py),
symbolic shapes.
"""
from __future__ import annotations

from tvm import ir, s_tir, tirx
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target

from .injective import (COMM_REDUCE, DATA_PAR, CpuParams, _get_realize, block_bytes, cpu_params,
                        is_gemm_like, is_param, is_reduction, is_row_reduction, loop_extent,
                        loops_match_iters, inline_spatial, try_vectorize, vectorize_chunks,
                        visit_exprs)

# Calls that make an element worth computing once and keeping for the row.
EXPENSIVE_CALLS = frozenset({"tirx.exp", "tirx.erf", "tirx.tanh", "tirx.sigmoid", "tirx.log",
                             "tirx.pow", "tirx.exp2", "tirx.log2"})


def _calls_expensive(block: s_tir.SBlock) -> bool:
    found = []
    visit_exprs(block.body, lambda e: found.append(e) if isinstance(e, ir.Call) and isinstance(
        e.op, ir.Op) and e.op.name in EXPENSIVE_CALLS else None)
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
    realize = _get_realize(sch, block_rv)
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
# partial results (scalar) costs more than the latency it hides. Measured on a Zen 1 core:
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


def _rfactor(sch: s_tir.Schedule, block_rv, lanes: int, latency: int):
    """Split the (fused) reduction axes of a row reduction by k x `lanes` (k `accumulators`)
    and rfactor the lane loop: returns the rf block, or None when the reduction is too short or
    rfactor refuses (e.g. a reduction with several accumulators that TVM cannot factor)."""
    block = sch.get(block_rv)
    loops = sch.get_loops(block_rv)
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    red = [lp for lp, k in zip(loops, kinds) if k == COMM_REDUCE]
    extent = 1
    for lp in red:
        extent *= loop_extent(sch, lp)
    if extent < 2 * lanes or extent % lanes:
        # Short rows gain nothing; for a ragged row the lane split would need a predicate and
        # cutting the chunk loop would give each piece its own accumulator init (wrong), so
        # such rows keep a scalar reduction.
        return None
    lanes *= accumulators(extent, lanes, latency)
    state = sch.mod
    try:
        fused = sch.fuse(*red) if len(red) > 1 else red[0]
        _, lane = sch.split(fused, [None, lanes])
        return sch.rfactor(lane, factor_axis=0)
    except ScheduleError:
        del state
        return None


def schedule_reduction(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The rule: a Schedule for a row-reduction `func`, or None when it is not one."""
    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
        return None
    try:
        return _schedule(func, cpu_params(target))
    except ScheduleError:
        return None


def _schedule(func: tirx.PrimFunc, params: CpuParams) -> s_tir.Schedule | None:
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    blocks = [sch.get(rv) for rv in sch.get_child_blocks(root)]
    if not any(is_row_reduction(b) for b in blocks):
        return None
    if any(is_gemm_like(b) for b in blocks):
        return None
    if not all(loops_match_iters(sch, rv) for rv in sch.get_child_blocks(root)):
        return None
    inline_spatial(sch, func, keep=lambda b: _calls_expensive(b) and _consumers(sch, b) > 1)
    rvs = sch.get_child_blocks(root)
    anchor = sch.get(rvs[-1])
    anchor_name = anchor.name_hint
    if not all(is_param(w.source, func) for w in anchor.writes):
        return None
    others = rvs[:-1]
    if any(is_param(w.source, func) for rv in others for w in sch.get(rv).writes):
        return None  # several outputs
    if is_reduction(anchor):  # a lone reduction (sum/mean/max): a row is one output element
        if not is_row_reduction(anchor):
            return None
        rows = sum(int(iv.iter_type) == DATA_PAR for iv in anchor.iter_vars)
    else:
        intermediates = [w.source for rv in others for w in sch.get(rv).writes]
        rows = _row_axes(anchor, intermediates)
    if rows == 0:
        return None

    # rfactor while every block still has its own loop nest (rfactor needs the reduction block
    # to be the first child of its loop, which compute_at would break).
    names = [sch.get(rv).name_hint for rv in rvs]
    factored = {}
    for name in names:
        rv = sch.get_sblock(name)
        if is_row_reduction(sch.get(rv)):
            rf = _rfactor(sch, rv, params.lanes(str(sch.get(rv).writes[0].source.dtype)),
                          params.latency)
            if rf is not None:
                factored[sch.get(rf).name_hint] = name

    anchor_rv = sch.get_sblock(anchor_name)  # after rfactor: the lanes' final combine
    anchor_loops = sch.get_loops(anchor_rv)
    row = sch.fuse(*anchor_loops[:rows]) if rows > 1 else anchor_loops[0]
    for rv in reversed(sch.get_child_blocks(root)):
        if not sch.get(rv).same_as(sch.get(anchor_rv)):
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
    if params.tasks(block_bytes(anchor)) > 1 and loop_extent(sch, row) > 1:
        sch.parallel(row)
    return sch
