"""Self-check of the canonical operator expressions: the foundation every rewrite stands on.

Each Relax operator with a canonical expression is built alone with stock TVM and run on
random inputs; its expression (translated from the very same Relax call) is evaluated by the
numpy interpreter on those inputs and the two are compared with the dtype's tolerance.
Operators that are not Relax ops (G2BMM, GBMM, dense with a transposed weight, bias add) are
compared with plain numpy references written independently of the expression IR.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from ..expr import canonical as C
from ..expr.expression import Expr, Tensor
from ..expr.interpreter import evaluate
from .inputs import draw, random_array
from .random_testing import TestResult, compare_arrays


@dataclass(frozen=True)
class OperatorCheck:
    """One canonical expression against its reference ("TVM" or "numpy")."""

    name: str
    reference: str
    result: TestResult




def _relax_cases():
    """(name, Relax call builder over the parameters, parameter shapes) per case."""
    from tvm import relax

    nn, op = relax.op.nn, relax.op
    return (
        ("conv2d 3x3 pad 1", lambda x, w: nn.conv2d(x, w, padding=1),
         ((1, 4, 6, 6), (5, 4, 3, 3))),
        ("conv2d stride 2, asymmetric pad", lambda x, w: nn.conv2d(x, w, strides=2,
                                                                   padding=(1, 0, 2, 1)),
         ((1, 3, 7, 8), (4, 3, 3, 3))),
        ("conv2d dilation 2, groups 2", lambda x, w: nn.conv2d(x, w, dilation=2, padding=2,
                                                               groups=2),
         ((1, 4, 7, 7), (6, 2, 3, 3))),
        ("conv2d NHWC/HWIO", lambda x, w: nn.conv2d(x, w, padding=1, data_layout="NHWC",
                                                    kernel_layout="HWIO"),
         ((1, 6, 6, 4), (3, 3, 4, 5))),
        ("conv2d_transpose stride 2", lambda x, w: nn.conv2d_transpose(
            x, w, strides=2, padding=1, output_padding=1), ((1, 4, 4, 4), (4, 3, 3, 3))),
        ("matmul with batch broadcast", lambda a, b: op.matmul(a, b),
         ((2, 1, 3, 4), (3, 4, 5))),
        ("permute_dims", lambda a: op.permute_dims(a, (2, 0, 1)), ((2, 3, 4),)),
        ("reshape", lambda a: op.reshape(a, (4, 6)), ((2, 3, 4),)),
        ("add (broadcast)", lambda a, b: op.add(a, b), ((2, 3, 4), (3, 1))),
        ("subtract", lambda a, b: op.subtract(a, b), ((2, 3), (2, 3))),
        ("multiply (broadcast)", lambda a, b: op.multiply(a, b), ((2, 3, 4), (4,))),
        ("relu", lambda a: nn.relu(a), ((3, 5),)),
    )


def check_relax_op(name: str, make_call: Callable, shapes: Sequence[Tuple[int, ...]],
                   seed: int = 0, trials: int = 2) -> OperatorCheck:
    """Build one Relax op with TVM and compare it with its canonical expression."""
    import tvm
    from tvm import relax

    from ..expr.from_relax import expr_of_call, single_op_module

    mod, call = single_op_module(make_call, shapes)
    names = [f"x{k}" for k in range(len(shapes))]
    expr = expr_of_call(call, names)
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    pairs = []
    for trial in range(trials):
        rng = np.random.default_rng(seed + trial)
        arrays = [random_array(rng, s, "float32") for s in shapes]
        ref = vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()
        pairs.append((f"trial {trial}", evaluate(expr, dict(zip(names, arrays))), ref))
    return OperatorCheck(name, "TVM", compare_arrays(pairs, expr.dtype, str(expr), trials))


def _numpy_cases() -> Tuple[Tuple[str, Expr, Callable[[Dict[str, np.ndarray]], np.ndarray]], ...]:
    a3, b3 = Tensor("A", (2, 9, 4)), Tensor("B", (2, 9, 4))
    band = Tensor("A", (2, 9, 5))
    x, w = Tensor("X", (3, 4)), Tensor("W", (5, 4))
    data, bias = Tensor("D", (1, 3, 2, 2)), Tensor("b", (3,))
    return (
        ("g2bmm width 2 dilation 2", C.g2bmm(a3, b3, 2, 2),
         lambda v: C.g2bmm_reference(v["A"], v["B"], 2, 2)),
        ("gbmm width 2 dilation 1", C.gbmm(band, b3, 2, 1),
         lambda v: C.gbmm_reference(v["A"], v["B"], 2, 1)),
        ("dense (transposed weight)", C.matmul(x, w, transpose_b=True),
         lambda v: v["X"].astype(np.float64) @ v["W"].astype(np.float64).T),
        ("bias_add axis 1", C.bias_add(data, bias, axis=1),
         lambda v: v["D"] + v["b"][None, :, None, None]),
    )


def check_numpy_case(name: str, expr: Expr, reference, seed: int = 0,
                     trials: int = 2) -> OperatorCheck:
    from ..expr.expression import input_tensors

    pairs = []
    for trial in range(trials):
        inputs = draw(input_tensors(expr), seed + trial)
        pairs.append((f"trial {trial}", evaluate(expr, inputs), reference(inputs)))
    return OperatorCheck(name, "numpy", compare_arrays(pairs, expr.dtype, str(expr), trials))


def run_selfcheck(seed: int = 0) -> List[OperatorCheck]:
    """Every canonical operator expression against TVM or numpy."""
    checks = [check_relax_op(name, make, shapes, seed) for name, make, shapes in _relax_cases()]
    checks += [check_numpy_case(name, e, ref, seed) for name, e, ref in _numpy_cases()]
    return checks


__all__ = ["OperatorCheck", "check_relax_op", "check_numpy_case", "run_selfcheck"]
