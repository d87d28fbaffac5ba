"""Gathers read inside the contraction that uses them (relay_passes/gather_contraction.py) and
the CPU rules for the fused kernel (rules.cpu.injective.gathered_contraction): Longformer-style
windowed attention (keys and values gathered by a clamped window table, scored and combined
by einsum) against numpy on odd sizes, which rule takes each form, what is left alone (a
gather with two users, a gather feeding no contraction), and the rules refusing the form
whose vectors would not be contiguous."""
import numpy as np
import pytest
import tvm
import tvm_einweld  # noqa: F401  (registers the pipelines)
from tvm import relax, te, topi

from tvm_einweld.einweld_pipeline import EinweldOptimize
from tvm_einweld.relay_passes.gather_contraction import FuseGatherIntoContraction, is_gather
from tvm_einweld.tir_passes import prepare
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu import injective, reduction

TARGET = host_target()


def window_table(seq: int, window: int, dilation: int) -> np.ndarray:
    offsets = dilation * (np.arange(2 * window + 1) - window)
    return np.clip(np.arange(seq)[:, None] + offsets[None, :], 0, seq - 1).astype("int64")


def attention(heads: int, seq: int, dim: int, window: int, dilation: int, dtype: str,
              share_keys: bool = False) -> tvm.IRModule:
    """scores = einsum(q, K[window]); out = einsum(softmax(scores), V[window]) (V = K when
    `share_keys`: one gather with two users)."""
    table = relax.const(window_table(seq, window, dilation))
    q, k, v = (relax.Var(n, relax.TensorType((1, heads, seq, dim), dtype)) for n in "qkv")
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            k_win = bb.emit(relax.op.take(k, table, axis=2))
            v_win = k_win if share_keys else bb.emit(relax.op.take(v, table, axis=2))
            scores = bb.emit(relax.op.einsum((q, k_win), "bhsd,bhswd->bhsw"))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            out = bb.emit_output(bb.emit(relax.op.einsum((probs, v_win), "bhsw,bhswd->bhsd")))
        bb.emit_func_output(out)
    return bb.get()


def reference(q, k, v, table):
    scores = np.einsum("bhsd,bhswd->bhsw", q, k[:, :, table])
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhsw,bhswd->bhsd", probs, v[:, :, table])


def _inputs(heads, seq, dim, dtype, rng):
    return [rng.standard_normal((1, heads, seq, dim)).astype(dtype) for _ in range(3)]


@pytest.mark.parametrize("heads,seq,dim,window,dilation", [(2, 37, 13, 3, 2), (3, 64, 16, 4, 1),
                                                           (1, 29, 64, 5, 3)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_windowed_attention_against_numpy(heads, seq, dim, window, dilation, dtype, rng):
    mod = attention(heads, seq, dim, window, dilation, dtype)
    ex = tvm.compile(mod, TARGET, relax_pipeline="einweld")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    q, k, v = _inputs(heads, seq, dim, dtype, rng)
    got = vm["main"](*map(tvm.runtime.tensor, (q, k, v))).numpy()
    tol = 1e-5 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(got, reference(q, k, v, window_table(seq, window, dilation)),
                               rtol=tol, atol=tol)


def _kernels(mod: tvm.IRModule) -> list[str]:
    return [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]


def test_each_gather_is_read_inside_its_einsum_and_scheduled_by_its_access_pattern():
    optimize = EinweldOptimize(TARGET, derive=False, fuse=False)
    with TARGET:
        out = optimize(attention(2, 40, 32, 4, 2, "float32"))
    names = _kernels(out)
    assert not any(n.startswith("take") for n in names)  # no gather kernel of its own
    rules = {n: r for n, r in optimize.rules.scheduled.items() if "take" in n}
    # Scores: a dot product along contiguous rows (reduction rule); the combination: vectors
    # along the contiguous head dimension, the window reduced into them (injective rule).
    assert sorted(rules.values()) == ["injective", "reduction"], rules


def test_a_gather_with_two_users_or_no_contraction_stays():
    with TARGET:
        shared = prepare()(attention(2, 24, 16, 2, 1, "float32", share_keys=True))
    assert any(n.startswith("take") for n in _kernels(shared))

    x = relax.Var("x", relax.TensorType((6, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(relax.op.take(x, relax.const(np.array([5, 0, 2], "int64")), axis=0))
            out = bb.emit_output(bb.emit(relax.op.exp(g)))
        bb.emit_func_output(out)
    mod = bb.get()
    with TARGET:
        before = relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(
            relax.transform.LegalizeOps()(mod)))
    assert FuseGatherIntoContraction(before).same_as(before)


def _gathered(form: str, dtype: str = "float32"):
    q = te.placeholder((2, 20, 16), dtype, name="q")
    k = te.placeholder((2, 20, 16), dtype, name="k")
    table = te.placeholder((20, 5), "int64", name="table")
    window = topi.take(k, table, axis=1, mode="fast")
    if form == "scores":
        out = topi.einsum("hsd,hswd->hsw", q, window)
        args = [q, k, table, out]
    else:
        p = te.placeholder((2, 20, 5), dtype, name="p")
        out = topi.einsum("hsw,hswd->hsd", p, window)
        args = [p, k, table, out]
    return te.create_prim_func(args)


def test_each_rule_takes_only_the_form_with_contiguous_vectors():
    scores, combine = _gathered("scores"), _gathered("combine")
    assert injective.schedule_injective(scores, TARGET) is None  # window along strided rows
    assert reduction.schedule_reduction(combine, TARGET) is None  # window reduced across rows
    assert injective.schedule_injective(combine, TARGET) is not None
    assert reduction.schedule_reduction(scores, TARGET) is not None


def test_the_gather_producer_is_recognised():
    k = te.placeholder((4, 9), "float32", name="k")
    table = te.placeholder((3,), "int64", name="table")
    gather = te.create_prim_func([k, table, topi.take(k, table, axis=0, mode="fast")])
    copy = te.create_prim_func([k, te.compute((4, 9), lambda i, j: k[i, j] * 2.0)])
    assert is_gather(gather) and not is_gather(copy)


def _take_then_einsum(table: np.ndarray, source: tuple, other: tuple, subscripts: str):
    x = relax.Var("x", relax.TensorType(source, "float32"))
    y = relax.Var("y", relax.TensorType(other, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            g = bb.emit(relax.op.take(x, relax.const(table), axis=0))
            out = bb.emit_output(bb.emit(relax.op.einsum((y, g), subscripts)))
        bb.emit_func_output(out)
    return bb.get()


def test_an_embedding_lookup_or_a_kernel_no_rule_takes_stays_a_gather(rng):
    """A lookup of fewer rows than the table (the GEMM rule keeps the matmul after it), and a
    repeating gather whose contraction neither rule could schedule grouped (contiguous along
    neither the output's innermost axis nor the reduction): both keep their gather kernel,
    and both still compute what numpy does."""
    lookup = _take_then_einsum(np.array([5, 0, 2, 7], "int64"), (9, 24), (24, 16), "cd,nc->nd")
    window = np.repeat(np.arange(6, dtype="int64"), 3)  # 18 rows of 6: repeats them
    neither = _take_then_einsum(window, (6, 10), (10, 18), "ds,sd->s")
    for mod, table, source, other, subscripts in (
            (lookup, np.array([5, 0, 2, 7]), (9, 24), (24, 16), "cd,nc->nd"),
            (neither, window, (6, 10), (10, 18), "ds,sd->s")):
        with TARGET:
            assert any(n.startswith("take") for n in _kernels(prepare()(mod)))
        ex = tvm.compile(mod, TARGET, relax_pipeline="einweld")
        x = rng.standard_normal(source).astype("float32")
        y = rng.standard_normal(other).astype("float32")
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x),
                                                        tvm.runtime.tensor(y)).numpy()
        np.testing.assert_allclose(got, np.einsum(subscripts, y, x[table]), rtol=1e-5,
                                   atol=1e-5)
