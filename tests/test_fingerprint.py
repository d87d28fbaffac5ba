"""Fingerprint invariances (EinNet §6.2) and the structural-equality confirmation."""
from tvm_einweld.expr import Expr, Iterator, Tensor, unary
from tvm_einweld.expr import canonical as C
from tvm_einweld.expr.fingerprint import fingerprint, structurally_equal

A, B, K = Tensor("A", (8, 8)), Tensor("B", (8, 8)), Tensor("K", (3, 3))


def window(names=("i", "j", "r", "s"), sum_order=(2, 3), swap_operands=False, k_swapped=False):
    i, j, r, s = (Iterator(n, 0, e) for n, e in zip(names, (6, 6, 3, 3)))
    a = A[i.var + r.var, j.var + s.var]
    k = K[s.var, r.var] if k_swapped else K[r.var, s.var]
    body = k * a if swap_operands else a * k
    its = (i, j, r, s)
    return Expr((i, j), tuple(its[p] for p in sum_order), body)


def same(a, b):
    return fingerprint(a) == fingerprint(b) and structurally_equal(a, b)


def test_invariant_under_summation_reordering():
    assert same(window(), window(sum_order=(3, 2)))


def test_invariant_under_operand_reordering():
    assert same(window(), window(swap_operands=True))
    i = Iterator("i", 0, 8)
    e1 = Expr((i,), (), A[i.var, i.var] + B[i.var, i.var])
    e2 = Expr((i,), (), B[i.var, i.var] + A[i.var, i.var])
    assert same(e1, e2)
    # index functions commute too: A[i + 1] vs A[1 + i]
    t = Tensor("T", (9,))
    assert same(Expr((i,), (), t[i.var + 1]), Expr((i,), (), t[1 + i.var]))


def test_invariant_under_iterator_renaming():
    assert same(window(), window(names=("p", "q", "u", "v")))


def test_invariant_under_renaming_of_equal_tensors():
    """Two scopes computing the same thing with differently named iterators are one tensor."""
    def relu_scope(name):
        x = Iterator(name, 0, 8)
        y = Iterator(name + "2", 0, 8)
        return Expr((x, y), (), unary("relu", A[x.var, y.var])).as_scope()

    i, j = Iterator("i", 0, 8), Iterator("j", 0, 8)
    e1 = Expr((i, j), (), relu_scope("a")[i.var, j.var] * B[i.var, j.var])
    e2 = Expr((i, j), (), B[i.var, j.var] * relu_scope("z")[i.var, j.var])
    assert same(e1, e2)


def test_sensitive_to_traversal_order():
    i, j = Iterator("i", 0, 8), Iterator("j", 0, 8)
    e1 = Expr((i, j), (), A[i.var, j.var])
    e2 = Expr((j, i), (), A[i.var, j.var])  # the transpose
    assert fingerprint(e1) != fingerprint(e2)
    assert not structurally_equal(e1, e2)


def test_swapped_summation_iterators_of_equal_range_do_not_collide():
    """K[r,s] vs K[s,r] with equal ranges: EinNet's range-only hashing would collide."""
    assert fingerprint(window()) != fingerprint(window(k_swapped=True))
    assert not structurally_equal(window(), window(k_swapped=True))


def test_different_operators_differ_and_equal_ones_agree():
    x, w = Tensor("X", (1, 4, 6, 6)), Tensor("W", (4, 4, 3, 3))
    c1 = C.conv2d(x, w, padding=1)
    assert same(c1, C.conv2d(x, w, padding=(1, 1, 1, 1)))
    assert fingerprint(c1) != fingerprint(C.conv2d(x, w, padding=1, strides=2))
    assert fingerprint(c1) != fingerprint(C.conv2d(x, w))  # no padding: other index offsets
