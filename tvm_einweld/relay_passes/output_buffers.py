"""BindOutputs: a function's results written into buffers its caller passes (destination passing,
onnxruntime's "IO binding" for a Relax VM function).

What it rewrites
----------------
For a Relax function (by default `main`) whose every result is a tensor computed by one
`R.call_tir` with a single tensor output (the form the einweld pipeline leaves, and any module
after FuseTIR), each result gets a parameter `out{i}` of its exact type, inserted after the
function's runtime inputs (`num_input` grows by as many), and its call becomes
`R.call_tir_inplace(kernel, (*args, out{i}), inplace_indices=[len(args)])`: the same kernel
with the same arguments, its output buffer the caller's instead of one the VM allocates.
The function still returns its results (now the caller's buffers). Called as
`vm["main"](x, out)` with `out = tvm.runtime.empty(shape, dtype)` made once, a steady-state
loop allocates nothing and writes to the same (cache-resident) memory at every call.

Why: the Relax VM keeps a reference to the last value a function returned until its next
call returns, so every call allocates a fresh output while the previous one is alive: two
buffers alternate, and a kernel whose inputs and outputs fit the caches writes half its
traffic to lines another call evicted (a 128x3072 bias add: 25 us into a reused buffer, 36 us
into alternating ones, on the Intel Xeon of session 35). onnxruntime's IO binding gives its
sessions the reused buffer; this gives a compiled module the same.

Why it is correct
-----------------
`call_tir`'s kernel writes every element of its output parameter and reads it nowhere before
(destination-passing style: the output is write-only, which is why the VM may hand it any
uninitialised buffer); passing the caller's buffer in that position computes the same values
into it. `call_tir_inplace` with the new argument at index len(args) calls the same PrimFunc
with the same argument list (the output is its last parameter in both forms). The caller must
not pass as an output a buffer that is also an input or another output (an alias), as with any
destination-passing API; nothing else reads the output buffer before the call writes it.
A function whose result is anything else (an input returned unchanged, a tuple output of a
kernel, a packed call, a symbolic shape) is not rewritten: `BindOutputs` raises
`UnboundOutput`, naming the result, instead of returning a function with a different
calling convention for some outputs only.
"""
from __future__ import annotations

from typing import Dict, List

import tvm
from tvm import relax

from ..expr.from_relax import UnsupportedOperator, static_shape

CALL_TIR = tvm.ir.Op.get("relax.call_tir")


class UnboundOutput(ValueError):
    """A result `BindOutputs` cannot write into a caller's buffer."""


def _results(body: relax.Expr) -> List[relax.Expr]:
    return list(body.fields) if isinstance(body, relax.Tuple) else [body]


def bind_outputs(func: relax.Function, name: str = "main") -> relax.Function:
    """`func` with its results written into caller-passed buffers (see the module docstring);
    raises `UnboundOutput` when one cannot be."""
    return _bind(func, name)[0]


def _bind(func: relax.Function, name: str) -> tuple[relax.Function, List[relax.Var]]:
    """`bind_outputs`, and the new parameters in order."""
    if not isinstance(func.body, relax.SeqExpr):
        raise UnboundOutput(f"{name}: its body is not a sequence of bindings")
    results = _results(func.body.body)
    bindings: Dict[relax.Var, relax.VarBinding] = {
        b.var: b for block in func.body.blocks for b in block.bindings}
    num_input = func.attrs["num_input"] if func.attrs and "num_input" in func.attrs else \
        len(func.params)
    num_input = int(num_input)
    outs: Dict[relax.Var, relax.Var] = {}  # the var a kernel's call binds -> its buffer
    for i, result in enumerate(results):
        var, binding = result, None
        while isinstance(var, relax.Var) and var in bindings:  # through `gv = lv` aliases
            binding = bindings[var]
            if not isinstance(binding.value, relax.Var):
                break
            var = binding.value
        call = binding.value if binding is not None else None
        try:
            static_shape(result)
            kernel = (isinstance(call, relax.Call) and call.op.same_as(CALL_TIR)
                      and len(call.ty_args) == 1 and isinstance(call.ty_args[0], relax.TensorType))
        except UnsupportedOperator:
            kernel = False
        if not kernel:
            raise UnboundOutput(f"{name}: result {i} ({result}) is not a tensor of static shape "
                                "computed by one kernel (R.call_tir); its buffer cannot be "
                                "passed by the caller")
        if binding.var in outs:
            raise UnboundOutput(f"{name}: result {i} ({result}) is returned twice")
        outs[binding.var] = relax.Var(f"out{i}", result.ty)

    def rewrite(binding: relax.VarBinding) -> relax.VarBinding:
        if binding.var not in outs:
            return binding
        call = binding.value
        gvar, args = call.args[0], list(call.args[1].fields)
        new = relax.call_tir_inplace(gvar, relax.Tuple(args + [outs[binding.var]]),
                                     [len(args)], call.ty_args[0])
        return relax.VarBinding(binding.var, new)

    blocks = []
    for block in func.body.blocks:
        rewritten = [rewrite(b) for b in block.bindings]
        blocks.append(relax.DataflowBlock(rewritten) if isinstance(block, relax.DataflowBlock)
                      else relax.BindingBlock(rewritten))
    params = list(func.params)
    params = params[:num_input] + list(outs.values()) + params[num_input:]
    body = relax.SeqExpr(blocks, func.body.body)
    new = relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs)
    if func.attrs and "num_input" in func.attrs:
        new = new.with_attr("num_input", num_input + len(outs))
    return new, list(outs.values())


@tvm.transform.module_pass(opt_level=0, name="BindOutputs")
class BindOutputs:
    """Module pass: `bind_outputs` on the functions named (default: `main`). Place it after the
    kernels are formed (after `EinweldOptimize`, or after FuseTIR in a stock pipeline) and
    before the VM lowering that allocates outputs (`relax.pipeline.default_build_pipeline`)."""

    def __init__(self, functions: tuple[str, ...] = ("main",)) -> None:
        self.functions = tuple(functions)
        # Per function, the (shape, dtype) of each buffer it now takes, in parameter order:
        # what a caller allocates.
        self.outputs: Dict[str, List[tuple[tuple[int, ...], str]]] = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # a pass leaves its input as it was
        for name in self.functions:
            if name not in [gv.name_hint for gv in mod.get_global_vars()]:
                raise UnboundOutput(f"the module has no function {name!r}")
            bound, buffers = _bind(mod[name], name)
            mod.update_func(mod.get_global_var(name), bound)
            self.outputs[name] = [(static_shape(b), str(b.ty.dtype)) for b in buffers]
        return mod
