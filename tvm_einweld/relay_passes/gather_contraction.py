"""FuseGatherIntoContraction: a gathered operand of a contraction is read through its index
inside the contraction's kernel instead of being materialised.

What it rewrites
----------------
After FuseOps, a kernel call `t = call_tir(gather, (x, index...))` whose PrimFunc is one
spatial block reading x at an index that is itself loaded (`take` / ONNX Gather legalised:
T[i, j, w, d] = x[i, j, index[s, w], d]), whose result feeds one contraction kernel
`call_tir(contraction, (..., t, ...))` (a reduction multiplying two operands,
`rules.cpu.injective.is_gemm_like`) and nothing else, when the target in scope is a CPU and
the gather repeats its source's rows (it writes more elements than its largest input holds).
The two calls become one call of a function marked Primitive, which FuseTIR (next in
`tir_passes.prepare`) makes one PrimFunc of the two; the CPU rules then inline the gather
into the contraction (`rules.cpu.injective.gathered_contraction`): the operand is read as
x[i, j, index[s, w], d] where it is used. Grouped, the contraction is no longer the GEMM
rule's, so the pair is grouped only where a CPU rule schedules the merged PrimFunc
(`claimed_by_a_rule` builds it with FuseTIR and asks `rules.cpu.schedule_cpu`).
Longformer's sliding-window attention gathers each query's window of keys and values,
(1, 12, 512, 65, 64) floats each: 100 MB written by each gather and read again by its einsum
(together 60 % of the layer's time), where the keys and values are 1.5 MB.

Why it is correct
-----------------
Nothing is computed differently: the Primitive function calls the same two PrimFuncs on the
same arguments, in the same order, and FuseTIR composes them (TVM's own fusion, the one
FuseOps' groups go through). Only the grouping changes, and only where the gather's result is
used by the contraction alone (its call then goes away with it). The pipeline checks the module
it returns whole (`einweld_pipeline`).

Not rewritten: gathers with more than one user or no larger than their source (an embedding
lookup feeding a matmul: the GEMM rule keeps the matmul), producers that are not a single
gathering block, consumers that are not a contraction, pairs whose merged kernel no CPU rule
schedules, modules built for other targets.
"""
from __future__ import annotations

import math

import tvm
from tvm import ir, relax, s_tir, tirx
from tvm.target import Target
from tvm_ffi import structural_map


def _collect(node, kinds) -> list:
    """Every node of `kinds` under `node` (structural_map, each callback returning its node)."""
    found: list = []

    def keep(value):
        found.append(value)
        return value

    structural_map(node, [(kinds, keep)])
    return found


def _blocks(func: tirx.PrimFunc) -> list:
    """The func's blocks but the root, read off its body (`propagate.leaf_blocks` needs a
    Schedule, which TVM refuses for some kernels, already scheduled ones among them)."""
    return [b for b in _collect(func.body, s_tir.SBlock) if b.name_hint != "root"]


def is_gather(func: tirx.PrimFunc) -> bool:
    """One spatial block that reads through an index."""
    # pylint: disable=import-outside-toplevel
    from ..tir_passes.rules.cpu.injective import is_reduction, reads_through_index

    blocks = _blocks(func)
    return len(blocks) == 1 and not is_reduction(blocks[0]) and reads_through_index(blocks[0])


def is_contraction(func: tirx.PrimFunc) -> bool:
    """A PrimFunc with a reduction block multiplying two operands (matmul, einsum)."""
    # pylint: disable=import-outside-toplevel
    from ..tir_passes.rules.cpu.injective import is_gemm_like

    return any(is_gemm_like(b) for b in _blocks(func))


def _elements(ty) -> int | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = [getattr(d, "value", None) for d in ty.shape.values]
    return None if None in dims else math.prod(int(d) for d in dims)


def _duplicates(producer: relax.Call) -> bool:
    """The gather writes more elements than its largest input holds (a window gather repeating
    rows: materialising it moves more than reading the source in place)."""
    out = _elements(producer.ty)
    sources = [_elements(a.ty) for a in producer.args[1].fields]
    return out is not None and None not in sources and out > max(sources)


def _uses(func: relax.Function) -> dict:
    """How many times each variable is used (in binding values and the result)."""
    counts: dict = {}
    body = func.body
    for expr in [b.value for block in body.blocks for b in block.bindings] + [body.body]:
        for var in _collect(expr, (relax.Var, relax.DataflowVar)):
            counts[var] = counts.get(var, 0) + 1
    return counts


def _primitive(producer: relax.Call, consumer: relax.Call, position: int) -> relax.Function:
    """A Primitive function computing `producer`, then `consumer` with its result at argument
    `position`; its parameters are the producer's arguments, then the consumer's others."""
    outer = _outer_args(producer, consumer, position)
    params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(outer)]
    n_in = len(producer.args[1].fields)
    bb = relax.BlockBuilder()
    with bb.function("fused", params, {"Primitive": True}, private=True):
        with bb.dataflow():
            gathered = bb.emit(relax.call_tir(producer.args[0], relax.Tuple(params[:n_in]),
                                              producer.ty))
            rest = iter(params[n_in:])
            args = [gathered if i == position else next(rest)
                    for i in range(len(consumer.args[1].fields))]
            out = bb.emit_output(relax.call_tir(consumer.args[0], relax.Tuple(args),
                                                consumer.ty))
        bb.emit_func_output(out)
    return bb.get()["fused"]


def _outer_args(producer: relax.Call, consumer: relax.Call, position: int) -> list:
    return list(producer.args[1].fields) + \
        [a for i, a in enumerate(consumer.args[1].fields) if i != position]


def claimed_by_a_rule(mod: tvm.IRModule, fused: relax.Function, target: Target) -> bool:
    """Whether a CPU rule schedules the PrimFunc FuseTIR makes of the Primitive function
    `fused` (`_primitive`, its callees in `mod`): grouped, the contraction is no longer the
    GEMM rule's, and a kernel no rule takes would run unscheduled (far slower than a
    materialised gather and the GEMM kernel)."""
    # pylint: disable=import-outside-toplevel
    from ..tir_passes.rules.cpu import schedule_cpu

    callees = [b.value.args[0] for block in fused.body.blocks for b in block.bindings]
    bb = relax.BlockBuilder(tvm.IRModule({gv: mod[gv] for gv in callees}))
    gvar = bb.add_func(fused, "fused")
    params = [relax.Var(f"a{i}", p.ty) for i, p in enumerate(fused.params)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(gvar, params))
        bb.emit_func_output(out)
    try:
        merged = relax.transform.FuseTIR()(bb.get())
    except (RuntimeError, ValueError, TypeError):  # TVM refused: left as two kernels
        return False
    funcs = [f for gv, f in merged.functions_items()
             if isinstance(f, tirx.PrimFunc) and gv.name_hint.startswith("fused")]
    return len(funcs) == 1 and schedule_cpu(funcs[0], target) is not None


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target: Target) -> None:
        super().__init__(mod)
        self.mod = mod
        self.target = target
        self.uses: dict = {}
        self.rewritten = 0

    def _prim_func(self, call: relax.Call) -> tirx.PrimFunc | None:
        """The PrimFunc of a `call_tir` with no extra arguments and one tensor result."""
        if not (isinstance(call, relax.Call) and call.op == ir.Op.get("relax.call_tir")) or \
                len(call.args) != 2 or not isinstance(call.ty, relax.TensorType):
            return None
        func = self.mod[call.args[0]] if call.args[0] in self.mod.get_global_vars() else None
        return func if isinstance(func, tirx.PrimFunc) else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        consumer = self._prim_func(call)
        if consumer is None or not is_contraction(consumer):
            return call
        for position, arg in enumerate(call.args[1].fields):
            if not isinstance(arg, relax.Var) or self.uses.get(arg, 0) != 1:
                continue
            producer = self.lookup_binding(arg)
            gather = self._prim_func(producer) if producer is not None else None
            if gather is None or not is_gather(gather) or not _duplicates(producer):
                continue
            fused = _primitive(producer, call, position)
            if not claimed_by_a_rule(self.mod, fused, self.target):
                continue
            name = f"fused_{producer.args[0].name_hint}_{call.args[0].name_hint}"
            gvar = self.builder_.add_func(fused, name)
            self.rewritten += 1
            return relax.Call(gvar, _outer_args(producer, call, position))
        return call


@tvm.transform.module_pass(opt_level=0, name="FuseGatherIntoContraction")
def FuseGatherIntoContraction(  # pylint: disable=invalid-name
        mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Relax module pass (after FuseOps, before FuseTIR), for the CPU target in scope: every
    gather kernel that repeats its source's rows and whose only user is a contraction kernel
    is grouped with it into one Primitive function where a CPU rule schedules the result (see
    the module docstring); other calls, and modules built for other targets, are left as
    they are."""
    target = Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return mod
    rewriter = _Rewriter(mod, target)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function) and not (func.attrs and func.attrs.get("Primitive")):
            rewriter.uses = _uses(func)
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    if not rewriter.rewritten:
        return mod
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
