"""Split a Relax function into subprograms at non-linear activations (EinNet Algorithm 1, line 5).

Activations offer nothing to derivations except fusion (EinNet §6.3, after PET), so they are
the cut points: a subprogram is a maximal run of consecutive bindings whose calls have a
canonical expression (`expr.from_relax.expr_of_call`). An activation, an operator without a
canonical expression, or any binding that is not a call ends the current run and is left as
it is. Each operator of a subprogram is translated to its expression; the tensors it reads are
named by the Relax value they come from, so two operators reading the same variable or
constant read the same expression tensor (what inter-expression rules look for).

`rebuild_function` puts a function back together with some bindings' values replaced; the
original variables are kept, so nothing else in the function has to be rewritten.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Tuple

from tvm import relax

from ..expr.canonical import UnsupportedOperator
from ..expr.expression import Expr
from ..expr.from_relax import expr_of_call, op_name

# Element-wise non-linear functions (and ops that are nothing but one) that cut subprograms.
ACTIVATIONS = frozenset({
    "relax.nn.relu", "relax.nn.leakyrelu", "relax.nn.gelu", "relax.nn.gelu_tanh",
    "relax.nn.silu", "relax.nn.prelu", "relax.nn.selu", "relax.nn.softplus",
    "relax.nn.softmax", "relax.nn.log_softmax", "relax.tanh", "relax.sigmoid", "relax.exp",
    "relax.clip", "relax.erf", "relax.log", "relax.sqrt", "relax.rsqrt",
})


@dataclass(frozen=True)
class OpNode:
    """One operator of a subprogram: its binding, its tensor arguments and its expression.

    `names[k]` is the expression tensor that `args[k]` becomes.
    """

    binding: relax.VarBinding = field(compare=False)
    args: Tuple[relax.Expr, ...] = field(compare=False)
    names: Tuple[str, ...]
    expr: Expr

    @property
    def call(self) -> relax.Call:
        return self.binding.value

    @property
    def var(self) -> relax.Var:
        return self.binding.var

    @property
    def kind(self) -> str:
        return op_name(self.call)


@dataclass(frozen=True)
class Subprogram:
    """A run of translatable operators between cut points of one function."""

    function: str
    index: int
    ops: Tuple[OpNode, ...]

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(op.kind for op in self.ops)


@dataclass(frozen=True)
class Split:
    """The subprograms of a function, and why each left-alone binding was left alone."""

    subprograms: Tuple[Subprogram, ...]
    left_alone: Tuple[Tuple[str, str], ...]  # (variable name, reason)


def _tensor_args(call: relax.Call) -> Tuple[relax.Expr, ...]:
    return tuple(a for a in call.args if isinstance(getattr(a, "ty", None), relax.TensorType))


class _Namer:
    """Expression tensor names per Relax value: the same value always gets the same name."""

    def __init__(self) -> None:
        self.names: Dict[relax.Expr, str] = {}

    def __call__(self, value: relax.Expr) -> str:
        if value not in self.names:
            stem = value.name if isinstance(value, relax.Var) else "const"
            self.names[value] = f"{stem}_{len(self.names)}"
        return self.names[value]


def split_function(func: relax.Function, name: str = "main") -> Split:
    """The subprograms of `func` (a normalised Relax function), in program order."""
    subprograms: List[Subprogram] = []
    left: List[Tuple[str, str]] = []
    current: List[OpNode] = []
    namer = _Namer()

    def cut() -> None:
        if current:
            subprograms.append(Subprogram(name, len(subprograms), tuple(current)))
            current.clear()

    body = func.body
    blocks = body.blocks if isinstance(body, relax.SeqExpr) else ()
    for block in blocks:
        for binding in block.bindings:
            value = getattr(binding, "value", None)
            var_name = binding.var.name
            if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.Call) \
                    or not isinstance(value.op, tvm_op_type()):
                cut()
                left.append((var_name, "not an operator call"))
                continue
            kind = op_name(value)
            if kind in ACTIVATIONS:
                cut()
                left.append((var_name, f"{kind} is an activation (a cut point)"))
                continue
            args = _tensor_args(value)
            names = tuple(namer(a) for a in args)
            try:
                expr = expr_of_call(value, names)
            except (UnsupportedOperator, ValueError) as err:
                cut()
                left.append((var_name, str(err)))
                continue
            current.append(OpNode(binding, args, names, expr))
        cut()  # a block boundary ends a subprogram
    return Split(tuple(subprograms), tuple(left))


def tvm_op_type():
    import tvm

    return tvm.ir.Op


def split_module(mod) -> Dict[str, Split]:
    """`split_function` for every Relax function of `mod`, by function name."""
    return {gv.name_hint: split_function(f, gv.name_hint)
            for gv, f in mod.functions_items() if isinstance(f, relax.Function)}


Emitter = Callable[[relax.BlockBuilder], relax.Expr]


def rebuild_function(mod, name: str, replacements: Mapping[relax.Var, Emitter]):
    """A copy of `mod` in which function `name` binds each variable in `replacements` to the
    value its emitter returns (the emitter may emit helper bindings and TIR functions first).

    Bindings keep their variables, so every use stays valid as long as each new value has the
    type of the old one (checked by normalisation).
    """
    import tvm

    gvar = mod.get_global_var(name)
    func = mod[gvar]
    bb = relax.BlockBuilder(mod)  # knows the module's names, so new TIR functions get fresh ones
    attrs = dict(func.attrs) if func.attrs is not None else {}
    attrs.pop("global_symbol", None)
    with bb.function(_SCRATCH, list(func.params), attrs=attrs or None, pure=bool(func.is_pure)):
        for block in func.body.blocks:
            scope = bb.dataflow() if isinstance(block, relax.DataflowBlock) else nullcontext()
            with scope:
                _emit_block(bb, block, replacements)
        bb.emit_func_output(func.body.body)
    built = bb.get()
    functions = {gv: f for gv, f in built.functions_items() if gv.name_hint != _SCRATCH}
    new_func = built[_SCRATCH]
    if func.attrs is not None and "global_symbol" in func.attrs:
        new_func = new_func.with_attr("global_symbol", func.attrs["global_symbol"])
    else:
        new_func = new_func.without_attr("global_symbol")
    functions[gvar] = new_func
    return without_new_symbols(tvm.IRModule(functions, attrs=mod.attrs), mod)


def without_new_symbols(mod, old=None):
    """`mod` without the global symbol of every TIR function that `old` (a module) lacks.

    Relax's own kernels carry no symbol until the build's AttachGlobalSymbol names each after
    its GlobalVar. A symbol set earlier breaks that: a kernel added under a name already taken
    keeps its old symbol, and FuseTIR copies a kernel's symbol into the fused kernel it makes,
    so two functions end up with one symbol and the module does not build.
    """
    import tvm

    kept = {gv.name_hint for gv in old.functions} if old is not None else set()
    updates = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc) and gv.name_hint not in kept and \
                func.attrs is not None and "global_symbol" in func.attrs:
            updates[gv] = func.without_attr("global_symbol")
    if not updates:
        return mod
    functions = {gv: updates.get(gv, f) for gv, f in mod.functions_items()}
    return tvm.IRModule(functions, attrs=mod.attrs)


_SCRATCH = "__tvm_einweld_rebuild"


def _emit_block(bb: relax.BlockBuilder, block, replacements: Mapping[relax.Var, Emitter]) -> None:
    for binding in block.bindings:
        emitter = replacements.get(binding.var) if isinstance(binding, relax.VarBinding) \
            else None
        if emitter is None:
            bb.emit_normalized(binding)
            continue
        value = bb.normalize(emitter(bb))
        if not _same_type(value.ty, binding.var.ty):
            raise ValueError(f"replacement of {binding.var.name} has type {value.ty}, "
                             f"expected {binding.var.ty}")
        bb.emit_normalized(relax.VarBinding(binding.var, value))


def _same_type(a, b) -> bool:
    from tvm_ffi import structural_equal

    return bool(structural_equal(a, b))


__all__ = ["ACTIVATIONS", "OpNode", "Subprogram", "Split", "split_function", "split_module",
           "rebuild_function", "without_new_symbols"]
