"""BindOutputs: results written into buffers the caller passes, equal to the plain build."""
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

import tvm_einweld
from tvm_einweld.commands.demo import builtin_model
from tvm_einweld.relay_passes.output_buffers import BindOutputs, UnboundOutput, bind_outputs


def _build(mod, bind: bool):
    ex = tvm.compile(mod, "llvm", relax_pipeline=tvm_einweld.pipeline(
        "llvm", bind_outputs=bind, derive=False))
    return relax.VirtualMachine(ex, tvm.cpu())


def _two_results():
    @tvm.script.ir_module
    class Two:
        @R.function
        def main(x: R.Tensor((5, 7), "float32"), w: R.Tensor((7, 3), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.nn.relu(R.add(x, R.const(1.5, "float32")))
                R.output(y, z)
            return (y, z)
    return Two


def test_results_land_in_the_callers_buffers_and_equal_the_plain_build(rng):
    mod = builtin_model(channels=8, size=10)
    x = tvm.runtime.tensor(rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32"))
    expected = _build(mod, False)["main"](x).numpy()
    main = _build(mod, True)["main"]
    out = tvm.runtime.tensor(np.full(expected.shape, np.nan, "float32"))  # every element written
    result = main(x, out)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert result.numpy().tobytes() == out.numpy().tobytes()
    # A second call with other inputs overwrites the same buffer.
    x2 = tvm.runtime.tensor(rng.uniform(-1, 1, (1, 8, 10, 10)).astype("float32"))
    main(x2, out)
    np.testing.assert_allclose(out.numpy(), _build(mod, False)["main"](x2).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_several_results_and_weights_kept_as_parameters(rng):
    """Outputs go after the runtime inputs (`num_input` grows), weights stay last."""
    mod = BindOutputs()(relax.transform.LegalizeOps()(_two_results()))
    main = mod["main"]
    assert [p.name for p in main.params] == ["x", "out0", "out1", "w"]
    assert int(main.attrs["num_input"]) == 3
    x = rng.uniform(-1, 1, (5, 7)).astype("float32")
    w = rng.uniform(-1, 1, (7, 3)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    outs = [tvm.runtime.empty((5, 3), "float32"), tvm.runtime.empty((5, 7), "float32")]
    vm["main"](tvm.runtime.tensor(x), *outs, tvm.runtime.tensor(w))
    np.testing.assert_allclose(outs[0].numpy(), x @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1].numpy(), np.maximum(x + 1.5, 0), rtol=1e-6)


def test_a_result_no_kernel_computes_is_refused():
    @tvm.script.ir_module
    class Passthrough:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                R.output(y)
            return (y, x)  # x: the caller's own input, not a kernel's output

    mod = relax.transform.LegalizeOps()(Passthrough)
    with pytest.raises(UnboundOutput, match="result 1"):
        bind_outputs(mod["main"])
    # Through the pass (TVM re-raises a pass's exception as a RuntimeError), the same message.
    with pytest.raises(Exception, match="result 1 .* not a tensor of static shape"):
        BindOutputs()(mod)
    with pytest.raises(Exception, match="no function 'forward'"):
        BindOutputs(("forward",))(mod)


def test_a_buffer_of_the_wrong_shape_or_dtype_is_refused_by_name():
    """The VM checks the new parameters like any other: a clear error naming `out0`."""
    @tvm.script.ir_module
    class Double:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                R.output(y)
            return y

    vm = relax.VirtualMachine(tvm.compile(BindOutputs()(relax.transform.LegalizeOps()(Double)),
                                          "llvm"), tvm.cpu())
    x = tvm.runtime.tensor(np.ones(4, "float32"))
    for bad in (tvm.runtime.empty((5,), "float32"), tvm.runtime.empty((4,), "float64")):
        with pytest.raises(Exception, match="out0"):
            vm["main"](x, bad)
