"""Our legalisations (`tir_passes.legalize`): softmax normalised by one reciprocal per row
equals TVM's legalisation within a few ulp on random rows of odd shapes along every axis (the
reciprocal's rounding, and the row sum re-associated across vector lanes by the reduction
rule, ragged rows included) and is as accurate against float64, gives NaN where it does on
rows holding inf and NaN, and is what the pipeline schedules."""
import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx

from conftest import run_vm
from tvm_einweld.tir_passes import prepare
from tvm_einweld.tir_passes.fusion import analytic_pipeline
from tvm_einweld.tir_passes.rules.cpu import ApplyCPURules


def _softmax_module(shape, axis, dtype="float32"):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        out = bb.emit(relax.op.nn.softmax(x, axis=axis))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shape,axis", [((3, 77, 77), -1), ((2, 5, 7, 3), 1), ((5, 3), 0),
                                        ((1, 1000), 1), ((4, 1), -1)])
def test_softmax_equals_tvms_own_legalisation(rng, host_target, shape, axis):
    mod = _softmax_module(shape, axis)
    x = (rng.standard_normal(shape) * 20).astype("float32")
    ours = run_vm(mod, x, target=host_target, relax_pipeline=analytic_pipeline(host_target))
    stock = run_vm(mod, x)
    # 1 ulp for the reciprocal, up to ~4 for the sum's re-association (float32 ulp ~1.2e-7).
    np.testing.assert_allclose(ours, stock, rtol=1e-6, atol=1e-30)
    x64 = x.astype("float64")
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    exact = e / e.sum(axis=axis, keepdims=True)
    np.testing.assert_allclose(ours, exact, rtol=2e-5, atol=1e-37)
    error = lambda y: np.max(np.abs(y - exact) / np.maximum(exact, 1e-37))
    assert error(ours) <= 1.25 * error(stock), (error(ours), error(stock))


def test_softmax_float64_rows(rng, host_target):
    mod = _softmax_module((6, 13), -1, "float64")
    x = rng.standard_normal((6, 13)) * 30
    ours = run_vm(mod, x, target=host_target, relax_pipeline=analytic_pipeline(host_target))
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(ours, e / e.sum(axis=-1, keepdims=True), rtol=1e-14)


def test_softmax_rows_with_inf_and_nan_match_tvm(host_target):
    x = np.array([[0.0, 1.0, np.inf, 2.0], [np.nan, 0.0, 1.0, 2.0], [-np.inf] * 4,
                  [-np.inf, 0.0, 1.0, -np.inf], [1e30, -1e30, 0.0, 3.0]], "float32")
    mod = _softmax_module(x.shape, -1)
    ours = run_vm(mod, x, target=host_target, relax_pipeline=analytic_pipeline(host_target))
    stock = run_vm(mod, x)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(stock))
    finite = ~np.isnan(stock)
    np.testing.assert_allclose(ours[finite], stock[finite], rtol=3e-7, atol=0)


def test_the_pipeline_divides_once_per_row_and_schedules_it(host_target):
    """The legalised kernel's normalisation multiplies (no division per element) and the
    reduction rule schedules it."""
    mod = prepare()(_softmax_module((12, 128, 128), -1))
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 1
    sch = s_tir.Schedule(funcs[0])
    store = sch.get(sch.get_sblock("T_softmax_norm")).body
    assert isinstance(store, tirx.BufferStore) and isinstance(store.value, tvm.ir.prim.expr.Mul)
    rules = ApplyCPURules(host_target)
    with host_target:
        rules(mod)
    assert list(rules.scheduled.values()) == ["reduction"]
