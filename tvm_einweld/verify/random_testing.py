"""Random-input testing of rewrites, as TASO does (§4.2).

Two expressions (or two Relax functions) are evaluated on the same random inputs, uniform in
[-1, 1], and compared with a tolerance chosen from the dtype. Functions that can mask a
difference (relu is 0 on half of the inputs, tanh and sigmoid flatten out) are replaced by
polynomials on both sides, x·(x+1)+1 for relu as in TASO and a different one per function
(`stand_ins.py`): a rewrite that is correct for every function stays correct for those, and
a polynomial shows every difference.

Comparison is normwise: a trial passes when max|a-b| ≤ atol + rtol·max|b|. Element-wise
relative error is meaningless for outputs near zero, which sums with cancellation produce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..expr.expression import Expr
from ..expr.interpreter import EvaluationError, evaluate
from .inputs import draw, random_array, shape_mismatch, shared_tensors
from .stand_ins import STAND_IN_OFFSETS, Arithmetizer

# dtype -> (rtol, atol). Real-mode interpretation runs in float64 whatever the dtype; the
# tolerance is that of the dtype the model computes in, which is what a rewrite must respect.
TOLERANCES: Dict[str, Tuple[float, float]] = {
    "float16": (1e-2, 1e-3),
    "bfloat16": (3e-2, 1e-2),
    "float32": (1e-4, 1e-5),
    "float64": (1e-9, 1e-12),
}


def tolerance_for(dtype: str) -> Tuple[float, float]:
    """(rtol, atol) for a dtype; integer dtypes compare exactly."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if dtype.startswith(("int", "uint", "bool")):
        return 0.0, 0.0
    raise ValueError(f"no comparison tolerance known for dtype {dtype!r}")


@dataclass(frozen=True)
class TestResult:
    """Outcome of comparing two computations on random inputs.

    `max_rel_error` is normwise: max|a-b| / max|b| over the worst trial. `tolerance` is the
    relative tolerance (rtol) the errors were held to.
    """

    __test__ = False  # not a pytest test class, despite the name

    equal: bool
    what: str
    trials: int
    max_abs_error: float
    max_rel_error: float
    tolerance: float

    def __str__(self) -> str:
        verdict = "equal" if self.equal else "NOT equal"
        return (f"{verdict}: {self.what} ({self.trials} trials, max abs err "
                f"{self.max_abs_error:.3g}, rel {self.max_rel_error:.3g}, rtol {self.tolerance:g})")


def compare_arrays(
    pairs: Sequence[Tuple[str, np.ndarray, np.ndarray]],
    dtype: str,
    what: str,
    trials: int = 1,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
) -> TestResult:
    """Compare (label, got, reference) array pairs with the tolerance of `dtype`.

    Non-finite values must sit at the same places with the same values; the finite rest is
    compared normwise. `what` is prefixed with the first failing pair.
    """
    rtol, atol = _tolerances(dtype, rtol, atol)
    abs_err = rel_err = 0.0
    failure = ""
    for label, got, ref in pairs:
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        if got.shape != ref.shape:
            failure = failure or f"{label}: shapes {list(got.shape)} vs {list(ref.shape)}"
            abs_err = rel_err = float("inf")
            continue
        bad = ~np.isfinite(got)
        if not np.array_equal(bad, ~np.isfinite(ref)) or \
                not np.array_equal(got[bad], ref[bad], equal_nan=True):
            failure = failure or f"{label}: non-finite values differ"
            abs_err = rel_err = float("inf")
            continue
        if bad.all():
            continue
        err = float(np.max(np.abs(got[~bad] - ref[~bad])))
        scale = float(np.max(np.abs(ref[~bad])))
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
        if err > atol + rtol * scale:
            failure = failure or (f"{label}: max abs error {err:.3g} exceeds "
                                  f"{atol:g} + {rtol:g}·{scale:.3g}")
    if failure:
        what = f"{failure}; {what}"
    return TestResult(not failure, what, trials, abs_err, rel_err, rtol)


def _tolerances(dtype: str, rtol: Optional[float], atol: Optional[float]) -> Tuple[float, float]:
    default_rtol, default_atol = tolerance_for(dtype)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def compare_expressions(
    a: Expr,
    b: Expr,
    trials: int = 3,
    seed: int = 0,
    polynomial_nonlinear: bool = True,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
) -> TestResult:
    """Evaluate `a` and `b` with the numpy interpreter on `trials` shared random inputs."""
    rtol, atol = _tolerances(a.dtype, rtol, atol)
    what = f"{a}  vs  {b}"

    def failed(why: str) -> TestResult:
        return TestResult(False, f"{why} ({what})", 0, float("inf"), float("inf"), rtol)

    mismatch = shape_mismatch(a, b)
    if a.dtype != b.dtype:
        mismatch = mismatch or f"dtypes differ: {a.dtype} vs {b.dtype}"
    tensors, why = shared_tensors(a, b)
    if mismatch or tensors is None:
        return failed(mismatch or why)
    stand_ins = Arithmetizer() if polynomial_nonlinear else None
    if stand_ins is not None:
        a, b = stand_ins.expr(a), stand_ins.expr(b)
    pairs = []
    for trial in range(trials):
        inputs = draw(tensors, seed + trial)
        if stand_ins is not None:
            inputs.update(stand_ins.arrays(seed + trial))
        try:
            pairs.append((f"trial {trial}", evaluate(a, inputs), evaluate(b, inputs)))
        except EvaluationError as err:
            return failed(f"evaluation failed: {err}")
    return compare_arrays(pairs, a.dtype, what, trials, rtol, atol)


# --- Relax ------------------------------------------------------------------------------------

# Relax ops replaced by their expression functions' stand-ins x·(x+k)+1 (element-wise).
NONLINEAR_OPS = {"relax.nn.relu": "relu", "relax.tanh": "tanh", "relax.sigmoid": "sigmoid",
                 "relax.exp": "exp"}


def replace_nonlinear_ops(mod):
    """A copy of `mod` with every relu/tanh/sigmoid/exp call replaced by x·(x+k)+1."""
    from tvm import relax

    @relax.expr_functor.mutator
    class _Replace(relax.PyExprMutator):
        def visit_call_(self, call):  # pylint: disable=arguments-renamed
            call = super().visit_call_(call)
            op = getattr(call.op, "name", None)
            if op not in NONLINEAR_OPS:
                return call
            x = call.args[0]
            dtype = x.ty.dtype
            k = relax.const(STAND_IN_OFFSETS[NONLINEAR_OPS[op]], dtype)
            one = relax.const(1, dtype)
            return relax.op.add(relax.op.multiply(x, relax.op.add(x, k)), one)

    mutator = _Replace(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def compare_relax(
    mod_a,
    mod_b,
    func_name: str = "main",
    trials: int = 3,
    seed: int = 0,
    replace_nonlinear: bool = True,
    target: str = "llvm",
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    extra_inputs: Sequence = (),
) -> TestResult:
    """Build both modules with `tvm.compile`, run `func_name` on shared random inputs.

    The functions must take the same parameters (static shapes and dtypes); every output
    (tuples are flattened) is compared with the tolerance of its dtype. `extra_inputs`
    (`module_check.InputSet`s) are run after the `trials` random draws.
    """
    # module_check imports this module, so it is imported here
    from .module_check import InputSet, build_modules, compare_compiled, signature

    sig_a, sig_b = signature(mod_a, func_name), signature(mod_b, func_name)
    what = f"Relax function {func_name!r} of two modules on {target}"
    if sig_a != sig_b:
        return TestResult(False, f"parameters differ: {sig_a} vs {sig_b} ({what})", 0,
                          float("inf"), float("inf"), 0.0)
    if replace_nonlinear:
        mod_a, mod_b = replace_nonlinear_ops(mod_a), replace_nonlinear_ops(mod_b)
        what += ", relu/tanh/sigmoid/exp replaced by polynomials"
    sets = []
    for trial in range(trials):
        rng = np.random.default_rng(seed + trial)
        sets.append(InputSet(f"trial {trial}",
                             tuple(random_array(rng, shape, dtype) for shape, dtype in sig_a)))
    sets += list(extra_inputs)
    got, ref = build_modules([mod_a, mod_b], target, func_name)
    return compare_compiled(got, ref, sets, what, rtol, atol)

__all__ = ["TestResult", "compare_expressions", "compare_relax", "compare_arrays",
           "replace_nonlinear_ops", "tolerance_for", "TOLERANCES", "NONLINEAR_OPS"]
