"""Which rows of a product each core writes, chosen from how the kernels that read it split
their parallel loops: a hint from the Relax graph to the GEMM rule (`gemm.rows_per_core`).

Why: TVM's pool gives thread t of T the t-th contiguous chunk of a parallel loop. A depthwise
convolution or an element-wise kernel over an NCHW tensor runs its parallel loop over
channels, so core t reads channels [t C / T, (t + 1) C / T). A pointwise convolution that
produced that tensor split its tiles by positions (columns of its product), so each core
wrote every channel at half of the positions, and half of what the next kernel's core reads
sits in the other core's L2, where a core reads it at about a fifth of the speed of its own
L2 (`benchmarks/cross_core.md`, Emerald Rapids: 1 MiB just written, read by the writer at
112 GB/s, by the other core at 24 GB/s, slower than DRAM; alike, ~29 GB/s, from 4 MiB on).
Where every reader splits by channel in that order, the product's rule can give core t the
rows (output channels) [t M / T, ...) instead.

What it decides: `rows_per_core_hints(mod, funcs, candidates)` names the candidate PrimFuncs
whose every call's output is read, by every kernel that reads it, through a parallel loop
whose thread chunks are contiguous channel ranges in order (`channel_chunks`): the channel
index (dimension 1) of each read is g(v) * s + r, v the parallel loop's variable, g(v) = v
or v // c, and r, from the other loops, in [0, s) (a depthwise convolution's channel loop,
an element-wise kernel's fused (n, c) loop, a convolution's epilogue under tiles ordered
weight panel first). The other dimensions may move with v too: a chunk then reads its
channels at several positions.
`ApplyCPURules` sets the hint (`ROWS_PER_CORE_ATTR`) on those functions and schedules them
again; the GEMM rule still applies its own conditions (`gemm.rows_per_core`).

Why it is safe: a hint only moves work between cores. Every element of the product is
computed as before, by the same micro-kernel over the same K order, so the results are the
same bits whichever way it goes; a reader whose split cannot be read off gives no hint.
"""
from __future__ import annotations

import tvm
from tvm import ir, relax, s_tir, tirx
from tvm.sym import Analyzer
from tvm_ffi import structural_map

from ...lane_predicates import uses_var
from .gemm import ROWS_PER_CORE_ATTR, get_sblock_realize

CHANNEL = 1  # the channel dimension of an NCHW tensor


def _leaf_blocks(sch: s_tir.Schedule, parent=None) -> list:
    """(top, block): every block without child blocks, and the root's child above it."""
    out = []
    for rv in sch.get_child_blocks(parent or sch.get_sblock("root")):
        children = _leaf_blocks(sch, rv)
        out += [(rv, leaf) for _, leaf in children] if children else [(rv, rv)]
    return out


def _terms(expr) -> list:
    """The summands of `expr` (an Add chain flattened)."""
    if isinstance(expr, tirx.Add):
        return _terms(expr.a) + _terms(expr.b)
    return [expr]


def _stride_of(term, loop_var) -> int | None:
    """s where `term` is the loop variable, or it divided by a constant, times s >= 1."""
    stride = 1
    if isinstance(term, tirx.Mul) and isinstance(term.b, tirx.IntImm):
        term, stride = term.a, int(term.b)
    if isinstance(term, tirx.FloorDiv) and isinstance(term.b, tirx.IntImm) and \
            int(term.b) > 0:
        term = term.a
    return stride if stride >= 1 and isinstance(term, tirx.Var) and \
        term.same_as(loop_var) else None


def _chunks_channels(index, loop_var, loops: list) -> bool:
    """Whether `index` is g(v) * s + r with v the parallel loop's variable, g(v) = v or
    v // c, and r, which other loops drive, in [0, s): then for v < v' every index read at v
    is at most every index read at v' (the ranges g(v) s + [0, s) do not interleave), so
    each core's contiguous chunk of v reads a contiguous range of channels, in the order of
    the chunks. `loops` are the other loops around the read, whose ranges bound r."""
    analyzer = Analyzer()
    for lp in loops:
        if isinstance(lp.extent, tirx.IntImm) and int(lp.extent) == 1:
            analyzer.bind(lp.loop_var, lp.min)
        else:
            analyzer.bind(lp.loop_var, ir.Range.from_min_extent(lp.min, lp.extent))
    moving, rest = [], []
    for term in _terms(analyzer.simplify(index)):
        (moving if uses_var(term, loop_var) else rest).append(term)
    if len(moving) != 1:
        return False
    stride = _stride_of(moving[0], loop_var)
    if stride is None:
        return False
    if not rest:
        return True
    bound = analyzer.const_int_bound(sum(rest[1:], rest[0]))
    return bound.min_value >= 0 and bound.max_value < stride


def channel_chunks(func: tirx.PrimFunc, buffer) -> bool:
    """Whether every read of `buffer` (a parameter of the scheduled `func`) is under a
    parallel loop whose contiguous chunks read contiguous channel ranges in order (see the
    module docstring); False when that cannot be read off the function."""
    if len(buffer.shape) <= CHANNEL:
        return False
    try:
        sch = s_tir.Schedule(func)
    except tvm.error.InternalError:  # TVM 0.27's error for a function it cannot schedule
        return False
    found = False
    for top, rv in _leaf_blocks(sch):
        block = sch.get(rv)
        regions = [r for r in block.reads if r.source.same_as(buffer)]
        if not regions:
            continue
        loops = [sch.get(lp) for lp in sch.get_loops(top)] + \
            ([] if top.same_as(rv) else [sch.get(lp) for lp in sch.get_loops(rv)])
        parallel = [lp for lp in loops if lp.kind == tirx.ForKind.PARALLEL]
        if len(parallel) != 1:
            return False
        loop_var = parallel[0].loop_var
        others = [lp for lp in loops if not lp.same_as(parallel[0])]
        realize = get_sblock_realize(sch, rv)
        binding = list(zip((iv.var for iv in block.iter_vars), realize.iter_values))
        for region in regions:
            index = _substitute(region.region[CHANNEL].min, binding)
            if not _chunks_channels(index, loop_var, others):
                return False
        found = True
    return found


def _substitute(expr, binding: list):
    """`expr` with each block variable replaced by its binding (by identity)."""
    def value(node):
        return next((v for var, v in binding if var.same_as(node)), node)

    return structural_map(expr, [(ir.Var, value)])


def _main(mod: tvm.IRModule):
    names = [gv.name_hint for gv in mod.get_global_vars()]
    main = mod["main"] if "main" in names else None
    return main if isinstance(main, relax.Function) and isinstance(main.body, relax.SeqExpr) \
        else None


def _call_tir_sites(main: relax.Function) -> list:
    """(callee GlobalVar, argument exprs, output Var) of every `call_tir` binding."""
    call_tir = ir.Op.get("relax.call_tir")
    sites = []
    for block in main.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call) and \
                    value.op == call_tir and isinstance(value.args[1], relax.Tuple):
                sites.append((value.args[0], list(value.args[1].fields), binding.var))
    return sites


def _other_uses(main: relax.Function) -> list:
    """Vars used other than as a `call_tir` argument (returned, aliased, in a tuple, passed to
    a packed function): their readers are not all known kernels."""
    call_tir = ir.Op.get("relax.call_tir")
    used: list = []

    def visit(node):
        if isinstance(node, relax.Var):
            used.append(node)

    for block in main.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and value.op == call_tir:
                continue
            relax.analysis.post_order_visit(value, visit)
    relax.analysis.post_order_visit(main.body.body, visit)
    return used


def rows_per_core_hints(mod: tvm.IRModule, funcs: dict, candidates: frozenset) -> set:
    """Names among `candidates` of the PrimFuncs of `mod` whose every call's output is read
    only by calls of `funcs` (name -> scheduled PrimFunc) that read it in contiguous channel
    chunks (`channel_chunks`, judged once per reader and argument)."""
    main = _main(mod)
    if main is None:
        return set()
    sites = _call_tir_sites(main)
    elsewhere = _other_uses(main)
    chunked: dict = {}

    def reads_in_chunks(name: str, position: int) -> bool:
        if (name, position) not in chunked:
            chunked[name, position] = name in funcs and channel_chunks(
                funcs[name], funcs[name].params[position])
        return chunked[name, position]

    verdict: dict = {}
    for callee, _, out in sites:
        if callee.name_hint not in candidates or not verdict.get(callee.name_hint, True):
            continue
        reads = [(reader.name_hint, position) for reader, args, _ in sites
                 for position, arg in enumerate(args) if arg.same_as(out)]
        verdict[callee.name_hint] = bool(reads) and \
            not any(v.same_as(out) for v in elsewhere) and \
            all(reads_in_chunks(name, position) for name, position in reads)
    return {name for name, ok in verdict.items() if ok}
