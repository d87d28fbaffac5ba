"""The numpy-BLAS GEMM provider: same results as numpy and TVM's matmul, measured selection."""
from __future__ import annotations

import math

import numpy as np
import pytest
from tvm import relax

from conftest import compile_vm
from tvm_einweld.relay_passes import numpy_gemm
from tvm_einweld.relay_passes.numpy_gemm import choose_matmul_provider, matmul_call


def _run(a_shape, b_shape, use_provider: bool, dtype: str = "float32"):
    a = relax.Var("a", relax.TensorType(a_shape, dtype))
    b = relax.Var("b", relax.TensorType(b_shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            call = matmul_call(a, b) if use_provider else relax.op.matmul(a, b)
            out = bb.emit_output(bb.emit(call))
        bb.emit_func_output(out)
    run = compile_vm(bb.get())
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, a_shape).astype(dtype)
    y = rng.uniform(-1, 1, b_shape).astype(dtype)
    return run(x, y), x, y


@pytest.mark.parametrize("a_shape,b_shape", [
    ((33, 17), (17, 9)),            # odd sizes
    ((4, 16, 8), (4, 8, 12)),       # batched
    ((3, 1, 5, 6), (2, 6, 7)),      # broadcast batch dimensions
])
def test_provider_equals_numpy_and_tvm(a_shape, b_shape):
    got, x, y = _run(a_shape, b_shape, use_provider=True)
    ref, _, _ = _run(a_shape, b_shape, use_provider=False)
    np.testing.assert_allclose(got, np.matmul(x, y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert got.shape == numpy_gemm.output_shape(a_shape, b_shape)


def test_float64():
    got, x, y = _run((8, 5), (5, 3), use_provider=True, dtype="float64")
    np.testing.assert_allclose(got, x @ y, rtol=1e-12)


def test_supports():
    f32 = lambda *s: relax.Var("v", relax.TensorType(s, "float32"))
    assert numpy_gemm.supports(f32(4, 3), f32(3, 2))
    assert not numpy_gemm.supports(f32(4, 3), f32(4, 2))  # inner dimensions differ
    assert not numpy_gemm.supports(f32(4), f32(4, 2))  # rank 1
    assert not numpy_gemm.supports(relax.Var("i", relax.TensorType((4, 3), "int32")),
                                   relax.Var("j", relax.TensorType((3, 2), "int32")))
    with pytest.raises(ValueError):
        matmul_call(f32(4, 3), f32(4, 2))


def test_choice_is_by_measured_time():
    a = relax.Var("a", relax.TensorType((64, 96), "float32"))
    b = relax.Var("b", relax.TensorType((96, 80), "float32"))
    provider, seconds = choose_matmul_provider(a, b)
    assert provider in ("numpy_gemm", "tvm")
    assert math.isfinite(seconds) and seconds > 0
    # The choice is the faster of the two cached measurements.
    from tvm_einweld.relay_passes.op_cost import time_call

    times = {"tvm": time_call(relax.op.matmul(a, b)), "numpy_gemm": time_call(matmul_call(a, b))}
    assert seconds == min(times.values()) and times[provider] == seconds
