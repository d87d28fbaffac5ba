"""Vectorisable float32 `exp`, `erf`, `tanh` and `sigmoid` for the CPU: a TIR pass that rewrites
those calls into +, -, *, /, min, max, floor, select and integer bit operations; and float32
division by a constant, or by a value the vector lanes share, as a multiplication.

Why: LLVM lowers `tirx.exp/erf/tanh` to calls of libm's `expf/erff/tanhf`; a vector of them
becomes one scalar call per lane, which keeps GELU, softmax and sigmoid kernels at a few percent
of the memory bandwidth even when the loop around them is vectorised. The formulas below use only
operations every vector unit has, so the loop vectorises and LLVM contracts the Horner steps into
FMAs.

Accuracy (float32 inputs; measured against float64 numpy/scipy over the whole float range,
see tests/test_cpu_rules_memory_bound.py, which checks the bounds stated in `MAX_ERROR`):
- exp: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes' degree-7 polynomial, then the
  scale 2^n applied as two exact power-of-two factors so that results in the subnormal range
  are rounded once (not flushed) and results above FLT_MAX overflow to +inf. On targets with
  AVX-512 (`MathOptions.ldexp`) the scale is one `llvm.ldexp`, which LLVM emits as vscalefps:
  the same single IEEE rounding of y * 2^n (subnormal and overflowing results included) in
  one instruction instead of nine (integer shifts, adds and two multiplies); elsewhere LLVM
  would make it a libm call per lane. Measured max
  relative error 7.9e-8 (< 1 ulp) for normal results, at most one subnormal ulp (1.4e-45)
  below FLT_MIN. exp(-inf) = 0, exp(+inf) = +inf, exp(nan) = nan.
- erf: the odd rational approximation P13(x)/Q8(x) of Eigen (also TVM's topi.fast_erf) on
  x clamped to [-4, 4] (erf(4) rounds to 1.0f), evaluated as x * (P / Q) so that tiny x keep
  full precision. Measured max relative error 2.7e-7 (~2 ulp). erf(+-inf) = +-1, nan -> nan
  (topi.fast_erf returns 1.0 for nan and loses precision near FLT_MIN, and topi.fast_exp
  returns +inf on (88.38, 88.72] and flushes subnormal results: why they are not reused).
- tanh: Eigen's rational P13(x)/Q6(x) on x clamped to [-7.90531, 7.90531] (tanh rounds to +-1
  beyond), and tanh(x) = x for |x| < 4e-4. Measured max relative error 3.0e-7 (the clamp:
  tanh(x > 7.9) = 1 - 3e-7); tanh(+-inf) = +-1, nan -> nan.
- sigmoid(x) = 1 / (1 + e) or e / (1 + e) with e = exp(-|x|) from the exp above: measured
  max relative error 1.7e-7, subnormal results within one subnormal ulp.
- x / c for a float32 constant c: x * RN(1/c), where RN(1/c) is a normal float32 (else the
  division stays). |x * RN(1/c) - x/c| <= |x/c| 2^-24 before the product's own rounding, so
  the result is within one ulp (2^-23 relative; bit-identical when c is a power of two); inf
  and nan come out as the division gives them. A vector division is the slowest instruction
  of a GELU (ONNX's x / sqrt(2) before the erf: on a Zen 5 core vdivps issues once per several
  cycles): GELU 128x3072 38.0 -> 33.7 us.
- x / d for a divisor d that is the same along the store's innermost (vectorised) index
  (a LayerNorm exported to ONNX as ... / Sqrt(var + eps), any x / reduce(x)[row]):
  x * RN(1/d) where |d| is in [2^-126, 2^126] (1/d is then a normal float and the bound above
  holds), the division as written otherwise; the test is made once per store
  (`divide_by_invariants`). That ONNX LayerNorm through the einweld pipeline: 128x768 20.2 ->
  14.6 us, 197x384 17.3 -> 12.8 us; TVM's own softmax 12x128x128 53.8 -> 41.8 us (one process,
  alternating). The pipeline's softmax already divides once per row (`tir_passes.legalize`,
  which argues sum >= 1 instead of testing): its 1 / sum is a reciprocal already and is left
  alone.
Subnormal inputs go through the same arithmetic (no flush-to-zero is assumed or set).
The bounds are stated as relative errors in `MAX_ERROR` (1 ulp of float32 is 2^-23 ~ 1.19e-7
relative at the bottom of a binade, 2^-24 at the top).

Other dtypes are left to libm: float64 callers expect libm accuracy, and float16 is computed in
float32 by LLVM anyway. Only the calls are replaced; everything around them is untouched, so the
rewrite is correct whenever the formulas are (which the tests check on 2^20+ points per function).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import ir, s_tir, tirx
from tvm.ir.prim.expr import BinaryOpExpr, CmpExpr, LogicalExpr
from tvm_ffi import structural_equal

from .isa import cpu_target, has_feature

F32 = "float32"


@dataclass(frozen=True)
class Polynomial:
    """Coefficients from the highest power down (Horner order)."""

    coefficients: tuple[float, ...]

    def __call__(self, x: tirx.Expr) -> tirx.Expr:
        acc = tirx.const(self.coefficients[0], F32)
        for c in self.coefficients[1:]:
            acc = acc * x + tirx.const(c, F32)
        return acc


# Cephes expf: exp(r) ~ 1 + r + r^2 * P(r) on |r| <= ln2/2.
EXP_POLY = Polynomial((1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                       1.6666665459e-1, 5.0000001201e-1))
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln2 = LN2_HI + LN2_LO, LN2_HI has 9 bits
LOG2E = 1.44269504088896341
# Beyond these, exp(x) is 0 (below the smallest subnormal, 2^-149 ~ e^-103.3) or +inf.
EXP_MIN_X, EXP_MAX_X = -104.0, 89.0

# Eigen's generic_fast_erf_float: erf(x) ~ x * P(x^2) / Q(x^2) on |x| <= 4.
ERF_CLAMP = 4.0
ERF_P = Polynomial((-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                    -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                    -1.60960333262415e-02))
ERF_Q = Polynomial((-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                    -7.37332916720468e-03, -1.42647390514189e-02))

# Eigen's generic_fast_tanh_float: tanh(x) ~ x * P(x^2) / Q(x^2) on |x| <= 7.90531.
TANH_CLAMP = 7.90531110763549805
TANH_TINY = 0.0004
TANH_P = Polynomial((-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                     5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                     4.89352455891786e-03))
TANH_Q = Polynomial((1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                     4.89352518554385e-03))

# Stated maximum relative error of each formula (for results of magnitude >= FLT_MIN).
MAX_ERROR = {"exp": 1.2e-7, "erf": 3.6e-7, "tanh": 3.6e-7, "sigmoid": 2.4e-7, "div": 1.2e-7}
# Stated maximum absolute error for results below FLT_MIN (one float32 subnormal ulp).
MAX_SUBNORMAL_ERROR = 1.5e-45


def _f(value: float) -> tirx.Expr:
    return tirx.const(value, F32)


def _bind(value: tirx.Expr, body: Callable[[tirx.Expr], tirx.Expr], name: str) -> tirx.Expr:
    """`body(v)` with v bound to `value` by a Let, so a value used several times is computed once
    (the Let vectorises like any other expression)."""
    if isinstance(value, (tirx.Var, tirx.FloatImm)):
        return body(value)
    var = tirx.Var(name, str(value.ty))
    return tirx.Let(var, value, body(var))


def _clamp(x: tirx.Expr, low: float, high: float) -> tirx.Expr:
    """x clamped to [low, high], a NaN x kept as it is. TVM's LLVM code generator lowers
    max(a, b) to select(a > b, a, b) with an ordered compare (min likewise), which is false for
    a NaN, so the *second* operand is returned: with the bound first, a NaN x passes through
    (x86's vmaxps/vminps have the same operand rule and implement it in one instruction), and
    the arithmetic after it propagates the NaN. (Written the other way round, a NaN became the
    bound, and each formula needed a bit test and a select to put it back: 3 of exp's ~25
    vector instructions.) tests/test_cpu_rules_memory_bound.py checks nan -> nan for every
    formula, vectorised and scalar."""
    return tirx.min(_f(high), tirx.max(_f(low), x))


@dataclass(frozen=True)
class MathOptions:
    """What the target offers the formulas: `ldexp`, a vector ldexp in one instruction
    (AVX-512's vscalefps)."""

    ldexp: bool = False


PORTABLE = MathOptions()


def math_options(target: "tvm.target.Target | None") -> MathOptions:
    """The options for `target` (None: the portable formulas)."""
    if target is None or target.kind.name != "llvm":
        return PORTABLE
    return MathOptions(ldexp=has_feature("avx512f", target))


def _pow2(n: tirx.Expr) -> tirx.Expr:
    """2^n as a float32, for int32 n in [-126, 127]: the exponent field built directly."""
    return tirx.reinterpret(F32, (n + tirx.const(127, "int32")) << tirx.const(23, "int32"))


def fast_exp(x: tirx.Expr, options: MathOptions = PORTABLE) -> tirx.Expr:
    """float32 exp(x) from vector-friendly operations (see the module docstring)."""
    def body(x):
        xc = _clamp(x, EXP_MIN_X, EXP_MAX_X)
        n = tirx.floor(xc * _f(LOG2E) + _f(0.5))

        def scaled(n):
            r = xc - n * _f(LN2_HI) - n * _f(LN2_LO)
            y = _bind(r, lambda r: EXP_POLY(r) * r * r + r + _f(1.0), "exp_r")
            if options.ldexp:
                return tirx.call_llvm_pure_intrin(F32, "llvm.ldexp", y,
                                                  tirx.Cast("int32", n))
            # n in [-150, 129]: two factors 2^(n//2) and 2^(n - n//2), each a normal float, so the
            # product rounds once even when the result is subnormal.
            ni = tirx.Cast("int32", n)
            half = ni >> tirx.const(1, "int32")
            return y * _pow2(half) * _pow2(ni - half)

        return _bind(n, scaled, "exp_n")

    return _bind(x, body, "exp_x")


def _odd_rational(x: tirx.Expr, clamp: float, p: Polynomial, q: Polynomial, name: str
                  ) -> tirx.Expr:
    def body(xc):
        # x * (P / Q), not (x * P) / Q: for |x| near FLT_MIN, x * P would be subnormal.
        return _bind(xc * xc, lambda x2: xc * (p(x2) / q(x2)), name + "_x2")

    return _bind(_clamp(x, -clamp, clamp), body, name + "_xc")


def fast_erf(x: tirx.Expr, options: MathOptions = PORTABLE) -> tirx.Expr:
    """float32 erf(x) (see the module docstring)."""
    return _odd_rational(x, ERF_CLAMP, ERF_P, ERF_Q, "erf")


def fast_tanh(x: tirx.Expr, options: MathOptions = PORTABLE) -> tirx.Expr:
    """float32 tanh(x) (see the module docstring)."""
    def body(x):
        approx = _odd_rational(x, TANH_CLAMP, TANH_P, TANH_Q, "tanh")
        return tirx.Select(tirx.abs(x) < _f(TANH_TINY), x, approx)  # a NaN: approx's

    return _bind(x, body, "tanh_x")


def fast_sigmoid(x: tirx.Expr, options: MathOptions = PORTABLE) -> tirx.Expr:
    """float32 sigmoid(x): with e = exp(-|x|) (never overflows), 1 / (1 + e) for x >= 0 and
    e / (1 + e) for x < 0, so that tiny results (x < -87) keep their relative accuracy instead of
    being 1 / inf = 0. nan propagates through exp."""
    def body(x):
        e = fast_exp(-tirx.abs(x), options)
        return _bind(e, lambda e: tirx.Select(x < _f(0.0), e, _f(1.0)) / (_f(1.0) + e),
                     "sigmoid_e")

    return _bind(x, body, "sigmoid_x")


def reciprocal_of(divisor: tirx.Expr) -> tirx.Expr | None:
    """RN(1 / c) for a float32 constant divisor c whose reciprocal is a normal float32 (so that
    x / c may be computed as x * RN(1 / c): see the module docstring), else None."""
    if not isinstance(divisor, tirx.FloatImm) or str(divisor.ty) != F32:
        return None
    c = float(divisor.value)
    if not math.isfinite(c) or c == 0.0:
        return None
    r = float(np.float32(1.0 / c))
    if not math.isfinite(r) or abs(r) < float(np.finfo(np.float32).tiny):
        return None
    return _f(r)


# Which call is replaced by which formula: the table the rewrite reads.
FAST_MATH: dict[str, Callable[[tirx.Expr, MathOptions], tirx.Expr]] = {
    "tirx.exp": fast_exp,
    "tirx.erf": fast_erf,
    "tirx.tanh": fast_tanh,
    "tirx.sigmoid": fast_sigmoid,
}


# ------------------------------------------------------------------------------------ rewrite
def visit_exprs(node, fn: Callable[[tirx.Expr], None]) -> None:
    """Call `fn` on every expression under `node` (a statement or expression), pre-order."""
    if node is None:
        return
    if isinstance(node, tirx.Stmt):
        if isinstance(node, tirx.SeqStmt):
            for s in node.seq:
                visit_exprs(s, fn)
        elif isinstance(node, tirx.BufferStore):
            for i in node.indices:
                visit_exprs(i, fn)
            visit_exprs(node.value, fn)
        elif isinstance(node, tirx.Bind):
            visit_exprs(node.value, fn)
        elif isinstance(node, tirx.IfThenElse):
            visit_exprs(node.condition, fn)
            visit_exprs(node.then_case, fn)
            visit_exprs(node.else_case, fn)
        elif isinstance(node, tirx.Evaluate):
            visit_exprs(node.value, fn)
        elif isinstance(node, tirx.For):
            visit_exprs(node.body, fn)
        return
    fn(node)
    if isinstance(node, ir.Call):
        children = list(node.args)
    elif isinstance(node, tirx.Not):
        children = [node.a]
    elif isinstance(node, (BinaryOpExpr, CmpExpr, LogicalExpr)):
        children = [node.a, node.b]
    elif isinstance(node, tirx.Select):
        children = [node.condition, node.true_value, node.false_value]
    elif isinstance(node, tirx.Cast):
        children = [node.value]
    elif isinstance(node, tirx.Let):
        children = [node.value, node.body]
    elif isinstance(node, ir.TensorLoad):
        children = list(node.indices)
    else:
        children = []
    for c in children:
        visit_exprs(c, fn)


class ExprRewriter:
    """Rebuilds the statements and expressions of an unlowered (or scheduled, block-form)
    PrimFunc bottom-up, each expression passed to `visit` once its operands are rebuilt; the
    base keeps every node. Nodes it does not know are kept as they are, expressions under
    them unvisited (for the fast-math rewrite that only means a call stays a libm call, still
    correct). `rewrite(func)` returns the function with the rewritten body."""

    def visit(self, e: tirx.Expr) -> tirx.Expr:
        return e

    def rewrite(self, func: tirx.PrimFunc) -> tirx.PrimFunc:
        body = self.stmt(func.body)
        return func if body.same_as(func.body) else func.with_body(body)

    # expressions
    def expr(self, e: tirx.Expr) -> tirx.Expr:
        if isinstance(e, ir.Call) and isinstance(e.op, ir.Op):
            args = [self.expr(a) for a in e.args]
            if any(not a.same_as(b) for a, b in zip(args, e.args)):
                e = ir.Call(e.op, args, ret_ty=e.ty)
        elif isinstance(e, (BinaryOpExpr, CmpExpr, LogicalExpr)) and not isinstance(e, tirx.Not):
            a, b = self.expr(e.a), self.expr(e.b)
            e = e if a.same_as(e.a) and b.same_as(e.b) else type(e)(a, b)
        elif isinstance(e, tirx.Select):
            c, t, f = self.expr(e.condition), self.expr(e.true_value), self.expr(e.false_value)
            e = tirx.Select(c, t, f)
        elif isinstance(e, tirx.Cast):
            e = tirx.Cast(str(e.ty), self.expr(e.value))
        elif isinstance(e, tirx.Let):
            e = tirx.Let(e.var, self.expr(e.value), self.expr(e.body))
        elif isinstance(e, tirx.Not):
            e = tirx.Not(self.expr(e.a))
        elif isinstance(e, ir.TensorLoad):
            e = tirx.BufferLoad(e.source, [self.expr(i) for i in e.indices])
        return self.visit(e)

    # statements
    def stmt(self, s: tirx.Stmt) -> tirx.Stmt:
        if isinstance(s, s_tir.SBlockRealize):
            return s_tir.SBlockRealize(list(s.iter_values), s.predicate, self.stmt(s.block))
        if isinstance(s, s_tir.SBlock):
            init = self.stmt(s.init) if s.init is not None else None
            return s_tir.SBlock(list(s.iter_vars), list(s.reads), list(s.writes), s.name_hint,
                                self.stmt(s.body), init, list(s.alloc_buffers),
                                list(s.match_buffers), dict(s.annotations))
        if isinstance(s, tirx.SeqStmt):
            return tirx.SeqStmt([self.stmt(x) for x in s.seq])
        if isinstance(s, tirx.For):
            return tirx.For(s.loop_var, s.min, s.extent, s.kind, self.stmt(s.body),
                            s.thread_binding, dict(s.annotations))
        if isinstance(s, tirx.BufferStore):
            return tirx.BufferStore(s.buffer, self.expr(s.value), list(s.indices))
        if isinstance(s, tirx.Bind):
            return tirx.Bind(s.var, self.expr(s.value))
        if isinstance(s, tirx.IfThenElse):
            other = self.stmt(s.else_case) if s.else_case is not None else None
            return tirx.IfThenElse(self.expr(s.condition), self.stmt(s.then_case), other)
        if isinstance(s, tirx.Evaluate):
            return tirx.Evaluate(self.expr(s.value))
        return s


# |d| in [2^-126, 2^126]: then 1/d is a normal float32 too (`divide_by_invariants`).
RECIPROCAL_SAFE = (2.0 ** -126, 2.0 ** 126)
# Op effect kinds (TVM's CallEffectKind) a divisor may call and still be evaluated once,
# before the store, instead of inside it: expression annotations and pure functions.
_PURE_EFFECTS = (0, 1)
_OPAQUE_EFFECT = 4  # an op that declares no effect kind is taken as opaque


def _free_of(e: tirx.Expr, banned: list) -> bool:
    """Whether `e` reads none of the variables `banned` and calls only pure ops."""
    ok = [True]

    def visit(x):
        if isinstance(x, tirx.Var) and any(x.same_as(v) for v in banned):
            ok[0] = False
        elif isinstance(x, ir.Call) and (not isinstance(x.op, ir.Op) or int(
                x.op.get_attr("TCallEffectKind") or _OPAQUE_EFFECT) not in _PURE_EFFECTS):
            ok[0] = False

    visit_exprs(e, visit)
    return ok[0]


def invariant_divisors(store: tirx.BufferStore) -> list:
    """The float32 divisors of `store`'s value that do not vary along its innermost index
    (softmax's row sum under e / sum[row]; an ONNX LayerNorm's sqrt(var[row] + eps)): the
    vectorised loop runs along that index, so one reciprocal serves every lane. Constants are
    `reciprocal_of`'s; a divisor that reads a variable bound inside the value (a formula's
    Let) or calls an impure op cannot be evaluated before the store and is not one."""
    lanes = list(tirx.analysis.undefined_vars(store.indices[-1])) if store.indices else []
    bound = [x.var for x in _nodes(store.value, tirx.Let)]
    found: list = []
    for div in _nodes(store.value, tirx.Div):
        d = div.b
        if str(div.ty) != F32 or isinstance(d, tirx.FloatImm) or (
                isinstance(div.a, tirx.FloatImm) and div.a.value == 1.0):
            continue  # a constant's is `reciprocal_of`'s; 1 / d is a reciprocal already
        if _free_of(d, lanes + bound) and not any(structural_equal(d, f) for f in found):
            found.append(d)
    return found


def _nodes(e: tirx.Expr, kind) -> list:
    out = []
    visit_exprs(e, lambda x: out.append(x) if isinstance(x, kind) else None)
    return out


class _ByReciprocal(ExprRewriter):
    """a / d as a * (1 / d) for the divisors `d` given (compared structurally)."""

    def __init__(self, divisors: list) -> None:
        self.divisors = divisors

    def visit(self, e: tirx.Expr) -> tirx.Expr:
        if isinstance(e, tirx.Div) and any(structural_equal(e.b, d) for d in self.divisors):
            return e.a * (_f(1.0) / e.b)
        return e


def divide_by_invariants(store: tirx.BufferStore) -> tuple[tirx.Stmt, int]:
    """`store` with its `invariant_divisors` d applied as x * RN(1/d) where every such d has
    |d| in `RECIPROCAL_SAFE`, and as written otherwise:
        if (all d in range) store[value with x / d -> x * (1 / d)] else store
    The condition does not depend on the vector lane, so TVM's VectorizeLoop keeps both
    branches vectorised and LLVM hoists 1/d out of the loop: one scalar division a row instead
    of a vector division an element (the module docstring has the measurements). Where taken, 1/d is a normal float, so the bound of a division by a constant holds
    (`MAX_ERROR["div"]`, one ulp; a subnormal result within one subnormal ulp); NaN, inf, zero
    and extreme divisors fail the test and divide as before. Returns (statement, divisors)."""
    divisors = invariant_divisors(store)
    if not divisors:
        return store, 0
    fast = tirx.BufferStore(store.buffer, _ByReciprocal(divisors).expr(store.value),
                            list(store.indices))
    return tirx.IfThenElse(_reciprocal_guard(divisors), fast, store), len(divisors)


def _reciprocal_guard(divisors: list) -> tirx.Expr:
    """The test `divide_by_invariants` puts around its stores: every |d| in RECIPROCAL_SAFE."""
    low, high = RECIPROCAL_SAFE
    safe = None
    for d in divisors:
        size = tirx.abs(d)
        test = tirx.And(size >= _f(low), size <= _f(high))
        safe = test if safe is None else tirx.And(safe, test)
    return safe


def is_reciprocal_guard(stmt: tirx.Stmt) -> bool:
    """Whether `stmt` is what `divide_by_invariants` made: its else branch the store as
    written, its condition the guard of that store's divisors. Such a statement is left as
    it is by a second rewrite, which would otherwise rewrite the fallback division too (the
    rules' output passes through the rewrite again when a later stage reschedules it)."""
    if not isinstance(stmt, tirx.IfThenElse) or not isinstance(stmt.else_case,
                                                                tirx.BufferStore):
        return False
    divisors = invariant_divisors(stmt.else_case)
    return bool(divisors) and structural_equal(stmt.condition, _reciprocal_guard(divisors))


class _Rewriter(ExprRewriter):
    """The calls of `FAST_MATH` replaced by their formulas, float32 divisions by a
    reciprocal where `reciprocal_of` finds one or the divisor is the same for every lane
    (`divide_by_invariants`); `replaced` counts them."""

    def __init__(self, options: MathOptions) -> None:
        self.options = options
        self.replaced = 0

    def stmt(self, s: tirx.Stmt) -> tirx.Stmt:
        if is_reciprocal_guard(s):
            return s  # rewritten before: its calls are formulas already, its else must divide
        s = super().stmt(s)
        if isinstance(s, tirx.BufferStore) and str(s.value.ty) == F32:
            s, count = divide_by_invariants(s)
            self.replaced += count
        return s

    def visit(self, e: tirx.Expr) -> tirx.Expr:
        if isinstance(e, ir.Call) and isinstance(e.op, ir.Op):
            fast = FAST_MATH.get(e.op.name)
            if fast is not None and str(e.ty) == F32 and len(e.args) == 1:
                self.replaced += 1
                return fast(e.args[0], self.options)
        elif isinstance(e, tirx.Div) and str(e.ty) == F32:
            reciprocal = reciprocal_of(e.b)
            if reciprocal is not None:
                self.replaced += 1
                return e.a * reciprocal
        return e


def rewrite_fast_math(func: tirx.PrimFunc, target: "tvm.target.Target | None" = None
                      ) -> tuple[tirx.PrimFunc, int]:
    """`func` with every float32 exp/erf/tanh/sigmoid call replaced, by the formulas for
    `target` (`math_options`; None: the portable ones); and how many were."""
    rewriter = _Rewriter(math_options(target))
    body = rewriter.stmt(func.body)
    if rewriter.replaced == 0:
        return func, 0
    return func.with_body(body), rewriter.replaced


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="FastMath")
class FastMath:  # pylint: disable=too-few-public-methods
    """PrimFunc pass: `rewrite_fast_math` on every function of the module, for the function's
    own `target` attribute where it has one."""

    def transform_function(self, func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
        return rewrite_fast_math(func, cpu_target(func))[0]
