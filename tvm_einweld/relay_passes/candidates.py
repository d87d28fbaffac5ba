"""Candidate programs of `DerivationTransform`: what an operator may be replaced by, and the
modules in which a candidate is costed and checked.

A candidate is a `Program`: its kernels with their costs (`op_cost.program_kernels`) and an
`Emit`, a function that emits the replacement into a `relax.BlockBuilder` from the values of
the tensors the operator reads (by their names in the operator's canonical expression). The
emitters here are

* `original_emit`: the operator's own call, rebuilt on the given values;
* `gemm_emit`: numpy's BLAS for a matmul (`numpy_gemm.py`);
* `derived_emit`: a derived expression, instantiated (`instantiate.py`), matched matmuls
  taking the faster provider when `providers` names a target (`provider_builder`);
* `merged_emits`: the two halves of an inter-expression merge, sharing one instantiation;
* `winograd_emit`: a stride-1 convolution by Winograd minimal filtering (`winograd.py`).

`subprogram_module` puts a subprogram (or one operator) into a module of its own, with an
emitter per operator, and `subprogram_inputs` says which values become its parameters.

Why it is correct: an emitter only reads the values it is given and emits one expression;
`original_emit` rebuilds the very call (same operator, attributes and type arguments) on the
same values, and `subprogram_module` binds every value the operators read to a parameter of
the same type (constants stay constants unless `constants_as_params`), so the module computes
what the operators compute in their function. Whether a derived or merged candidate computes
the same is not assumed here: the pass checks it on this module (`DerivationTransform`).

The result types (`Program`, `OpResult`, `SubprogramResult`) are what the pass reports per
operator and per subprogram; `SubprogramResult.to_json` is the `derive --json` record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import tvm
from tvm import relax
from tvm.ir.expr import Constant

from ..expr.expression import Expr
from ..verify.smt import ProofResult
from . import numpy_gemm
from .inter_expression import Merged
from .op_cost import Kernel, program_seconds
from .search import SearchStats
from .subprograms import OpNode, Subprogram, without_new_symbols

Values = Mapping[str, relax.Expr]
Emit = Callable[[relax.BlockBuilder, Values], relax.Expr]
# The target on which instantiated matmuls take the faster provider, or None (no providers).
Providers = Optional[Union[str, tvm.target.Target]]


@dataclass(frozen=True)
class Program:
    """One candidate replacement of an operator and its cost."""

    label: str  # "original", "numpy_gemm", "derived", "merged", "winograd"
    kernels: Tuple[Kernel, ...]
    emit: Emit = field(compare=False, repr=False)
    rules: Tuple[str, ...] = ()
    steps: Tuple[str, ...] = ()  # the derivations, described
    proofs: Tuple[ProofResult, ...] = field(default=(), compare=False, repr=False)

    @property
    def seconds(self) -> float:
        return program_seconds(self.kernels)

    @property
    def ops(self) -> Tuple[str, ...]:
        return tuple(k.name for k in self.kernels)


@dataclass(frozen=True)
class OpResult:
    """An operator's candidates (the original first), the chosen one, the search statistics."""

    op: OpNode
    candidates: Tuple[Program, ...]
    chosen: Program
    stats: Optional[SearchStats]
    notes: Tuple[str, ...] = ()
    # (depth, roofline estimate in seconds, rules) of the search's best state per depth
    best_per_depth: Tuple[Tuple[int, float, Tuple[str, ...]], ...] = ()
    tried: Tuple[Program, ...] = ()  # rewrites already verified and timed

    @property
    def original(self) -> Program:
        return self.candidates[0]


@dataclass(frozen=True)
class SubprogramResult:
    """What the pass found and did for one subprogram."""

    subprogram: Subprogram
    ops: Tuple[OpResult, ...]
    applied: bool
    verified: bool
    verification: str
    measured_before_s: Optional[float] = None
    measured_after_s: Optional[float] = None

    @property
    def orig_time_s(self) -> float:
        return sum(o.original.seconds for o in self.ops)

    @property
    def est_time_s(self) -> float:
        return sum(o.chosen.seconds for o in self.ops)

    def to_json(self, detail: bool = False) -> dict:
        """The `derive --json` record (EinNet issue schema); `detail` adds the evidence."""
        stats = [o.stats for o in self.ops if o.stats is not None]
        out = {
            "ops": list(self.subprogram.kinds),
            "chosen": {
                "ops": [name for o in self.ops for name in o.chosen.ops],
                "rules": [r for o in self.ops for r in o.chosen.rules],
                "verified": self.verified,
                "orig_time_s": self.orig_time_s,
                "est_time_s": self.est_time_s,
            },
            "candidates": sum(len(o.candidates) for o in self.ops),
            "stats": {
                "states": sum(s.states for s in stats),
                "pruned": sum(s.pruned for s in stats),
                "seconds": sum(s.seconds for s in stats),
            },
        }
        if detail:
            out["function"] = self.subprogram.function
            out["index"] = self.subprogram.index
            out["applied"] = self.applied
            out["verification"] = self.verification
            out["proofs"] = [str(p) for o in self.ops for p in o.chosen.proofs]
            out["derivations"] = [d for o in self.ops for d in o.chosen.steps]
            out["measured_before_s"] = self.measured_before_s
            out["measured_after_s"] = self.measured_after_s
            out["notes"] = [n for o in self.ops for n in o.notes]
        return out


# --- emitters ---------------------------------------------------------------------------------

def original_emit(op: OpNode) -> Emit:
    """The operator's own call on the given values (its non-tensor arguments kept)."""

    def emit(bb: relax.BlockBuilder, values: Values) -> relax.Expr:
        args, names = [], iter(op.names)
        for arg in op.call.args:
            if isinstance(getattr(arg, "ty", None), relax.TensorType):
                args.append(values[next(names)])
            else:
                args.append(arg)
        return relax.Call(op.call.op, args, op.call.attrs, list(op.call.ty_args))

    return emit


def merged_emits(merged: Merged, providers: Providers) -> Tuple[Emit, Emit]:
    """Emitters of a merged pair: the first emits the merged operator and its window, the
    second (emitted later into the same builder) reuses it for its own window."""
    from .instantiate import Instantiator

    shared: Dict[str, object] = {"bb": None, "inst": None}

    def instantiator(bb: relax.BlockBuilder, values: Values):
        if shared["bb"] is not bb:
            shared["bb"] = bb
            shared["inst"] = Instantiator(provider_builder(bb, providers), dict(values))
        return shared["inst"]

    def first(bb: relax.BlockBuilder, values: Values) -> relax.Expr:
        return instantiator(bb, values).output(merged.results[0])

    def second(bb: relax.BlockBuilder, values: Values) -> relax.Expr:
        return instantiator(bb, values).output(merged.results[1])

    return first, second


def gemm_emit(op: OpNode) -> Emit:
    """numpy's BLAS (`numpy_gemm.matmul_call`) for a matmul operator."""
    a, b = op.names

    def emit(bb: relax.BlockBuilder, values: Values) -> relax.Expr:
        return numpy_gemm.matmul_call(values[a], values[b])

    return emit


def winograd_emit(op: OpNode, plan) -> Emit:
    """The Winograd form (`winograd.emit`, `plan` from `winograd.plans`) of a conv2d operator
    on the given data and weights."""
    data, weight = op.names

    def emit(bb: relax.BlockBuilder, values: Values) -> relax.Expr:
        from . import winograd

        return winograd.emit(bb, values[data], values[weight], plan)

    return emit


def provider_builder(bb: relax.BlockBuilder, providers: Providers
                     ) -> Union[relax.BlockBuilder, numpy_gemm.ProviderBuilder]:
    """`bb`, or (with a target in `providers`) a builder that emits matched matmuls with the
    provider that measures faster there."""
    return bb if providers is None else numpy_gemm.ProviderBuilder(bb, providers)


def derived_emit(expr: Expr, providers: Providers) -> Emit:
    """`expr` instantiated (`instantiate.Instantiator`) on the given values."""

    def emit(bb: relax.BlockBuilder, values: Values) -> relax.Expr:
        from .instantiate import Instantiator

        return Instantiator(provider_builder(bb, providers), dict(values)).output(expr)

    return emit


def subprogram_inputs(ops: Sequence[OpNode], constants_as_params: bool = False
                      ) -> List[relax.Expr]:
    """The values `subprogram_module` turns into parameters, in parameter order: the variables
    the operators read but do not define, and (with `constants_as_params`) their constants."""
    defined = {op.var for op in ops}
    inputs: List[relax.Expr] = []
    for op in ops:
        for arg in op.args:
            is_input = isinstance(arg, relax.Var) and arg not in defined or \
                (constants_as_params and isinstance(arg, Constant))
            if is_input and all(arg is not seen for seen in inputs):
                inputs.append(arg)
    return inputs


def subprogram_module(ops: Sequence[OpNode], emits: Optional[Sequence[Emit]] = None,
                      constants_as_params: bool = False) -> tvm.IRModule:
    """A module whose `main` computes `ops` (a subprogram, or one operator) and returns every
    result; the variables they read become parameters, constants stay constants (or become
    parameters too with `constants_as_params`, so that a check can draw them at random as
    well as pass their own values). `emits[k]` replaces operator k's call."""
    bb = relax.BlockBuilder()
    values: Dict[relax.Expr, relax.Expr] = {}
    params: List[relax.Var] = []
    defined = {op.var for op in ops}
    for arg in subprogram_inputs(ops, constants_as_params):
        name = arg.name if isinstance(arg, relax.Var) else f"const{len(params)}"
        values[arg] = relax.Var(name, arg.ty)
        params.append(values[arg])
    # Emitters see every tensor name of the subprogram that is available (a merged pair reads
    # its partner's inputs); results become available as their operators are emitted.
    named = {n: values.get(a, a) for op in ops for n, a in zip(op.names, op.args)
             if a not in defined}
    result_names = {a: n for op in ops for n, a in zip(op.names, op.args) if a in defined}
    with bb.function("main", params):
        with bb.dataflow():
            outs = []
            for k, op in enumerate(ops):
                emit = emits[k] if emits is not None else original_emit(op)
                var = bb.emit(emit(bb, named))
                values[op.var] = var
                if op.var in result_names:
                    named[result_names[op.var]] = var
                outs.append(var)
            out = bb.emit_output(outs[0] if len(outs) == 1 else relax.Tuple(outs))
        bb.emit_func_output(out)
    return without_new_symbols(bb.get())


def unchanged_result(sub: Subprogram, why: str) -> SubprogramResult:
    """The result of a subprogram the pass could not work on: its operators kept, untimed."""
    ops = []
    for op in sub.ops:
        original = Program("original", (Kernel(op.kind, 0.0, False),), original_emit(op))
        ops.append(OpResult(op, (original,), original, None, (why,)))
    return SubprogramResult(sub, tuple(ops), False, False, why)


__all__ = ["Values", "Emit", "Providers", "Program", "OpResult", "SubprogramResult", "original_emit",
           "merged_emits", "gemm_emit", "provider_builder", "derived_emit", "subprogram_inputs",
           "subprogram_module", "unchanged_result"]
