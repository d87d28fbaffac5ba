"""eOperators (EinNet §5.2): memory-bound expressions compiled as TE kernels.

Which expressions are memory-bound is decided by instantiation against `op_cost`'s one
threshold (`op_cost.kernel_intensity` below `op_cost.EOP_MAX_INTENSITY`); this module only
compiles them.

An expression that is not matched to a predefined operator becomes a `te.compute` through
`tvm_einweld.expr.lowering.to_te`, scheduled with a simple default CPU schedule and added to the
Relax module as a `call_tir`. The schedule is meant to run near memory bandwidth without
tuning: all spatial loops but the innermost fused into one parallel loop; the innermost
spatial loop vectorised whole when it is short (≤ 64), else split by a vector width that
divides it (or left serial, so no lane pays for index division); summation loops (an
OffsetReduce sums a handful of terms) moved between the two so the vector lanes stay spatial.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from tvm import relax, te, tirx

from ..expr.expression import Expr, input_tensors
from ..expr.lowering import make_placeholders, to_te

VECTOR_WIDTHS = (16, 8, 4)
MAX_WHOLE_VECTOR = 64


def _extent(loop_rv, sch) -> int:
    return int(sch.get(loop_rv).extent)


def default_cpu_schedule(func: tirx.PrimFunc, block_name: Optional[str] = None
                         ) -> tirx.PrimFunc:
    """Parallel outer loop, vectorised inner spatial loop (see the module docstring), for the
    block `block_name` or, by default, for every stage of the function in turn (a fused
    eOperator has one stage per materialised scope)."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    if block_name is not None:
        blocks = [block_name]
    else:
        blocks = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    for name in blocks:
        _schedule_block(sch, sch.get_sblock(name))
    return sch.mod["main"]


def _schedule_block(sch, block) -> None:
    loops = sch.get_loops(block)
    kinds = [int(iv.iter_type) for iv in sch.get(block).iter_vars]
    spatial = [lp for lp, k in zip(loops, kinds) if k == 0]
    reduce = [lp for lp, k in zip(loops, kinds) if k != 0]
    if not spatial:
        return
    inner = spatial[-1]
    extent = _extent(inner, sch)
    width = next((w for w in VECTOR_WIDTHS if extent % w == 0), None)
    vec = None
    if extent <= MAX_WHOLE_VECTOR:  # LLVM legalises odd vector lengths
        vec, outer_loops = inner, spatial[:-1]
    elif width is not None:
        rest, vec = sch.split(inner, [None, width])
        outer_loops = spatial[:-1] + [rest]
    else:  # keep the innermost loop serial and unfused: no index division per element
        outer_loops = spatial[:-1]
    outer = sch.fuse(*outer_loops) if len(outer_loops) > 1 else (outer_loops[0] if outer_loops
                                                                   else None)
    if reduce:
        order = ([outer] if outer is not None else []) + reduce + ([vec] if vec is not None else [])
        sch.reorder(*order)
    # Parallelise and vectorise while the block is still one reduction block, then split off
    # its initialisation so the vector lanes of the update stay spatial.
    if outer is not None:
        sch.parallel(outer)
    if vec is not None:
        sch.vectorize(vec)
    if reduce:
        sch.decompose_reduction(block, reduce[0])


def eoperator_func(expr: Expr, name: str, input_names: Sequence[str]) -> tirx.PrimFunc:
    """The scheduled PrimFunc of an eOperator; parameters are the inputs in `input_names` order
    then the output."""
    placeholders = make_placeholders(expr)
    out = to_te(expr, placeholders, name)
    func = te.create_prim_func([placeholders[n] for n in input_names] + [out])
    return default_cpu_schedule(func).with_attr("global_symbol", name)


def emit_eoperator(bb: relax.BlockBuilder, expr: Expr, values: Mapping[str, relax.Expr],
                   name: str) -> relax.Var:
    """Emit `expr` (which reads only tensors named in `values`) as a scheduled call_tir."""
    names = sorted(input_tensors(expr))
    func = eoperator_func(expr, name, names)
    gvar = bb.add_func(func, name)
    out_ty = relax.TensorType(expr.shape, expr.dtype)
    return bb.emit(relax.call_tir(gvar, [values[n] for n in names], out_ty), name_hint=name)
