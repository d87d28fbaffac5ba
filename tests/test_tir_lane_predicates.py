"""Vectorised loops whose block predicate varies by lane, split into whole vectors under a
test of the last lane and the loop as it was (tir_passes/lane_predicates.py): the split found
for a padded GEMM tile's crop and for every monotone bound, refused for any other condition,
kernels against numpy (odd sizes, f64) with the padding they must not write left untouched,
and a planted fault (testing the first lane instead of the last) that the numeric check
catches."""
import numpy as np
import pytest
import tvm
import tvm_einweld  # noqa: F401  (registers the pipelines)
from tvm import s_tir, tirx
from tvm.script import tirx as T
from tvm_ffi import structural_equal, structural_map

from tvm_einweld.tir_passes import deinterleave, lane_predicates
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu import gemm

from test_cpu_rules_gemm import te_matmul

TARGET = host_target()
RNG = np.random.default_rng(11)
SENTINEL = -7.0


def crop(rows: int, pitch: int, columns: int, lanes: int, condition: str = "plain",
         dtype: str = "float32") -> tirx.PrimFunc:
    """B[r, c] = 2 * A[r, c] for c < `columns` (or the bound `condition` names), in vectors
    of `lanes` over a row of `pitch` >= columns elements, the rest of B left as it was."""
    vectors = pitch // lanes

    @T.prim_func(s_tir=True)
    def func(A: T.Buffer((rows, pitch), dtype), B: T.Buffer((rows, pitch), dtype)):
        for r, vo in T.grid(rows, vectors):
            for vi in T.vectorized(lanes):
                with T.sblock("B"):
                    i = T.axis.spatial(rows, r)
                    j = T.axis.spatial(pitch, vo * lanes + vi)
                    if condition == "plain":
                        T.where(r < rows and vo * lanes + vi < columns)
                    elif condition == "flipped":
                        T.where(columns > vo * lanes + vi)
                    elif condition == "le":
                        T.where(vo * lanes + vi <= columns - 1)
                    elif condition == "modulo":
                        T.where(vo * lanes + vi < columns and (vo * lanes + vi) % 3 != 1)
                    elif condition == "decreasing":
                        T.where(pitch - 1 - (vo * lanes + vi) < columns)
                    elif condition == "either":
                        T.where(vo * lanes + vi < columns or r == 0)
                    B[i, j] = A[i, j] * T.Cast(dtype, 2)

    return func.with_attr("global_symbol", "main")


def _splits(func: tirx.PrimFunc) -> int:
    """IfThenElse nodes whose then-branch is a vectorised loop (the split's shape)."""
    found = []

    def visit(node):
        then = node.then_case
        if isinstance(then, tirx.For) and then.kind == tirx.ForKind.VECTORIZED:
            found.append(node)
        return node

    structural_map(func.body, [(tirx.IfThenElse, visit)])
    return len(found)


def _build(func: tirx.PrimFunc):
    return tvm.tirx.build(tvm.IRModule({"main": func}), target=TARGET,
                          pipeline=deinterleave.TIR_PIPELINE)


def _run_crop(func, rows, pitch, dtype):
    a = RNG.standard_normal((rows, pitch)).astype(dtype)
    b = tvm.runtime.tensor(np.full((rows, pitch), SENTINEL, dtype))
    _build(func)["main"](tvm.runtime.tensor(a), b)
    return a, b.numpy()


@pytest.mark.parametrize("rows,pitch,columns,lanes,condition,dtype", [
    (3, 48, 37, 16, "plain", "float32"),     # the crop of a padded tile
    (2, 32, 5, 16, "flipped", "float32"),    # fewer columns than lanes, `N > c`
    (5, 24, 19, 8, "le", "float64"),         # fp64 lanes, `c <= N - 1`
    (1, 64, 64, 16, "plain", "float32"),     # every vector whole
])
def test_monotone_bounds_split_and_match_numpy(rows, pitch, columns, lanes, condition, dtype):
    func = crop(rows, pitch, columns, lanes, condition, dtype)
    split = lane_predicates.split_function(func)
    assert _splits(split) == 1
    a, b = _run_crop(func, rows, pitch, dtype)
    np.testing.assert_array_equal(b[:, :columns], 2 * a[:, :columns])
    assert (b[:, columns:] == SENTINEL).all()  # the padding is never written


@pytest.mark.parametrize("condition", ["modulo", "decreasing", "either"])
def test_other_conditions_are_left_alone(condition):
    func = crop(3, 48, 37, 16, condition)
    assert structural_equal(lane_predicates.split_function(func), func)
    a, b = _run_crop(func, 3, 48, "float32")
    cols = np.arange(48)
    keep = {"modulo": (cols < 37) & (cols % 3 != 1),
            "decreasing": 47 - cols < 37}.get(condition)
    if keep is None:  # "either": row 0 whole, other rows cropped
        keep = np.broadcast_to(cols < 37, (3, 48)).copy()
        keep[0] = True
    want = np.where(keep, 2 * a, SENTINEL)
    np.testing.assert_array_equal(b, want)


def test_split_leaves_a_lane_invariant_test_for_the_vectoriser():
    func = crop(3, 48, 37, 16, "plain")
    split = lane_predicates.split_function(func)
    branches = []
    structural_map(split.body, [(tirx.IfThenElse, lambda n: branches.append(n) or n)])
    whole = branches[0].then_case.body
    assert isinstance(whole, s_tir.SBlockRealize)
    assert "vi" not in str(whole.predicate) and "vo" not in str(whole.predicate)


@pytest.mark.parametrize("m,n,k,dtype", [
    (197, 197, 64, "float32"),   # ViT's attention scores: N padded to whole panels
    (97, 89, 101, "float32"),    # primes
    (31, 17, 19, "float64"),     # fp64
    (5, 7, 3, "float32"),        # N below the lanes: only a partial vector
])
def test_padded_gemm_against_numpy(m, n, k, dtype):
    func = te_matmul(m, n, k, dtype)
    sch = gemm.GEMM().apply(func, TARGET, False)
    assert sch is not None
    scheduled = sch.mod["main"].with_attr("target", TARGET)
    assert _splits(lane_predicates.split_function(scheduled)) >= 1
    a, b = RNG.standard_normal((m, k)).astype(dtype), RNG.standard_normal((k, n)).astype(dtype)
    out = tvm.runtime.tensor(np.zeros((m, n), dtype))
    _build(sch.mod["main"])["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=tol, atol=tol)


def test_planted_first_lane_test_is_caught(monkeypatch):
    """Testing the first lane instead of the last takes the whole-vector branch for the
    partial vector too: the padding columns get written, which the check sees."""
    monkeypatch.setattr(lane_predicates, "tested_lane", lambda loop: loop.min)
    func = crop(3, 48, 37, 16, "plain")
    a, b = _run_crop(func, 3, 48, "float32")
    np.testing.assert_array_equal(b[:, :37], 2 * a[:, :37])
    assert not (b[:, 37:] == SENTINEL).all()
