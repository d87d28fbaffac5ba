"""Our legalisations of Relax operators, where TVM's own computes more than it needs to.

`LEGALIZE` maps an operator to a function `(BlockBuilder, Call) -> Expr` for
`relax.transform.LegalizeOps(customize_legalize_map=LEGALIZE)` (`fusion.prepare` uses it);
every operator not in it keeps TVM's legalisation.

softmax: one reciprocal per row instead of one division per element
--------------------------------------------------------------------
TVM's `topi.nn.softmax` normalises with `exp(x - max) / sum` per element. A vector division
costs about a fifth of the vectorised exponential beside it (Zen 1: a ymm `vdivps` every ~6
cycles; the exp polynomial ~35), so here each element is multiplied by the row's reciprocal,
`e * (1 / sum)`, and the division runs once per row (measured: 12x128x128, 330 -> 300 us).

Why it is correct: the four stages are topi's (maximum, exponentials, their sum, the
normalised row), only the last differs. For a row without NaN, sum >= 1 (the term at the
maximum is exp(0) = 1, the others are >= 0) and sum <= n, so 1/sum is a normal number:
no overflow, no underflow. Then e * RN(1/sum) differs from RN(e / sum) by at most 1.5 ulp
(two roundings of relative error 2^-24 each, e <= 1), within every tolerance the package's
checks use for float32. Rows with NaN or infinities give NaN in both forms (the maximum or
x - max is NaN). The tests compare with numpy in float64 on random rows and with TVM's
legalisation on rows holding inf and NaN.
"""
from __future__ import annotations

from typing import Callable, Dict

import tvm
from tvm import relax, te

LegalizeFunc = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]


def softmax_reciprocal(x: te.Tensor, axis: int = -1) -> te.Tensor:
    """softmax(x) along `axis` as topi computes it, normalised by a reciprocal per row."""
    ndim = len(x.shape)
    axis = axis + ndim if axis < 0 else axis

    def row(index: tuple) -> tuple:  # the index of an element's row (axis removed)
        return index[:axis] + index[axis + 1:]

    def at(rest: tuple, k) -> tuple:  # element k of row `rest`
        return rest[:axis] + (k,) + rest[axis:]

    rows = x.shape[:axis] + x.shape[axis + 1:]
    k = te.reduce_axis((0, x.shape[axis]), name="k")
    maxelem = te.compute(rows, lambda *r: te.max(x[at(r, k)], axis=k), name="T_softmax_maxelem")
    exp = te.compute(x.shape, lambda *i: te.exp(x[i] - maxelem[row(i)]), name="T_softmax_exp")
    k2 = te.reduce_axis((0, x.shape[axis]), name="k")
    expsum = te.compute(rows, lambda *r: te.sum(exp[at(r, k2)], axis=k2),
                        name="T_softmax_expsum")
    one = tvm.tirx.const(1.0, x.dtype)
    return te.compute(x.shape, lambda *i: exp[i] * (one / expsum[row(i)]),
                      name="T_softmax_norm", attrs={"axis": axis})


def _softmax(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    return bb.call_te(softmax_reciprocal, call.args[0], int(call.attrs.axis),
                      primfunc_name_hint="softmax")


LEGALIZE: Dict[str, LegalizeFunc] = {
    "relax.nn.softmax": _softmax,
}


def legalize_ops() -> tvm.transform.Pass:
    """TVM's LegalizeOps with the operators of `LEGALIZE` legalised our way."""
    return relax.transform.LegalizeOps(customize_legalize_map=LEGALIZE)
