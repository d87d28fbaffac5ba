"""eOperators (EinNet §5.2): memory-bound expressions compiled as TE kernels.

Which expressions are memory-bound is decided by instantiation against the one threshold
(`op_cost.kernel_intensity` below `op_cost.EOP_MAX_INTENSITY`); this module only compiles them.

An expression that is not matched to a predefined operator becomes a `te.compute` through
`tvm_einweld.expr.lowering.to_te`, is scheduled by the CPU rules' eOperator schedule
(`tir_passes.rules.cpu.memory_bound.schedule_eoperator`: parallel outer loops, vector loops as
wide as the target's vector registers, no change to any output's order of operations) and is
added to the Relax module as a `call_tir`.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import tvm
from tvm import relax, te, tirx
from tvm.target import Target

from ..expr.expression import Expr, input_tensors
from ..expr.lowering import make_placeholders, to_te
from ..tir_passes.rules.cpu.memory_bound import schedule_eoperator


def eoperator_target(target: Optional[Target] = None) -> Target:
    """The CPU target an eOperator is scheduled for: `target`, else the current one (the
    pipeline instantiates under `with target:`), else plain "llvm". Not a CPU target: "llvm",
    the schedule eOperators have always had."""
    target = target or Target.current(allow_none=True)
    return target if target is not None and target.kind.name == "llvm" else Target("llvm")


def eoperator_func(expr: Expr, name: str, input_names: Sequence[str],
                   target: Optional[Target] = None) -> tirx.PrimFunc:
    """The scheduled PrimFunc of an eOperator (for `eoperator_target(target)`); parameters are
    the inputs in `input_names` order then the output."""
    placeholders = make_placeholders(expr)
    out = to_te(expr, placeholders, name)
    func = te.create_prim_func([placeholders[n] for n in input_names] + [out])
    return schedule_eoperator(func, eoperator_target(target)).with_attr("global_symbol", name)


def emit_eoperator(bb: relax.BlockBuilder, expr: Expr, values: Mapping[str, relax.Expr],
                   name: str) -> relax.Var:
    """Emit `expr` (which reads only tensors named in `values`) as a scheduled call_tir."""
    names = sorted(input_tensors(expr))
    func = eoperator_func(expr, name, names)
    gvar = bb.add_func(func, name)
    out_ty = relax.TensorType(expr.shape, expr.dtype)
    return bb.emit(relax.call_tir(gvar, [values[n] for n in names], out_ty), name_hint=name)


def eoperator_module(expr: Expr, name: str = "eop") -> tvm.IRModule:
    """A Relax module whose `main` takes `expr`'s input tensors (sorted by name) and returns
    `expr` computed by one eOperator named `name` (whatever its intensity: to time or test
    the eOperator of an expression)."""
    params = {n: relax.Var(n, relax.TensorType(t.shape, t.dtype))
              for n, t in sorted(input_tensors(expr).items())}
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        with bb.dataflow():
            out = bb.emit_output(emit_eoperator(bb, expr, params, name))
        bb.emit_func_output(out)
    return bb.get()
