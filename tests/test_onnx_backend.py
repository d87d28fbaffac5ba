"""Real architectures from the installed onnx package through the einweld pipeline.

The models come from `onnx/backend/test/data` (`tvm_einweld.models.onnx_backend`): nine light
ImageNet models, compared with onnxruntime with their own uniform weights and with seeded random
weights, and 117 PyTorch node tests, compared with their stored outputs. Every model is a test
of its own; the default run keeps a handful of fast node tests (conv, pool, linear, norm,
activations), everything else is marked slow (`make test-all`). A model TVM's frontend cannot
import is not skipped: it is listed in `NOT_IMPORTED` with the operator that fails, and the
tests assert that its reason says so.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvm_einweld.models import onnx_backend as ob

MODELS = ob.list_models()
NODE_TESTS = [m for m in MODELS if not m.is_light]
LIGHT = [m for m in MODELS if m.is_light]

# Node tests of the default run: each compiles in a few seconds and together they cover
# convolution, pooling, linear layers, normalisation and activations.
FAST = {
    "pytorch-converted/test_AvgPool2d",
    "pytorch-converted/test_BatchNorm2d_eval",
    "pytorch-converted/test_Conv1d",
    "pytorch-converted/test_Conv2d_no_bias",
    "pytorch-converted/test_Linear",
    "pytorch-converted/test_MaxPool2d",
    "pytorch-converted/test_PReLU_2d",
    "pytorch-converted/test_Sigmoid",
    "pytorch-converted/test_Tanh",
    "pytorch-converted/test_softmax_lastdim",
}

# Models TVM 0.27's ONNX frontend does not import, and the operator its reason must name.
NOT_IMPORTED = {
    # Slice with an empty `ends`/`starts` from PyTorch's x[0] indexing (opset 6).
    "pytorch-operator/test_operator_index": "operator Slice",
}

# Models TVM imports but cannot build, stock `tvm.compile` no more than the einweld pipeline,
# and what the reason must say. TVM's frontend converts PRelu with a (C,) slope to
# `nn.prelu(x, slope, axis=ndim - 1)` whatever the opset; PRelu-6 meant the channel axis 1, so
# with C != the last dimension TOPI's prelu asserts while the module is legalised.
NOT_COMPILED = {
    "pytorch-converted/test_PReLU_1d_multiparam": "topi/nn/elemwise.py",
    "pytorch-converted/test_PReLU_2d_multiparam": "topi/nn/elemwise.py",
    "pytorch-converted/test_PReLU_3d_multiparam": "topi/nn/elemwise.py",
}

# Node tests onnxruntime cannot run even converted to the opsets it implements: opset-6 PRelu
# broadcast a (C,) slope over axis 1; from opset 7 on slopes broadcast numpy-style, so the
# converted graph is invalid (TVM imports the opset-6 model as stored).
ONNXRUNTIME_CANNOT_RUN = {
    "pytorch-converted/test_PReLU_1d_multiparam",
    "pytorch-converted/test_PReLU_2d_multiparam",
    "pytorch-converted/test_PReLU_3d_multiparam",
}


def _params(entries, weights=("own",)) -> list:
    """One pytest param per model and weights, slow unless in FAST (with its own weights)."""
    return [pytest.param(entry, weight, id=f"{entry.name}-{weight}",
                         marks=() if entry.name in FAST and weight == "own" else pytest.mark.slow)
            for entry in entries for weight in weights]


def _compile(mod):
    """`tvm.compile(mod, host_target(), relax_pipeline="einweld")`, as `ob.compile_model` runs it."""
    result = ob.compile_model(mod)
    assert result.compiled, result.reason
    return result.executable


# ---- the loader ---------------------------------------------------------------------------------
def test_lists_every_model_of_the_installed_onnx():
    suites = {s: [m for m in MODELS if m.suite == s] for s in ob.SUITES}
    assert len(suites["light"]) == 9
    assert len(suites["pytorch-converted"]) == 82
    assert len(suites["pytorch-operator"]) == 35
    assert {m.short_name for m in LIGHT} >= {"squeezenet", "resnet50", "vgg19", "densenet121"}
    assert all(m.path.exists() for m in MODELS)
    assert all(len(m.data_dirs) == 1 for m in NODE_TESTS)
    assert ob.find_model("light/squeezenet").is_light
    assert set(FAST) | set(NOT_IMPORTED) | set(NOT_COMPILED) | ONNXRUNTIME_CANNOT_RUN <= {
        m.name for m in MODELS}


def test_prepare_folds_the_constant_of_shape_weights():
    entry = ob.find_model("light/squeezenet")
    raw = entry.load()
    assert raw.ir_version == 3 and len(raw.graph.input) == len(raw.graph.initializer) + 1
    prepared = ob.prepare(entry)
    graph = prepared.proto.graph
    assert prepared.proto.ir_version == ob.IR_VERSION and prepared.notes == ()
    assert "ConstantOfShape" not in {n.op_type for n in graph.node}
    assert [i.name for i in graph.input] == prepared.input_names == ["data_0"]
    conv_weights = [numpy_helper.to_array(t) for t in graph.initializer if t.dims and
                    len(t.dims) == 4]
    assert len(conv_weights) == 26  # one per conv: equal weights are not shared
    assert sum(np.all(w == w.flat[0]) for w in conv_weights) >= 20  # the uniform weights


def test_own_weights_make_every_class_equal_random_weights_do_not():
    """Why the light models also run with random weights: with their own uniform weights every
    logit is the same number and the softmax is exactly uniform, so comparing outputs checks
    only that every channel stays identical (the SqueezeNet rounding bug of issue 18)."""
    entry = ob.find_model("light/squeezenet")
    for weights, distinct in (("own", 1), ("random", 100)):
        prepared = ob.prepare(entry, weights)
        (probabilities,) = ob.onnxruntime_outputs(prepared.proto, ob.light_inputs(prepared.proto))
        assert np.unique(probabilities).size >= distinct
        if weights == "own":
            assert np.all(probabilities == np.float32(0.001))


def test_random_weights_are_seeded_and_he_scaled():
    folded = ob.prepare(ob.find_model("light/squeezenet")).proto
    first, again = ob.random_weights(folded, 0), ob.random_weights(folded, 0)
    other = ob.random_weights(folded, 1)
    arrays = lambda m: {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}  # noqa
    own, drawn, same, different = arrays(folded), arrays(first), arrays(again), arrays(other)
    assert drawn.keys() == own.keys()
    for name, value in drawn.items():
        assert value.dtype == own[name].dtype and value.shape == own[name].shape
        assert np.array_equal(value, same[name])
        assert not np.array_equal(value, different[name])
        if value.ndim == 4:  # conv weight (O, C, kh, kw): He-uniform
            bound = np.sqrt(6.0 / np.prod(value.shape[1:]))
            assert np.abs(value).max() <= bound
            assert value.std() == pytest.approx(bound / np.sqrt(3), rel=0.2)
    # the same architecture: only initializer values change
    assert [n.op_type for n in first.graph.node] == [n.op_type for n in folded.graph.node]


def test_random_weights_keep_integers_and_scale_by_role():
    weight = numpy_helper.from_array(np.ones((8, 32), np.float32), "w")
    scale = numpy_helper.from_array(np.full(8, 3.0, np.float32), "scale")
    shape = numpy_helper.from_array(np.array([2, 16], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1),
         helper.make_node("Mul", ["y", "scale"], ["z"]),
         helper.make_node("Reshape", ["z", "shape"], ["out"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 16])],
        [weight, scale, shape])
    model = ob.random_weights(helper.make_model(graph), seed=3)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert np.array_equal(values["shape"], [2, 16])
    assert np.abs(values["w"]).max() <= np.sqrt(6.0 / 32)  # fan-in K = 32 (transB)
    assert values["scale"].min() >= 0.5 and values["scale"].max() <= 1.5


@pytest.mark.parametrize("op, index, shape, attrs, expected", [
    ("Conv", 1, (64, 16, 3, 3), {}, 144),
    ("ConvTranspose", 1, (16, 8, 4, 4), {"group": 2}, 128),
    ("Gemm", 1, (1000, 4096), {"transB": 1}, 4096),
    ("Gemm", 1, (4096, 1000), {}, 4096),
    ("MatMul", 1, (512, 128), {}, 512),
])
def test_fan_in(op, index, shape, attrs, expected):
    node = helper.make_node(op, ["a", "b"], ["c"], **attrs)
    assert ob.fan_in(op, index, shape, node) == expected


def test_stored_data_sets_match_the_graphs():
    for entry in NODE_TESTS:
        (data,) = ob.load_data_sets(entry)
        model = entry.load()
        assert list(data.inputs) == ob.graph_input_names(model), entry.name
        assert len(data.outputs) == len(model.graph.output), entry.name
    (light,) = ob.load_data_sets(ob.find_model("light/squeezenet"))
    assert light.inputs["data_0"].shape == (1, 3, 224, 224)
    assert light.outputs[0].shape == (1, 1000, 1, 1)


def test_models_tvm_does_not_import_have_a_clear_reason():
    """Every node test either imports or is in NOT_IMPORTED, whose reason names the operator."""
    failures = {}
    for entry in NODE_TESTS:
        result = ob.import_model(ob.prepare(entry).proto)
        assert result.imported == (result.reason is None) == (result.mod is not None)
        if not result.imported:
            failures[entry.name] = result.reason
    assert failures.keys() == NOT_IMPORTED.keys(), failures
    for name, reason in failures.items():
        assert reason.startswith(f"not imported: {NOT_IMPORTED[name]}: "), reason
        assert "Error: " in reason and "\n" not in reason and len(reason) <= 220, reason


def test_models_tvm_cannot_build_have_a_clear_reason():
    """The models TVM imports but cannot build fail in stock TVM too, and say where."""
    for name, where in NOT_COMPILED.items():
        result = ob.compile_model(ob.import_model(ob.prepare(ob.find_model(name)).proto).mod)
        assert not result.compiled and result.executable is None
        assert result.reason.startswith("not compiled: AssertionError at ") and where in \
            result.reason, result.reason
        assert result.reason.endswith("(stock tvm.compile fails the same way)"), result.reason


def test_an_unsupported_operator_is_a_reason_not_a_crash():
    graph = helper.make_graph(
        [helper.make_node("NoSuchOperator", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    result = ob.import_model(model)
    assert not result.imported and result.mod is None
    assert result.reason.startswith("not imported: ") and "NoSuchOperator" in result.reason


def test_onnxruntime_stand_ins_compute_the_stored_outputs():
    """Opset-6 node tests reach onnxruntime converted to opset 7 (for the latency column):
    the conversion must not change what they compute."""
    converted = 0
    for entry in NODE_TESTS:
        prepared = ob.prepare(entry)
        model, notes = ob.onnxruntime_model(prepared)
        if not notes:
            continue
        converted += 1
        (data,) = ob.load_data_sets(entry)
        if entry.name in ONNXRUNTIME_CANNOT_RUN:
            with pytest.raises(Exception):
                ob.onnxruntime_outputs(model, data.inputs)
            continue
        result = ob.compare_outputs(ob.onnxruntime_outputs(model, data.inputs), data.outputs,
                                    entry.name)
        assert result.equal, str(result)
    assert converted >= 30


# ---- the models through the pipeline --------------------------------------------------------------
@pytest.mark.parametrize("entry, weights", _params(NODE_TESTS))
def test_node_model(entry, weights):
    """A PyTorch node test through the einweld pipeline equals its stored outputs."""
    prepared = ob.prepare(entry, weights)
    result = ob.import_model(prepared.proto)
    if entry.name in NOT_IMPORTED:
        assert not result.imported and NOT_IMPORTED[entry.name] in result.reason
        return
    assert result.imported, result.reason
    if entry.name in NOT_COMPILED:
        reason = ob.compile_model(result.mod).reason
        assert reason.startswith("not compiled: ") and NOT_COMPILED[entry.name] in reason
        assert "stock tvm.compile fails" in reason, reason  # TVM's failure, not the pipeline's
        return
    (data,) = ob.load_data_sets(entry)
    got = ob.run_tvm(_compile(result.mod), data.inputs, prepared.input_names)
    comparison = ob.compare_outputs(got, data.outputs, entry.name)
    assert comparison.equal, str(comparison)


@pytest.mark.parametrize("entry, weights", _params(LIGHT, ob.WEIGHTS))
def test_light_model(entry, weights):
    """A light ImageNet model, with its own uniform weights or seeded random ones, through the
    einweld pipeline equals onnxruntime on the same prepared model (on the ramp input of the
    onnx test runner)."""
    prepared = ob.prepare(entry, weights, seed=0)
    result = ob.import_model(prepared.proto)
    assert result.imported, result.reason
    inputs = ob.light_inputs(prepared.proto)
    got = ob.run_tvm(_compile(result.mod), inputs, prepared.input_names)
    reference = ob.onnxruntime_outputs(prepared.proto, inputs)
    comparison = ob.compare_outputs(got, reference, prepared.name)
    assert comparison.equal, str(comparison)
