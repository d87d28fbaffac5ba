"""FuseGatherIntoContraction: a gathered operand of a contraction is read through its index
inside the contraction's kernel instead of being materialised.

What it rewrites
----------------
After FuseOps, a kernel call `t = call_tir(gather, (x, index...))` whose PrimFunc is one
spatial block reading x at an index that is itself loaded (`take` / ONNX Gather legalised:
T[i, j, w, d] = x[i, j, index[s, w], d]), whose result feeds one contraction kernel
`call_tir(contraction, (..., t, ...))` (a reduction multiplying two operands,
`rules.cpu.injective.is_gemm_like`) and nothing else. The two calls become one call of a
function marked Primitive, which FuseTIR (next in `tir_passes.prepare`) makes one PrimFunc of
the two; the CPU rules then inline the gather into the contraction
(`rules.cpu.injective.gathered_contraction`): the operand is read as x[i, j, index[s, w], d]
where it is used. Longformer's sliding-window attention gathers each query's window of keys
and values, (1, 12, 512, 65, 64) floats each: 100 MB written by each gather and read again by
its einsum (together 60 % of the layer's time), where the keys and values are 1.5 MB.

Why it is correct
-----------------
Nothing is computed differently: the Primitive function calls the same two PrimFuncs on the
same arguments, in the same order, and FuseTIR composes them (TVM's own fusion, the one
FuseOps' groups go through). Only the grouping changes, and only where the gather's result is
used by the contraction alone (its call then goes away with it). The pipeline checks the module
it returns whole (`einweld_pipeline`).

Not rewritten: gathers with more than one user, producers that are not a single gathering
block, consumers that are not a contraction.
"""
from __future__ import annotations

import tvm
from tvm import ir, relax, s_tir, tirx
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
    return [b for b in _collect(func.body, s_tir.SBlock) if b.name_hint != "root"]


def is_gather(func: tirx.PrimFunc) -> bool:
    """One spatial block that reads through an index."""
    # pylint: disable=import-outside-toplevel
    from ..tir_passes.rules.cpu.injective import is_reduction, reads_through_index

    blocks = _blocks(func)
    return len(blocks) == 1 and not is_reduction(blocks[0]) and reads_through_index(blocks[0])


def is_contraction(func: tirx.PrimFunc) -> bool:
    """A PrimFunc with a reduction block multiplying two operands (matmul, einsum)."""
    from ..tir_passes.rules.cpu.injective import is_gemm_like  # pylint: disable=import-outside-toplevel

    return any(is_gemm_like(b) for b in _blocks(func))


def _uses(func: relax.Function) -> dict:
    """How many times each variable is used (in binding values and the result)."""
    counts: dict = {}
    body = func.body
    for expr in [b.value for block in body.blocks for b in block.bindings] + [body.body]:
        for var in _collect(expr, (relax.Var, relax.DataflowVar)):
            counts[var] = counts.get(var, 0) + 1
    return counts


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, uses: dict) -> None:
        super().__init__(mod)
        self.mod = mod
        self.uses = uses
        self.rewritten = 0

    def _prim_func(self, call: relax.Call) -> tirx.PrimFunc | None:
        if not (isinstance(call, relax.Call) and call.op == ir.Op.get("relax.call_tir")):
            return None
        func = self.mod[call.args[0]] if call.args[0] in self.mod.get_global_vars() else None
        return func if isinstance(func, tirx.PrimFunc) else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:  # pylint: disable=arguments-renamed
        call = self.visit_expr_post_order(call)
        consumer = self._prim_func(call)
        if consumer is None or not is_contraction(consumer):
            return call
        args = list(call.args[1].fields)
        for position, arg in enumerate(args):
            if not isinstance(arg, relax.Var) or self.uses.get(arg, 0) != 1:
                continue
            producer_call = self.lookup_binding(arg)
            producer = self._prim_func(producer_call) if producer_call is not None else None
            if producer is None or not is_gather(producer):
                continue
            return self._fused(call, position, producer_call)
        return call

    def _fused(self, call: relax.Call, position: int, producer: relax.Call) -> relax.Expr:
        """A Primitive function computing `producer` then `call` with its result."""
        outer = list(producer.args[1].fields) + \
            [a for i, a in enumerate(call.args[1].fields) if i != position]
        params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(outer)]
        n_in = len(producer.args[1].fields)
        inner = relax.BlockBuilder()
        with inner.function("fused_gather", params, {"Primitive": True}, private=True):
            with inner.dataflow():
                gathered = inner.emit(relax.call_tir(producer.args[0], relax.Tuple(params[:n_in]),
                                                     producer.ty))
                rest = iter(params[n_in:])
                consumer_args = [gathered if i == position else next(rest)
                                 for i in range(len(call.args[1].fields))]
                out = inner.emit_output(relax.call_tir(call.args[0], relax.Tuple(consumer_args),
                                                       call.ty))
            inner.emit_func_output(out)
        func = inner.get()["fused_gather"]
        gvar = self.builder_.add_func(func, f"fused_{producer.args[0].name_hint}_{call.args[0].name_hint}")
        self.rewritten += 1
        return relax.Call(gvar, outer)


@tvm.transform.module_pass(opt_level=0, name="FuseGatherIntoContraction")
def FuseGatherIntoContraction(mod: tvm.IRModule, _ctx) -> tvm.IRModule:  # pylint: disable=invalid-name
    """Relax module pass (after FuseOps, before FuseTIR): every gather kernel whose only user is
    a contraction kernel is grouped with it into one Primitive function (see the module
    docstring); other calls are left unchanged."""
    rewriter = _Rewriter(mod, {})
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function) and not (func.attrs and func.attrs.get("Primitive")):
            rewriter.uses = _uses(func)
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    if not rewriter.rewritten:
        return mod
    return relax.transform.DeadCodeElimination()(rewriter.builder_.get())
