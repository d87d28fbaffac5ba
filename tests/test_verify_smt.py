"""z3 side conditions: each check has a proven, a refuted and an unknown (timeout) case."""
import itertools

import pytest
import z3

from tvm_einweld.expr import Constant, Iterator, Scope, Tensor, unary
from tvm_einweld.expr import index as ix
from tvm_einweld.expr.expression import Expr
from tvm_einweld.expr.index import IVar
from tvm_einweld.verify import (
    ProofResult, prove_bijection, prove_constant_region, prove_cover, prove_image_within,
    prove_index_equal, prove_left_inverse, prove_partition, to_z3,
)

x, y, z = IVar("x"), IVar("y"), IVar("z")
k, k1, k2 = IVar("k"), IVar("k1"), IVar("k2")

# Fermat for cubes: x³ + y³ ≠ z³, so NONZERO = ceil(d²/M) is 1 on the whole box. True,
# but beyond z3's non-linear integer arithmetic: every check built on it must be "unknown".
BIG = [Iterator(n, 1, 1000) for n in "xyz"]
_d = x * x * x + y * y * y - z * z * z
_M = 10**19  # > max d²
NONZERO = (_d * _d + (_M - 1)) // _M


def test_floor_division_semantics_match_python():
    """z3's Int div/mod agree with Python's floor // and % for positive divisors."""
    v = z3.Int("v")
    for value, d in itertools.product(range(-13, 14), (1, 2, 3, 5)):
        for op, py in (("//", value // d), ("%", value % d)):
            term = to_z3(ix.build(op, IVar("v"), d), {"v": v})
            got = z3.simplify(z3.substitute(term, (v, z3.IntVal(value)))).as_long()
            assert got == py, (value, op, d)


def test_to_z3_rejects_unbound_iterators_and_variable_divisors():
    with pytest.raises(KeyError):
        to_z3(x + y, {"x": z3.Int("x")})
    with pytest.raises(ValueError, match="positive constant divisor"):
        to_z3(ix.IBin("//", x, y), {"x": z3.Int("x"), "y": z3.Int("y")})


def test_index_equal():
    dom = [Iterator("k", 0, 12), Iterator("k1", 0, 4)]
    proven = prove_index_equal((k * 4 + k1) // 4, k, dom)
    assert proven.status == "proven" and proven.proven and proven.counterexample is None
    bad = prove_index_equal((k * 4 + k1) // 4, k, [Iterator("k", 0, 12), Iterator("k1", 0, 5)])
    assert bad.status == "refuted" and not bad.proven
    assert bad.counterexample["k1"] == 4  # the only values that break it
    assert ix.evaluate((k * 4 + k1) // 4, bad.counterexample) != bad.counterexample["k"]
    # Ranges that start below zero: floor semantics matter here.
    neg = [Iterator("x", -5, 5)]
    assert prove_index_equal((x + 10) // 3 - 3, (x + 1) // 3, neg).proven
    assert prove_index_equal(x // 3 * 3 + x % 3, x, neg).proven


def test_index_equal_unknown_is_never_proven():
    res = prove_index_equal(NONZERO, ix.IConst(1), BIG, timeout_ms=300)
    assert res.status == "unknown" and not res.proven and res.counterexample is None
    assert res.seconds < 5
    # The same shape of claim on a box where z3 finds the zero: refuted, not unknown.
    small = [Iterator("x", 1, 3), Iterator("y", 0, 3), Iterator("z", 1, 3)]
    assert prove_index_equal(NONZERO, ix.IConst(1), small).status == "refuted"


def test_left_inverse():
    dom = [Iterator("k", 0, 12)]
    assert prove_left_inverse({"k1": k // 4, "k2": k % 4}, {"k": k1 * 4 + k2}, dom).proven
    bad = prove_left_inverse({"k1": k // 3, "k2": k % 4}, {"k": k1 * 3 + k2}, dom)
    assert bad.status == "refuted"
    kv = bad.counterexample["k"]
    assert (kv // 3) * 3 + kv % 4 != kv
    # Not injective: k ↦ k // 2 loses information, no inverse can exist.
    assert prove_left_inverse({"k1": k // 2}, {"k": k1 * 2}, dom).status == "refuted"
    # t = x exactly, but only Fermat's theorem shows it.
    hard = prove_left_inverse({"t": x + NONZERO - 1, "y2": y, "z2": z},
                              {"x": IVar("t"), "y": IVar("y2"), "z": IVar("z2")}, BIG,
                              timeout_ms=300)
    assert hard.status == "unknown"


def test_bijection():
    dom = [Iterator("k", 0, 12)]
    cod = [Iterator("k1", 0, 3), Iterator("k2", 0, 4)]
    phi, psi = {"k1": k // 4, "k2": k % 4}, {"k": k1 * 4 + k2}
    assert prove_bijection(phi, psi, dom, cod).proven
    # The codomain is too large: (k1, k2) = (0, 4) has no preimage.
    wide = prove_bijection(phi, psi, dom, [Iterator("k1", 0, 3), Iterator("k2", 0, 5)])
    assert wide.status == "refuted" and wide.counterexample["k2"] == 4
    # The codomain is too small: k = 11 maps to k1 = 2 outside [0, 2).
    narrow = prove_bijection(phi, psi, dom, [Iterator("k1", 0, 2), Iterator("k2", 0, 4)])
    assert narrow.status == "refuted" and narrow.counterexample["k"] >= 8
    # Shifted iterator with a range below zero: t = y - 1 on [-1, H-1).
    shift = prove_bijection({"t": y - 1}, {"y": IVar("t") + 1}, [Iterator("y", 0, 6)],
                            [Iterator("t", -1, 5)])
    assert shift.proven
    hard = prove_bijection({"t": x + NONZERO - 1, "y2": y, "z2": z},
                           {"x": IVar("t"), "y": IVar("y2"), "z": IVar("z2")}, BIG,
                           [Iterator(n, 1, 1000) for n in ("t", "y2", "z2")], timeout_ms=300)
    assert hard.status == "unknown"


def test_maps_must_have_one_component_per_iterator():
    dom = [Iterator("k", 0, 12)]
    cod = [Iterator("k1", 0, 3), Iterator("k2", 0, 4)]
    with pytest.raises(ValueError, match="components"):
        prove_bijection({"k1": k // 4}, {"k": k1 * 4 + k2}, dom, cod)
    with pytest.raises(ValueError, match="components"):
        prove_left_inverse({"k1": k // 4, "k2": k % 4}, {"k": k1 * 4 + k2, "j": k1}, dom)
    with pytest.raises(ValueError, match="reads"):
        prove_index_equal(k + IVar("q"), k, dom)


def test_image_within():
    dom = [Iterator("y", 0, 5), Iterator("r", 0, 3)]
    r = IVar("r")
    assert prove_image_within([y + r - 1], dom, [(-1, 6)]).proven
    bad = prove_image_within([y + r - 1], dom, [(0, 6)])
    assert bad.status == "refuted" and bad.counterexample == {"y": 0, "r": 0}
    assert prove_image_within([y * 2 + r, y], dom, [(0, 11), (0, 5)]).proven
    assert prove_image_within([y * 2 + r, y], dom, [(0, 10), (0, 5)]).status == "refuted"
    hard = prove_image_within([NONZERO], BIG, [(1, 2)], timeout_ms=300)
    assert hard.status == "unknown"


def test_cover():
    dom = [Iterator("k", 0, 12), Iterator("j", 0, 3)]
    parts = [[Iterator("k", 0, 5)], [Iterator("k", 5, 12), Iterator("j", 0, 3)]]
    assert prove_cover(dom, parts).proven
    gap = prove_cover(dom, [[Iterator("k", 0, 5)], [Iterator("k", 6, 12)]])
    assert gap.status == "refuted" and gap.counterexample["k"] == 5
    assert prove_cover(dom, []).status == "refuted"
    with pytest.raises(ValueError):
        prove_cover(dom, [[Iterator("q", 0, 1)]])
    many = [[Iterator("k", i, i + 1)] for i in range(12)]
    assert prove_cover(dom, many).proven


def test_partition():
    dom = [Iterator("k", 0, 12), Iterator("j", 0, 3)]
    halves = [[Iterator("k", 0, 5)], [Iterator("k", 5, 12)]]
    assert prove_partition(dom, halves).proven
    overlap = prove_partition(dom, [[Iterator("k", 0, 6)], [Iterator("k", 5, 12)]])
    assert overlap.status == "refuted" and overlap.counterexample["k"] == 5
    gap = prove_partition(dom, [[Iterator("k", 0, 5)], [Iterator("k", 6, 12)]])
    assert gap.status == "refuted" and gap.counterexample["k"] == 5
    # Parts may reach outside the domain; only points of X count.
    assert prove_partition(dom, [[Iterator("k", -4, 5)], [Iterator("k", 5, 40)]]).proven
    assert prove_cover(dom, [[Iterator("k", 0, 6)], [Iterator("k", 5, 12)]]).proven
    # The unknown path is the solver wrapper shared with prove_cover (tested below).


def test_cover_timeout_is_unknown():
    """Covers are linear, so only a large query on a tiny budget runs out of time."""
    names = "abcdef"
    dom = [Iterator(n, 0, 64) for n in names]
    parts = [[Iterator(n, 0, 64) for n in names if n != m] + [Iterator(m, lo, lo + 1)]
             for m in names for lo in range(63)]  # misses the corner (63, ..., 63)
    assert prove_cover(dom, parts, timeout_ms=1).status == "unknown"
    res = prove_cover(dom, parts, timeout_ms=20000)
    assert res.status == "refuted" and set(res.counterexample.values()) == {63}


def _padded_expr():
    """out[t] = 0 + relu(A[t])·2 + tanh(-A[t]) on t ∈ [-2, 8), A of length 6 padded by 2."""
    A = Tensor("A", (6,), pad=((2, 2),))
    t = Iterator("t", -2, 8)
    body = Constant(0.0) + unary("relu", A[t.var]) * 2 + unary("tanh", unary("neg", A[t.var]))
    return Expr((t,), (), body)


def test_constant_region():
    e = _padded_expr()
    assert prove_constant_region(e, {"t": (-2, 0)}).proven
    assert prove_constant_region(e, {"t": (6, 8)}).proven
    bad = prove_constant_region(e, {"t": (-2, 1)})
    assert bad.status == "refuted" and bad.counterexample == {"t": 0}
    # sigmoid(0) = 1/2: a padded read through sigmoid is not zero.
    A = Tensor("A", (6,), pad=((2, 2),))
    t = Iterator("t", -2, 8)
    sig = Expr((t,), (), unary("sigmoid", A[t.var]))
    res = prove_constant_region(sig, {"t": (-2, 0)})
    assert res.status == "refuted"
    # Only the constant 0 is supported.
    assert prove_constant_region(e, {"t": (-2, 0)}, value=1.0).status == "unknown"


def test_constant_region_conv_border_and_sums():
    """A conv over an extended output range reads only padding for the outermost rows."""
    A = Tensor("A", (1, 6), pad=((0, 0), (4, 4)))
    K = Tensor("K", (1, 3))
    y, c, r = Iterator("y", -3, 7), Iterator("c", 0, 1), Iterator("r", 0, 3)
    e = Expr((y,), (c, r), A[c.var, y.var + r.var - 1] * K[c.var, r.var])
    assert prove_constant_region(e, {"y": (-3, -1)}).proven
    assert prove_constant_region(e, {"y": (-3, -1)}).counterexample is None
    assert prove_constant_region(e, {"y": (-3, 0)}).status == "refuted"
    # Summation sub-region: for y = 0 the term r = 0 reads A[-1], padding.
    assert prove_constant_region(e, {"y": (0, 1), "r": (0, 1)}).proven
    with pytest.raises(ValueError):
        prove_constant_region(e, {"q": (0, 1)})
    with pytest.raises(ValueError):
        prove_constant_region(e, {"y": (-5, 0)})


def test_constant_region_unknown():
    A = Tensor("A", (8,), pad=((0, 1),))
    # Reads A[8] (padding) where x³ + y³ ≠ z³, that is everywhere, but z3 cannot know.
    e = Expr(tuple(BIG), (), A[NONZERO + 7])
    res = prove_constant_region(e, {}, timeout_ms=300)
    assert res.status == "unknown" and not res.proven


def test_proof_result_is_frozen_and_validated():
    res = ProofResult("proven", "x")
    with pytest.raises(Exception):
        res.status = "refuted"  # type: ignore[misc]
    with pytest.raises(ValueError):
        ProofResult("maybe", "x")


def test_constant_region_through_a_scope():
    """S = L_{h∈[-1,7)} A[h] (A zero-padded) is zero at h = -1 inside its own data range;
    relu(S[t]) · 3 on t = -1 is then zero one level down, which the proof follows."""
    A = Tensor("A", (6,), pad=((1, 1),))
    h, t = Iterator("h", -1, 7), Iterator("t", -1, 7)
    inner = Expr((h,), (), A[h.var] * 2)
    outer = Expr((t,), (), unary("relu", Scope(inner)[t.var]) * 3)
    assert prove_constant_region(outer, {"t": (-1, 0)}).proven
    assert prove_constant_region(outer, {"t": (6, 7)}).proven
    assert prove_constant_region(outer, {"t": (5, 7)}).status == "refuted"
    # A summed scope: Σ_c B[c, h] with B padded in h; zero where every term reads padding.
    B = Tensor("B", (2, 4), pad=((0, 0), (2, 0)))
    c, h2 = Iterator("c", 0, 2), Iterator("h", -2, 4)
    summed = Scope(Expr((h2,), (c,), B[c.var, h2.var]))
    u = Iterator("u", 0, 6)
    shifted = Expr((u,), (), summed[u.var - 2])
    assert prove_constant_region(shifted, {"u": (0, 2)}).proven
    assert prove_constant_region(shifted, {"u": (0, 3)}).status == "refuted"
