"""`python -m tvm_einweld demo`: the main job on a built-in model.

For every operator of the built-in model it prints the tensor-algebra expression, its
fingerprint, and the evidence that the expression is right: the expression, evaluated by the
numpy interpreter and by its own TE lowering, against TVM's build of the operator on random
inputs.
"""
from __future__ import annotations

import argparse
import time
from typing import List, Tuple

import numpy as np

HELP = "run the main job on a built-in model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def builtin_model(channels: int = 16, size: int = 14):
    """A small CNN block: conv3x3 + bias → relu → conv1x1 → reshape → matmul head."""
    import tvm
    from tvm import relax

    rng = np.random.default_rng(0)

    def const(*shape):
        return relax.const(rng.uniform(-0.5, 0.5, shape).astype("float32"))

    bb = relax.BlockBuilder()
    x = relax.Var("data", relax.TensorType((1, channels, size, size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            c1 = bb.emit(relax.op.nn.conv2d(x, const(channels, channels, 3, 3), padding=1))
            b1 = bb.emit(relax.op.add(c1, const(1, channels, 1, 1)))
            r1 = bb.emit(relax.op.nn.relu(b1))
            c2 = bb.emit(relax.op.nn.conv2d(r1, const(8, channels, 1, 1)))
            flat = bb.emit(relax.op.reshape(c2, (1, 8 * size * size)))
            head = bb.emit(relax.op.matmul(flat, const(8 * size * size, 10)))
            out = bb.emit_output(head)
        bb.emit_func_output(out)
    return bb.get()


def operator_calls(mod) -> List[Tuple[str, object, List[str]]]:
    """(binding name, call, argument names) for every operator call in `main`."""
    from tvm import relax

    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, __import__("tvm").ir.Op):
                names = [a.name if isinstance(a, relax.Var) else f"const{k}"
                         for k, a in enumerate(value.args) if isinstance(a.ty, relax.TensorType)]
                found.append((binding.var.name, value, names))
    return found


def _tvm_reference(call, inputs):
    """Build the single operator with stock TVM and run it."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{k}", relax.TensorType(a.shape, "float32")) for k, a in enumerate(inputs)]
    with bb.function("main", params):
        args = list(params) + list(call.args)[len(params):]
        out = bb.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), "llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


def run(args: argparse.Namespace) -> int:
    from tvm_einweld.expr import describe, evaluate, random_inputs
    from tvm_einweld.expr.fingerprint import fingerprint
    from tvm_einweld.expr.from_relax import UnsupportedOperator, expr_of_call, op_name
    from tvm_einweld.expr.lowering import build

    mod = builtin_model()
    print("Built-in model: conv3x3+bias → relu → conv1x1 → reshape → matmul (1×16×14×14)\n")
    failures = 0
    for var, call, names in operator_calls(mod):
        print(f"── {var} = {op_name(call)}")
        try:
            expr = expr_of_call(call, names)
        except UnsupportedOperator as err:
            print(f"   left to stock TVM: {err}\n")
            continue
        print("   " + describe(expr).replace("\n", "\n   "))
        print(f"   fingerprint: {fingerprint(expr)}")
        inputs = random_inputs(expr, seed=args.seed)
        start = time.perf_counter()
        value = evaluate(expr, inputs)
        interp_s = time.perf_counter() - start
        reference = _tvm_reference(call, [inputs[n] for n in names])
        lowered, order = build(expr)
        lowered_value = lowered(*[inputs[n] for n in order])
        err_ref = float(np.max(np.abs(value - reference)))
        err_low = float(np.max(np.abs(lowered_value - value)))
        ok = err_ref <= 1e-4 * max(1.0, float(np.max(np.abs(reference)))) and err_low <= 1e-3
        failures += not ok
        print(f"   verified: {'OK' if ok else 'FAILED'} — interpreter vs TVM build max |err| "
              f"{err_ref:.2e}, TE lowering vs interpreter {err_low:.2e} "
              f"(interpreter {interp_s * 1e3:.0f} ms)\n")
    print("all operators verified" if not failures else f"{failures} operator(s) FAILED verification")
    return 1 if failures else 0
