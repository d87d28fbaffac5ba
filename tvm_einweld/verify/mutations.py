"""The mutation suite: correct rewrites the verifier must accept, planted wrong ones it must
reject.

Each case is a rewrite `before → after` of the kind EinNet's derivation rules produce, with the
side conditions the rule relies on. The correct rewrites:
  * conv → matmul + offset-reduce (EinNet §7's conv3x3 derivation), stride 1 and stride 2;
  * boundary tightening of a scope whose removed border is zero;
  * splitting a summation iterator k = 4·k1 + k2 (a bijective substitution).
The planted faults, one change each: an off-by-one offset, a wrong stride, a wrong padding (an
asymmetric conv padding, and a tightened border that is not zero), a dropped summation range
element, kernel iterators r and s swapped (equal ranges, so shapes cannot catch it), a
non-bijective substitution, relu moved across an add, relu turned into tanh, and a rewrite
tailored to TASO's fixed stand-in (only exact screening, with random stand-ins, catches it).

`python -m tvm_einweld verify` runs the suite; tests/test_verify_mutations.py asserts it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from ..expr import canonical
from ..expr import index as ix
from ..expr.canonical import needed_padding
from ..expr.expression import Access, Expr, Iterator, Scope, Tensor, accesses, unary
from . import Verdict, verify_rewrite
from .smt import ProofResult, prove_bijection, prove_constant_region, prove_image_within


TAILORED = "rewrite tailored to the test stand-in"


@dataclass(frozen=True)
class RewriteCase:
    """One rewrite to verify; `correct` says whether the verifier must accept it."""

    name: str
    correct: bool
    before: Expr
    after: Expr
    side_conditions: Tuple[Callable[[], ProofResult], ...] = ()

    def verify(self, seed: int = 0) -> Verdict:
        return verify_rewrite(self.before, self.after, self.side_conditions, seed=seed)


# --- conv → matmul + offset-reduce ---------------------------------------------------------------

def conv_offset_reduce(
    data: Tensor,
    weight: Tensor,
    stride: int = 1,
    pad: int = 1,
    *,
    offset: int = 0,
    index_stride: Optional[int] = None,
    r_extent: Optional[int] = None,
    swap_kernel: bool = False,
) -> Expr:
    """conv2d (NCHW/OIHW, symmetric padding) derived into a matmul scope plus an offset-reduce:

        T[n,h,w,f,r,s] = Σ_c A[n,c,h,w] · K[f,c,r,s]          (a matmul, zero padded in h, w)
        out[n,f,y,x]   = Σ_{r,s} T[n, y·st + r - p, x·st + s - p, f, r, s]

    The keyword arguments plant faults: `offset` shifts the row index, `index_stride` replaces
    the stride in the row index, `r_extent` shortens the r range, `swap_kernel` reads K[f,c,s,r].
    The scope's padding is whatever the (possibly wrong) indices need, so every variant
    evaluates; only its value is wrong.
    """
    N, C, H, W = data.shape
    F, _, R, S = weight.shape
    OH, OW = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    n, h, w, f = (Iterator(nm, 0, ext) for nm, ext in zip("nhwf", (N, H, W, F)))
    kr, ks, c = Iterator("r", 0, R), Iterator("s", 0, S), Iterator("c", 0, C)
    k_idx = (f.var, c.var, ks.var, kr.var) if swap_kernel else (f.var, c.var, kr.var, ks.var)
    matmul = Expr((n, h, w, f, kr, ks), (c,),
                  Access(data, (n.var, c.var, h.var, w.var)) * Access(weight, k_idx), data.dtype)
    y, x = Iterator("y", 0, OH), Iterator("x", 0, OW)
    r, s = Iterator("r", 0, R if r_extent is None else r_extent), Iterator("s", 0, S)
    row_stride = stride if index_stride is None else index_stride
    t_idx = (n.var, y.var * row_stride + r.var - pad + offset, x.var * stride + s.var - pad,
             f.var, r.var, s.var)
    ranges = {it.name: (it.lo, it.hi) for it in (n, f, y, x, r, s)}
    scope = Scope(matmul, needed_padding(t_idx, matmul.shape, ranges))
    return Expr((n, f, y, x), (r, s), Access(scope, t_idx), data.dtype)


def reads_within_padding(after: Expr, pad: int) -> Callable[[], ProofResult]:
    """Side condition of the offset-reduce rule: the spatial reads of T stay inside the
    padding the rule gives T, i.e. inside [-p, H+p) × [-p, W+p) (the conv's own padding)."""
    access = next(accesses(after.body))
    H, W = access.source.shape[1:3]

    def check() -> ProofResult:
        return prove_image_within(access.indices[1:3], after.iterators,
                                  [(-pad, H + pad), (-pad, W + pad)])

    return check


# --- boundary tightening -------------------------------------------------------------------------

def boundary_tightening(bias: bool) -> RewriteCase:
    """S = L_{h∈[-1,L+1)} A[h]·2 (+ B[0]) read by a 3-tap conv; the rule shrinks S to [0, L)
    and zero-pads it, which is right only when S is zero on the removed border."""
    L = 6
    a_pad, a = Tensor("A", (L,), pad=((1, 1),)), Tensor("A", (L,))
    b, k = Tensor("B", (1,)), Tensor("K", (3,))

    def body(src: Tensor, h: Iterator):
        value = Access(src, (h.var,)) * 2
        return value + Access(b, (ix.IConst(0),)) if bias else value

    wide_h, tight_h = Iterator("h", -1, L + 1), Iterator("h", 0, L)
    wide = Expr((wide_h,), (), body(a_pad, wide_h))
    tight = Expr((tight_h,), (), body(a, tight_h))
    y, r = Iterator("y", 0, L), Iterator("r", 0, 3)
    idx = y.var + r.var - 1

    def consumer(scope: Scope) -> Expr:
        return Expr((y,), (r,), Access(scope, (idx,)) * Access(k, (r.var,)))

    before = consumer(Scope(wide))
    after = consumer(Scope(tight, ((1, 1),)))
    conditions = (
        lambda: prove_constant_region(wide, {"h": (-1, 0)}),
        lambda: prove_constant_region(wide, {"h": (L, L + 1)}),
    )
    name = ("wrong padding: zero border where the scope is A·2 + B (tightening)" if bias
            else "boundary tightening of A·2 (border is zero)")
    return RewriteCase(name, not bias, before, after, conditions)


# --- summation splitting -------------------------------------------------------------------------

def split_summation(inner: int) -> RewriteCase:
    """matmul with k ∈ [0, 12) rewritten to k = 4·k1 + k2, k1 ∈ [0, 3), k2 ∈ [0, inner)."""
    A, B = Tensor("A", (3, 12)), Tensor("B", (12, 5))
    before = canonical.matmul(A, B)
    m, n = before.traversals
    k1, k2 = Iterator("k1", 0, 3), Iterator("k2", 0, inner)
    kk = k1.var * 4 + k2.var
    after = Expr((m, n), (k1, k2), Access(A, (m.var, kk)) * Access(B, (kk, n.var)))
    k = before.sums[0]
    cond = (lambda: prove_bijection({"k1": k.var // 4, "k2": k.var % 4}, {"k": kk}, [k],
                                    [k1, k2]),)
    name = ("split k = 4·k1 + k2 (bijective)" if inner == 4
            else f"dropped summation range element: k2 ∈ [0, {inner}) (non-bijective split)")
    return RewriteCase(name, inner == 4, before, after, cond)


# --- activation faults ---------------------------------------------------------------------------

def _activation_cases() -> Tuple[RewriteCase, ...]:
    X, Y = Tensor("X", (4, 5)), Tensor("Y", (4, 5))
    i, j = Iterator("i", 0, 4), Iterator("j", 0, 5)
    x, y = Access(X, (i.var, j.var)), Access(Y, (i.var, j.var))
    relu_sum = Expr((i, j), (), unary("relu", x + y))
    A, K = Tensor("A", (1, 3, 5, 5)), Tensor("K", (4, 3, 3, 3))
    conv = canonical.conv2d(A, K, padding=(1, 1, 1, 1))
    its = conv.traversals
    point = tuple(it.var for it in its)
    read, derived = Access(Scope(conv), point), Access(Scope(conv_offset_reduce(A, K)), point)
    return (
        RewriteCase("relu moved across an add: relu(x+y) → relu(x)+relu(y)", False, relu_sum,
                    Expr((i, j), (), unary("relu", x) + unary("relu", y))),
        RewriteCase("relu(conv) → relu(matmul + offset-reduce)", True,
                    Expr(its, (), unary("relu", read)), Expr(its, (), unary("relu", derived))),
        RewriteCase("wrong activation: relu(conv) → tanh(conv)", False,
                    Expr(its, (), unary("relu", read)), Expr(its, (), unary("tanh", read))),
        # Equal under TASO's fixed stand-in, so float testing passes it; exact screening
        # draws random stand-in coefficients and rejects it.
        RewriteCase(TAILORED + ": x·(x+1)+1 → relu(x)", False,
                    Expr((i, j), (), x * (x + 1) + 1), Expr((i, j), (), unary("relu", x))),
    )


# --- the suite -----------------------------------------------------------------------------------

def suite() -> Tuple[RewriteCase, ...]:
    """All cases, small shapes, each verified in well under a second."""
    A, K = Tensor("A", (1, 3, 5, 5)), Tensor("K", (4, 3, 3, 3))
    A7 = Tensor("A", (1, 3, 7, 7))
    conv = canonical.conv2d(A, K, padding=(1, 1, 1, 1))
    conv_s2 = canonical.conv2d(A7, K, strides=(2, 2), padding=(1, 1, 1, 1))

    def offset_case(name: str, correct: bool, before: Expr, after: Expr) -> RewriteCase:
        return RewriteCase(name, correct, before, after, (reads_within_padding(after, 1),))

    cases = [
        offset_case("conv3x3 → matmul + offset-reduce", True, conv, conv_offset_reduce(A, K)),
        offset_case("conv3x3 stride 2 → matmul + offset-reduce", True, conv_s2,
                    conv_offset_reduce(A7, K, stride=2)),
        offset_case("off-by-one offset: y + r - 1 → y + r", False, conv,
                    conv_offset_reduce(A, K, offset=1)),
        offset_case("wrong stride: y·2 + r - 1 → y + r - 1", False, conv_s2,
                    conv_offset_reduce(A7, K, stride=2, index_stride=1)),
        RewriteCase("wrong padding: conv padding (1,1,1,1) → (0,0,2,2)", False, conv,
                    canonical.conv2d(A, K, padding=(0, 0, 2, 2))),
        offset_case("dropped summation range element: r ∈ [0,3) → [0,2)", False, conv,
                    conv_offset_reduce(A, K, r_extent=2)),
        offset_case("swapped iterators of equal range: K[f,c,r,s] → K[f,c,s,r]", False, conv,
                    conv_offset_reduce(A, K, swap_kernel=True)),
        boundary_tightening(bias=False),
        boundary_tightening(bias=True),
        split_summation(4),
        split_summation(3),
    ]
    return tuple(cases) + _activation_cases()


def run_suite(cases: Sequence[RewriteCase] = (),
              seed: int = 0) -> Tuple[Tuple[RewriteCase, Verdict], ...]:
    return tuple((case, case.verify(seed)) for case in (cases or suite()))


__all__ = ["RewriteCase", "TAILORED", "conv_offset_reduce", "reads_within_padding",
           "boundary_tightening",
           "split_summation", "suite", "run_suite"]
