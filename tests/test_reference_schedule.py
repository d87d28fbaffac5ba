"""The reference build of module checks computes bit for bit what TVM's default build computes.

`verify.reference_schedule` reorders, decomposes and parallelises the loops of unscheduled
kernels so that whole-module checks run fast; a check is only as good as its reference, so
every kernel class here (matmul with odd and prime shapes, batch matmul with broadcasting,
conv2d strided/grouped, softmax, layer norm, reductions over every axis, a fused chain) is
built both ways and compared with `np.array_equal`, not a tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_einweld.verify.reference_schedule import (
    reference_build_pipeline, reference_schedule, schedule_reference_func,
)

RNG = np.random.default_rng(3)


def _module(params, body):
    """A Relax module main(*params) = body(bb, *vars)."""
    bb = relax.BlockBuilder()
    vars_ = [relax.Var(f"p{k}", relax.TensorType(shape, dtype))
             for k, (shape, dtype) in enumerate(params)]
    with bb.function("main", vars_):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *vars_))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, pipeline, arrays):
    ex = tvm.compile(mod, "llvm", relax_pipeline=pipeline)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


CASES = {
    "matmul prime": ([((7, 13), "float32"), ((13, 11), "float32")],
                     lambda bb, a, b: bb.emit(relax.op.matmul(a, b))),
    "matmul M=1 K<lanes": ([((1, 3), "float32"), ((3, 37), "float32")],
                           lambda bb, a, b: bb.emit(relax.op.matmul(a, b))),
    "batch matmul broadcast": ([((3, 1, 5, 17), "float32"), ((4, 17, 9), "float32")],
                               lambda bb, a, b: bb.emit(relax.op.matmul(a, b))),
    "matmul fp64": ([((5, 19), "float64"), ((19, 23), "float64")],
                    lambda bb, a, b: bb.emit(relax.op.matmul(a, b))),
    "conv2d strided grouped": (
        [((1, 6, 11, 9), "float32"), ((9, 2, 3, 3), "float32")],
        lambda bb, x, w: bb.emit(relax.op.nn.conv2d(x, w, strides=2, padding=1, groups=3))),
    "softmax": ([((5, 31), "float32")], lambda bb, x: bb.emit(relax.op.nn.softmax(x))),
    "layer norm": ([((2, 7, 33), "float32"), ((33,), "float32"), ((33,), "float32")],
                   lambda bb, x, g, b: bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1]))),
    "sum over axis 0": ([((29, 3), "float32")],
                        lambda bb, x: bb.emit(relax.op.sum(x, axis=[0]))),
    "sum over all": ([((4, 5, 6), "float32")], lambda bb, x: bb.emit(relax.op.sum(x))),
    "matmul + gelu": ([((9, 14), "float32"), ((14, 10), "float32")],
                      lambda bb, a, b: bb.emit(relax.op.nn.gelu(bb.emit(relax.op.matmul(a, b))))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bitwise_equal_to_default_build(case):
    params, body = CASES[case]
    mod = _module(params, body)
    arrays = [(RNG.uniform(-1, 1, shape) * 3).astype(dtype) for shape, dtype in params]
    want = _run(mod, "default", arrays)
    got = _run(mod, reference_build_pipeline(), arrays)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want), np.abs(got - want).max()


def _legalized(case):
    params, body = CASES[case]
    return relax.transform.LegalizeOps()(_module(params, body))


def test_matmul_gets_reordered_parallel_loops():
    mod = reference_schedule(_legalized("matmul prime"))
    text = mod["matmul"].script()
    assert "T.parallel" in text
    # decomposed: the init is its own block, the update accumulates with k outside j
    assert "matmul_init" in text and "matmul_update" in text


def test_scheduled_functions_are_left_alone():
    mod = _legalized("matmul prime")
    marked = mod["matmul"].with_attr("tirx.is_scheduled", True)
    assert schedule_reference_func(marked).same_as(marked)


def test_function_a_primitive_refuses_is_left_alone():
    # A prefix sum reads what it writes: `parallel` refuses, so nothing changes at all.
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def scan(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("b"):
                vi = T.axis.spatial(8, i)
                b[vi] = T.if_then_else(vi > 0, b[vi - 1], T.float32(0)) + a[vi]

    assert schedule_reference_func(scan).same_as(scan)
