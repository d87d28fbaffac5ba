"""The two-pass max-pooling rule (tir_passes/rules/cpu/pooling.py): windows of every kind
(kernels, strides, dilations, uneven padding, ceil mode, odd sizes, dtypes) claimed and equal,
bit for bit, to stock TVM's build and to numpy; what is not TVM's plain max_pool2d left alone;
planted faults (a pooling function that differs from the stock one in a detail) not claimed."""
from __future__ import annotations

import numpy as np
import pytest

import tvm
from tvm import relax, tirx
from tvm.relax import op as R

from tvm_ffi import structural_equal, structural_mutate

from conftest import compile_vm
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.fusion import prepare
from tvm_einweld.tir_passes.rules.cpu import ApplyCPURules
from tvm_einweld.tir_passes.rules.cpu import pooling
from tvm_einweld.tir_passes.rules.cpu.memory_bound import schedule_memory_bound

TARGET = host_target()
RNG = np.random.default_rng(11)


def _module(fn, shape, dtype):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(fn(x))
        bb.emit_func_output(out)
    return bb.get()


def _kernel(mod) -> tirx.PrimFunc:
    return next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))


def _numpy_max_pool(x, kernel, strides, dilation, padding, out_hw):
    """Windows by definition: taps outside the input are skipped; the float32/64 lowest
    value is where the stock reduction starts."""
    lowest = np.finfo(x.dtype).min if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    out = np.full(x.shape[:2] + tuple(out_hw), lowest, x.dtype)
    for y in range(out_hw[0]):
        for xo in range(out_hw[1]):
            for i in range(kernel[0]):
                for j in range(kernel[1]):
                    iy = strides[0] * y + dilation[0] * i - padding[0]
                    ix = strides[1] * xo + dilation[1] * j - padding[1]
                    if 0 <= iy < x.shape[2] and 0 <= ix < x.shape[3]:
                        out[:, :, y, xo] = np.maximum(out[:, :, y, xo], x[:, :, iy, ix])
    return out


WINDOWS = [  # shape, kernel, strides, dilation, padding, ceil_mode
    ((1, 64, 20, 20), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), False),  # ResNet's, smaller
    ((2, 3, 11, 37), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), False),
    ((1, 2, 13, 29), (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), False),
    ((1, 3, 15, 19), (3, 3), (2, 2), (1, 1), (0, 0, 0, 0), True),   # SqueezeNet's ceil mode
    ((1, 2, 9, 70), (3, 5), (1, 3), (1, 1), (1, 2, 0, 1), False),   # uneven, long rows
    ((1, 2, 17, 23), (3, 2), (2, 1), (2, 3), (2, 1, 1, 2), True),   # dilated, ceil
    ((1, 1, 5, 5), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), False),    # window over the image
]


@pytest.mark.parametrize("shape,kernel,strides,dilation,padding,ceil_mode", WINDOWS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_windows_claimed_and_bit_identical(shape, kernel, strides, dilation, padding, ceil_mode,
                                           dtype):
    fn = lambda x: R.nn.max_pool2d(x, pool_size=kernel, strides=strides, dilation=dilation,
                                   padding=padding, ceil_mode=ceil_mode)
    mod = prepare()(_module(fn, shape, dtype))
    window = pooling.match_max_pool2d(_kernel(mod))
    # In ceil mode TOPI pads the end by stride - 1 more: the window found may be the
    # floor-mode one with that padding, which is the same function.
    assert window is not None and window.kernel == kernel and window.strides == strides
    rules = ApplyCPURules(TARGET, [("memory-bound", schedule_memory_bound)])
    ours = compile_vm(rules(mod), TARGET)
    assert list(rules.scheduled.values()) == ["pooling"]
    stock = compile_vm(mod, TARGET)
    x = RNG.standard_normal(shape).astype(dtype)
    x.flat[::7] = -np.inf  # some windows hold nothing but -inf
    got = ours(x)
    np.testing.assert_array_equal(got, stock(x))
    np.testing.assert_array_equal(got, _numpy_max_pool(x, kernel, strides, dilation, padding,
                                                       got.shape[2:]))


def test_integer_pool():
    fn = lambda x: R.nn.max_pool2d(x, pool_size=(3, 3), strides=(2, 2), padding=(1, 1, 1, 1))
    mod = prepare()(_module(fn, (1, 4, 15, 33), "int32"))
    rules = ApplyCPURules(TARGET, [("memory-bound", schedule_memory_bound)])
    ours = compile_vm(rules(mod), TARGET)
    assert list(rules.scheduled.values()) == ["pooling"]
    x = RNG.integers(-2**31, 2**31 - 1, (1, 4, 15, 33), dtype=np.int64).astype("int32")
    np.testing.assert_array_equal(ours(x), compile_vm(mod, TARGET)(x))


@pytest.mark.parametrize("fn", [
    lambda x: R.nn.avg_pool2d(x, pool_size=(3, 3), strides=(2, 2), padding=(1, 1)),
    lambda x: R.nn.max_pool2d(x, pool_size=(1, 3), strides=(1, 2)),  # nothing to share
    lambda x: R.nn.max_pool2d(x, pool_size=(3, 3), strides=(2, 2), layout="NHWC"),
], ids=["avg", "1x3", "nhwc"])
def test_other_pools_left_to_other_rules(fn):
    mod = prepare()(_module(fn, (1, 6, 13, 13), "float32"))
    assert pooling.schedule_max_pool(_kernel(mod), TARGET) is None


def _replace_constant(func: tirx.PrimFunc, old: float, new: float) -> tirx.PrimFunc:
    """`func` with every float constant `old` replaced by `new` (a planted fault)."""
    def visit(node, mutator):
        if node.value == old:
            return tirx.FloatImm(str(node.ty), new)
        return node
    return structural_mutate(func, [(tirx.FloatImm, visit)])


def test_planted_differences_are_not_claimed():
    """Functions that look like a max pool but are not TVM's: padding with 0 instead of the
    lowest value (which the two-pass form would not reproduce), and a pool whose output is
    then clamped (a fused epilogue)."""
    fn = lambda x: R.nn.max_pool2d(x, pool_size=(3, 3), strides=(2, 2), padding=(1, 1, 1, 1))
    func = _kernel(prepare()(_module(fn, (1, 2, 9, 9), "float32")))
    assert pooling.match_max_pool2d(func) is not None
    lowest = float(np.finfo(np.float32).min)
    zero_padded = _replace_constant(func, lowest, 0.0)
    assert not structural_equal(zero_padded, func)
    assert pooling.match_max_pool2d(zero_padded) is None
    fused = _kernel(prepare()(_module(lambda x: R.clip(fn(x), 0, 6), (1, 2, 9, 9), "float32")))
    assert pooling.match_max_pool2d(fused) is None


def test_vectors_are_one_register_wide():
    """Both passes run in vectors of one register (the outputs read the rows every s-th
    element just after they are written: see `schedule_max_pool`), however long the row."""
    from tvm_einweld.tir_passes.rules.cpu.injective import cpu_params

    mod = prepare()(_module(lambda x: R.nn.max_pool2d(x, pool_size=(3, 3), strides=(2, 2),
                                                       padding=(1, 1)), (1, 4, 112, 112),
                            "float32"))
    sch = pooling.schedule_max_pool(_kernel(mod), TARGET)
    lanes = cpu_params(TARGET).lanes("float32")
    widths = []

    def visit(stmt):
        if isinstance(stmt, tirx.SeqStmt):
            for child in stmt.seq:
                visit(child)
        if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.VECTORIZED:
            widths.append(int(stmt.extent))
        for attr in ("block", "body", "init", "then_case", "else_case"):
            child = getattr(stmt, attr, None)
            if isinstance(child, tirx.Stmt):
                visit(child)
    visit(sch.mod["main"].body)
    assert len(widths) >= 6 and max(widths) <= lanes < 112 // 2, widths
