"""ConvTransposePhases: strided conv2d_transpose as stride^2 stride-1 convolutions.

Numerics against numpy's scatter definition of the transposed convolution and against TVM's
own conv2d_transpose, on odd shapes (strides that differ per axis, asymmetric padding,
output padding, groups, a stride larger than the kernel, padding that crops the input,
batches, weights as inputs, float64); a planted fault in the phase plan must be caught."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_einweld.relay_passes import conv_transpose_phases as ctp
from tvm_einweld.relay_passes.conv_transpose_phases import ConvTransposePhases, plan_dimension


def reference(x: np.ndarray, w: np.ndarray, strides, padding, output_padding, groups):
    """out[n, f, s*i + ky - top, s*j + kx - left] += x[n, c, i, j] * w[c, f, ky, kx]."""
    n, c, h, wd = x.shape
    _, f_per_group, kh, kw = w.shape
    (sh, sw), (top, left, bottom, right), (oph, opw) = strides, padding, output_padding
    out_h = (h - 1) * sh - top - bottom + kh + oph
    out_w = (wd - 1) * sw - left - right + kw + opw
    full = np.zeros((n, f_per_group * groups, max((h - 1) * sh + kh, top + out_h),
                     max((wd - 1) * sw + kw, left + out_w)), np.float64)
    cg = c // groups
    for g in range(groups):
        xs = x[:, g * cg:(g + 1) * cg].astype(np.float64)
        for ky in range(kh):
            for kx in range(kw):
                contrib = np.einsum("nchw,cf->nfhw", xs, w[g * cg:(g + 1) * cg, :, ky, kx])
                full[:, g * f_per_group:(g + 1) * f_per_group,
                     ky:ky + (h - 1) * sh + 1:sh, kx:kx + (wd - 1) * sw + 1:sw] += contrib
    return full[:, :, top:top + out_h, left:left + out_w]


def conv_transpose_module(x_shape, w_shape, strides, padding, output_padding, groups,
                          dtype="float32", weight=None):
    """main(x) with constant weights (`weight` given), else main(x, w)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    params = [x]
    if weight is None:
        w = relax.Var("w", relax.TensorType(w_shape, dtype))
        params.append(w)
    else:
        w = relax.const(weight)
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d_transpose(x, w, strides=strides, padding=padding,
                                                     output_padding=output_padding,
                                                     groups=groups))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def run(mod, *args):
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def ops_of(mod) -> list[str]:
    names = []
    relax.analysis.post_order_visit(mod["main"], lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


CASES = [  # x shape, w shape (IOHW), strides, padding (t, l, b, r), output padding, groups
    ((1, 8, 5, 5), (8, 6, 4, 4), (2, 2), (1, 1, 1, 1), (0, 0), 1),  # DCGAN's layer
    ((2, 3, 7, 6), (3, 5, 3, 3), (2, 2), (0, 0, 0, 0), (1, 1), 1),  # odd kernel, batch 2
    ((1, 4, 4, 5), (4, 1, 9, 9), (4, 4), (4, 4, 4, 4), (0, 0), 1),  # FSRCNN's 9x9 / 4
    ((1, 4, 6, 6), (4, 4, 3, 5), (3, 2), (2, 1, 0, 3), (2, 1), 2),  # per-axis, groups
    ((1, 5, 3, 3), (5, 7, 2, 2), (3, 3), (0, 0, 0, 0), (0, 0), 1),  # stride > kernel
    ((1, 4, 5, 5), (4, 1, 4, 4), (2, 2), (3, 3, 3, 3), (0, 0), 4),  # crops x, depthwise
    ((1, 2, 1, 1), (2, 3, 4, 4), (2, 2), (0, 0, 0, 0), (0, 0), 1),  # 1x1 input: a matmul
    ((1, 100, 1, 1), (100, 64, 4, 4), (1, 1), (0, 0, 0, 0), (0, 0), 1),  # DCGAN's first
    ((3, 5, 1, 1), (5, 7, 3, 3), (1, 1), (1, 0, 0, 1), (0, 0), 1),  # point, cropped, batch 3
    ((1, 2, 1, 1), (2, 3, 4, 4), (2, 2), (0, 0, 0, 0), (1, 1), 1),  # point, output padding
    ((1, 4, 1, 1), (4, 3, 3, 3), (2, 2), (0, 0, 0, 0), (0, 0), 2),  # point, groups
    ((1, 3, 5, 4), (3, 2, 3, 3), (1, 2), (1, 0, 1, 0), (0, 1), 1),  # stride 1 on one axis
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("constant", [True, False], ids=["const_w", "input_w"])
def test_phases_match_numpy_and_tvm(case, constant):
    x_shape, w_shape, strides, padding, output_padding, groups = case
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    mod = conv_transpose_module(x_shape, w_shape, strides, padding, output_padding, groups,
                                weight=w if constant else None)
    rewritten = ConvTransposePhases(mod)
    assert "relax.nn.conv2d_transpose" not in ops_of(rewritten)
    convs = [op for op in ops_of(rewritten) if op == "relax.nn.conv2d"]
    if x_shape[2:] == (1, 1) and groups == 1 and output_padding == (0, 0):
        assert not convs and "relax.matmul" in ops_of(rewritten)  # a point input
    else:
        assert 0 < len(convs) <= strides[0] * strides[1]
    args = (x,) if constant else (x, w)
    expected = reference(x, w, strides, padding, output_padding, groups)
    got = run(rewritten, *args)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, run(mod, *args), rtol=1e-5, atol=1e-5)


def test_float64():
    case = CASES[3]
    x_shape, w_shape, strides, padding, output_padding, groups = case
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    mod = ConvTransposePhases(conv_transpose_module(x_shape, w_shape, strides, padding,
                                                    output_padding, groups, "float64"))
    np.testing.assert_allclose(run(mod, x, w), reference(x, w, strides, padding,
                                                         output_padding, groups), rtol=1e-12)


def test_left_alone():
    """Stride 1 (nothing to skip) and dilation are not rewritten: the module is returned."""
    for strides, dilation in (((1, 1), (1, 1)), ((2, 2), (2, 2))):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((1, 3, 5, 5), "float32"))
        w = relax.Var("w", relax.TensorType((3, 4, 3, 3), "float32"))
        with bb.function("main", [x, w]):
            with bb.dataflow():
                out = bb.emit_output(bb.emit(relax.op.nn.conv2d_transpose(
                    x, w, strides=strides, dilation=dilation)))
            bb.emit_func_output(out)
        mod = bb.get()
        assert ConvTransposePhases(mod).same_as(mod)


def test_every_tap_in_exactly_one_phase():
    """The phases partition the kernel: each tap k serves the residue (k - pad) mod s."""
    for kernel, stride, pad in ((4, 2, 1), (9, 4, 4), (3, 3, 0), (2, 3, 0), (5, 2, 3)):
        plan = plan_dimension(6, kernel, stride, pad, pad)
        taps = sorted(t for p in plan.phases for t in p.taps)
        assert taps == list(range(kernel))
        for phase in plan.phases:
            assert all((t - pad - phase.residue) % stride == 0 for t in phase.taps)
        assert plan.length * stride >= plan.out_len > (plan.length - 1) * stride


def test_planted_fault_is_caught(monkeypatch):
    """A plan whose phases read the input one position late must fail the comparison: the
    numeric test above is not vacuous."""
    real = ctp.plan_dimension

    def shifted(*args, **kwargs):
        plan = real(*args, **kwargs)
        phases = tuple(ctp.Phase(p.residue, p.taps, p.crop, (p.pad[0] + 1, max(p.pad[1] - 1, 0)))
                       if p.taps and p.pad[1] > 0 else p for p in plan.phases)
        return ctp.PhasePlan(plan.stride, plan.out_len, plan.length, phases)

    monkeypatch.setattr(ctp, "plan_dimension", shifted)
    _, got, expected = _rewritten_run(CASES[0], seed=0)
    assert not np.allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_planted_fault_in_the_point_window_is_caught(monkeypatch):
    """A point input's weight window taken at (left, top) instead of (top, left) has the
    right shape and the wrong values: the numeric check must fail."""
    real = ctp._point_window

    def swapped(call):
        window = real(call)
        if window is None:
            return None
        n, c, f, top, left, oh, ow = window
        return n, c, f, left, top, oh, ow

    monkeypatch.setattr(ctp, "_point_window", swapped)
    mod, got, expected = _rewritten_run(CASES[8], seed=1)
    assert "relax.matmul" in ops_of(mod)
    assert not np.allclose(got, expected, rtol=1e-4, atol=1e-4)


def _rewritten_run(case, seed: int):
    """`case` with constant weights through ConvTransposePhases: (the rewritten module, its
    output, the numpy reference) on seeded random inputs."""
    x_shape, w_shape, strides, padding, output_padding, groups = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    mod = ConvTransposePhases(conv_transpose_module(x_shape, w_shape, strides, padding,
                                                    output_padding, groups, weight=w))
    return mod, run(mod, x), reference(x, w, strides, padding, output_padding, groups)
