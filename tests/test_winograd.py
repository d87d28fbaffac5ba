"""Winograd minimal filtering (`relay_passes.winograd`): the algorithms' identity (exact),
the transform kernels against numpy on odd shapes (batches, ragged tiles, scalar and vector
code, float64), the whole form against TVM's own conv2d, what it refuses, and the derivation
pass keeping only verified rewrites (a planted wrong algorithm is refused)."""
from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_einweld.cost_model import Peaks
from tvm_einweld.relay_passes import winograd as W
from tvm_einweld.relay_passes.derivation_transform import DerivationTransform

from conftest import run_vm

F23, F43 = W.ALGORITHMS


def _plan(alg, data, f, padding=(1, 1, 1, 1), dtype="float32", lanes=8):
    return W.WinogradConv(tuple(data), (f, data[1], 3, 3), padding, dtype, alg, lanes)


def _build(prim_func):
    return tvm.compile(prim_func.with_attr("global_symbol", "main"), "llvm")


def _call(prim_func, *arrays, out_shape, dtype):
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    _build(prim_func)(*[tvm.runtime.tensor(a) for a in arrays], out)
    return out.numpy()


@pytest.mark.parametrize("alg", W.ALGORITHMS, ids=lambda a: a.name)
def test_identity_is_exact(alg):
    assert W.exact_identity(alg)
    assert W.identity_proof(alg).proven


def test_planted_wrong_coefficient_is_refuted():
    at = list(F23.at)
    at[1] = (Fraction(0), Fraction(1), Fraction(1), Fraction(-1))  # one sign flipped
    wrong = replace(F23, at=tuple(at))
    assert not W.exact_identity(wrong)
    assert W.identity_proof(wrong).status == "refuted"


@pytest.mark.parametrize("alg", W.ALGORITHMS, ids=lambda a: a.name)
@pytest.mark.parametrize("lanes", [1, 8, 16])
@pytest.mark.parametrize("data,dtype", [((2, 3, 11, 13), "float32"), ((1, 2, 7, 30), "float32"),
                                        ((1, 2, 9, 9), "float64")])
def test_transform_kernels_match_numpy(alg, lanes, data, dtype, rng):
    plan = _plan(alg, data, 5, dtype=dtype, lanes=lanes)
    n, c, hp, wp = W.padded_input_shape(plan)
    (th, tiles_w), (oh, ow), (m, a) = plan.tiles, plan.out_hw, (alg.m, alg.alpha)
    tw = plan.stored_columns  # (beyond tiles_w: columns the output transform never reads)
    assert tw >= tiles_w and wp == tw * m + alg.r - 1
    bt, at = np.array(alg.bt, float), np.array(alg.at, float)
    x = rng.standard_normal((n, c, hp, wp)).astype(dtype)
    want = np.zeros((a * a, c, n * th * tw))
    for b in range(n):
        for ty in range(th):
            for tx in range(tw):
                d = x[b, :, ty * m:ty * m + a, tx * m:tx * m + a].astype(float)
                want[:, :, (b * th + ty) * tw + tx] = \
                    np.einsum("ip,cpq,jq->ijc", bt, d, bt).reshape(a * a, c)
    want = want.transpose(1, 0, 2)  # V is stored [c, (i, j), t]
    got = _call(W.input_transform(plan), x, out_shape=want.shape, dtype=dtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    mm = rng.standard_normal((a * a, 5, n * th * tw)).astype(dtype)
    tiles = np.einsum("ki,ijft,lj->ftkl", at, mm.reshape(a, a, 5, -1).astype(float), at)
    want = tiles.reshape(5, n, th, tw, m, m).transpose(1, 0, 2, 4, 3, 5) \
        .reshape(n, 5, th * m, tw * m)[:, :, :oh, :ow]
    got = _call(W.output_transform(plan), mm, out_shape=want.shape, dtype=dtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _conv_module(data, f, padding, dtype, form, weight, dilation=1):
    x = relax.Var("x", relax.TensorType(data, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            w = relax.const(weight, dtype)
            call = bb.normalize(relax.op.nn.conv2d(x, w, padding=padding, dilation=dilation))
            y = bb.emit(call) if form is None else W.emit(bb, x, w,
                                                          replace(W.match(call, form), lanes=4))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("alg", W.ALGORITHMS, ids=lambda a: a.name)
@pytest.mark.parametrize("data,f,padding,dtype,dilation", [
    ((1, 8, 14, 14), 16, (1, 1, 1, 1), "float32", 1),
    ((2, 3, 13, 10), 5, (0, 2, 1, 0), "float32", 1),  # batch 2, asymmetric padding, ragged
    ((1, 4, 9, 7), 3, (1, 1, 1, 1), "float64", 1),
    ((1, 8, 14, 14), 6, (2, 2, 2, 2), "float32", 2),  # CSRNet's: phases of 9x9
    ((2, 3, 15, 15), 4, (3, 3, 3, 3), "float32", 3),  # 3x3 phases of 7x7, batch 2
])
def test_winograd_form_equals_conv2d(alg, data, f, padding, dtype, dilation, rng):
    weight = (rng.standard_normal((f, data[1], 3, 3)) / 3).astype(dtype)
    x = rng.standard_normal(data).astype(dtype)
    want = run_vm(_conv_module(data, f, padding, dtype, None, weight, dilation), x)
    got = run_vm(_conv_module(data, f, padding, dtype, alg, weight, dilation), x)
    tol = 1e-12 if dtype == "float64" else (2e-6 if alg is F23 else 2e-5)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def _conv_call(data=(1, 8, 14, 14), weight=(8, 8, 3, 3), dtype="float32", **attrs):
    x = relax.Var("x", relax.TensorType(data, dtype))
    w = relax.Var("w", relax.TensorType(weight, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        call = bb.normalize(relax.op.nn.conv2d(x, w, **attrs))
        bb.emit_func_output(call)
    return call


@pytest.mark.parametrize("call", [
    _conv_call(strides=2), _conv_call(data=(1, 8, 13, 14), dilation=2, padding=2),
    _conv_call(dilation=(1, 2)), _conv_call(weight=(8, 4, 3, 3), groups=2),
    _conv_call(weight=(8, 8, 5, 5)), _conv_call(dtype="int32"), _conv_call(data=(1, 8, 2, 2)),
], ids=["stride", "dilation into unequal phases", "unequal dilations", "groups", "5x5",
        "int32", "smaller than a tile"])
def test_what_it_does_not_rewrite(call):
    assert all(W.match(call, alg) is None for alg in W.ALGORITHMS)


def test_plans_pick_by_roofline_and_skip_other_targets():
    peaks = Peaks(flops=200e9, bandwidth=30e9)
    big = _conv_call(data=(1, 64, 56, 56), weight=(64, 64, 3, 3), padding=1)
    [plan] = W.plans(big, tvm.target.Target("llvm"), peaks)
    assert plan.alg is F43  # 4x fewer multiplies, tiles fill the panels
    # 512 channels on a 7x7 map: F(4, 3)'s four tiles fill no panel; F(2, 3) is cheaper.
    deep = _conv_call(data=(1, 512, 7, 7), weight=(512, 512, 3, 3), padding=1)
    assert [p.alg for p in W.plans(deep, tvm.target.Target("llvm"), peaks)] == [F23]
    assert W.plans(big, tvm.target.Target("cuda"), peaks) == []


def _conv_relu(rng, c=16, hw=12):
    weight = (rng.standard_normal((c, c, 3, 3)) / 12).astype("float32")
    x = relax.Var("x", relax.TensorType((1, c, hw, hw), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), padding=1))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(out)
    return bb.get()


def _forced(**options):
    # min_speedup=0 applies the cheapest alternative (no timing decides: measure=False).
    return DerivationTransform(max_depth=0, max_states=1, min_speedup=0, measure=False,
                               **options)


def test_derivation_applies_a_verified_winograd_rewrite(rng, fresh_decisions):
    mod = _conv_relu(rng)
    transform = _forced()
    new = transform(mod)
    [result] = transform.last_results
    [conv] = [o for o in result.ops if o.op.kind == "relax.nn.conv2d"]
    assert any(c.label == "winograd" for c in conv.candidates)
    assert result.applied and conv.chosen.label == "winograd", result.verification
    assert conv.chosen.proofs and all(p.proven for p in conv.chosen.proofs)
    x = rng.standard_normal((1, 16, 12, 12)).astype("float32")
    np.testing.assert_allclose(run_vm(new, x), run_vm(mod, x), rtol=1e-5, atol=1e-5)
    assert not _forced(winograd=False)(mod).same_as(None)  # the option exists and runs


def test_planted_wrong_algorithm_is_not_applied(rng, fresh_decisions, monkeypatch):
    # F(4, 3) is the form chosen for this conv (above); one of its signs flipped.
    at = list(F43.at)
    at[1] = tuple(-v if k == 3 else v for k, v in enumerate(at[1]))
    monkeypatch.setattr(W, "ALGORITHMS", (F23, replace(F43, at=tuple(at))))
    mod = _conv_relu(rng)
    transform = _forced()
    new = transform(mod)
    [result] = transform.last_results
    assert not result.applied
    assert "refuted" in result.verification or "not equal" in result.verification.lower() \
        or "differ" in result.verification.lower(), result.verification
    x = rng.standard_normal((1, 16, 12, 12)).astype("float32")
    np.testing.assert_allclose(run_vm(new, x), run_vm(mod, x), rtol=1e-6, atol=1e-6)
