"""Real architectures from the `onnx` package's backend test data, ready for TVM.

The zoo (`tvm_einweld.models.ZOO`) holds models written for this project; these are models
written by others, so they exercise the einweld pipeline on graphs nobody shaped for it. The
installed `onnx` package ships them under `onnx/backend/test/data/` (nothing is downloaded):

- `light/`: AlexNet, DenseNet-121, Inception v1/v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19,
  ZFNet-512. Their weights are produced by `ConstantOfShape` nodes, so nearly every weight
  tensor is uniform (all 0.02, say), and the initializers are also listed as graph inputs
  (IR version 3). Uniform weights are a hard case, not an easy one: every output channel of a
  conv is the same number, activations grow to ~1e10 and a softmax over them is decided by
  float32 rounding (the SqueezeNet bug of issue 18). `random_weights` gives the same
  architecture with seeded He-scaled weights, the ordinary case.
- `pytorch-converted/` (82) and `pytorch-operator/` (35): single layers exported from PyTorch,
  each with one stored `test_data_set_0` of inputs and expected outputs.

`prepare` turns a raw model into what TVM's frontend is given: initializers dropped from the
graph inputs, constants folded by onnxruntime's basic graph optimisation (the ConstantOfShape
weights become initializers, so the weights reach TVM as constants, as in a real deployment),
and an IR version onnxruntime accepts. Most node tests are opset 6, older than any operator
version onnxruntime still implements: they reach TVM unfolded, as stored (their weights are
initializers already), and onnxruntime times them converted to opset 7 (`onnxruntime_model`).
`import_model` never raises for a model TVM cannot take:
it returns a `ImportResult` whose `reason` ("not imported: ...") says why, so a suite over all
models records the failure instead of crashing.

    from tvm_einweld.models.onnx_backend import list_models, prepare, import_model
    entry = list_models(("light",))[0]
    model = prepare(entry, weights="random", seed=0)   # PreparedModel
    result = import_model(model.proto)                # ImportResult: .mod or .reason
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ..machine import physical_cores

# The suites of `onnx/backend/test/data` this module serves, in listing order.
SUITES: tuple[str, ...] = ("light", "pytorch-converted", "pytorch-operator")

# onnxruntime 1.3x accepts IR versions <= 13; the models are IR 3 (light, most node tests) or
# 7. IR 8 changes nothing they use, and from IR 4 on initializers need not be graph inputs.
IR_VERSION = 8

# Weight variants `prepare` can make.
WEIGHTS = ("own", "random")


@dataclass(frozen=True)
class BackendModel:
    """One model of the onnx backend test data, as found on disk.

    `name` is "<suite>/<model>", e.g. "light/squeezenet" or "pytorch-converted/test_Conv2d".
    `data_dirs` are the stored `test_data_set_*` folders (none for the light models, whose
    stored output belongs to an input the onnx test runner generates: see `light_inputs`).
    """

    name: str
    suite: str
    path: Path
    data_dirs: tuple[Path, ...] = ()

    @property
    def short_name(self) -> str:
        return self.name.split("/", 1)[1]

    @property
    def is_light(self) -> bool:
        return self.suite == "light"

    def load(self) -> onnx.ModelProto:
        """The model as stored (IR version, inputs and all)."""
        return onnx.load(str(self.path))


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for TVM and onnxruntime: see `prepare`.

    `weights` is "own" (the model's weights, folded) or "random" (`random_weights`); `notes`
    record what preparation could not do (e.g. onnxruntime could not fold the model, so it is
    given unfolded).
    """

    source: BackendModel
    proto: onnx.ModelProto
    weights: str = "own"
    seed: Optional[int] = None
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.source.name if self.weights == "own" else f"{self.source.name}[random]"

    @property
    def input_names(self) -> list[str]:
        return graph_input_names(self.proto)


@dataclass(frozen=True)
class DataSet:
    """Stored inputs (by graph input name, in graph order) and expected outputs of a node test."""

    inputs: dict[str, np.ndarray]
    outputs: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class ImportResult:
    """TVM's frontend on one model: the Relax module, or why there is none.

    `reason` is None when the model imported; otherwise a one-line message that starts with
    "not imported: " and names the exception and what it said.
    """

    mod: object = field(default=None, compare=False, repr=False)
    reason: Optional[str] = None

    @property
    def imported(self) -> bool:
        return self.reason is None


# ---- finding the models ---------------------------------------------------------------------
def data_root() -> Path:
    """`onnx/backend/test/data` of the installed onnx package."""
    return Path(onnx.__file__).resolve().parent / "backend" / "test" / "data"


def list_models(suites: Iterable[str] = SUITES) -> list[BackendModel]:
    """Every model of the given suites, sorted by suite (in `SUITES` order) then name.

    Light models are `light/light_<name>.onnx`; node tests are `<suite>/<test>/model.onnx`
    with `test_data_set_*` beside it.
    """
    root = data_root()
    models: list[BackendModel] = []
    for suite in suites:
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
        folder = root / suite
        if suite == "light":
            for path in sorted(folder.glob("light_*.onnx")):
                name = path.stem[len("light_"):]
                models.append(BackendModel(f"light/{name}", suite, path))
        else:
            for test in sorted(p for p in folder.iterdir() if (p / "model.onnx").exists()):
                data = tuple(sorted(test.glob("test_data_set_*")))
                models.append(BackendModel(f"{suite}/{test.name}", suite, test / "model.onnx",
                                           data))
    return models


def find_model(name: str) -> BackendModel:
    """The model called `name` ("light/squeezenet", "pytorch-converted/test_Conv2d")."""
    for entry in list_models((name.split("/", 1)[0],) if "/" in name else SUITES):
        if entry.name == name:
            return entry
    raise KeyError(f"no onnx backend model {name!r}")


# ---- preparing a model ----------------------------------------------------------------------
def graph_input_names(model: onnx.ModelProto) -> list[str]:
    """Graph inputs that are not initializers: what a caller feeds, in graph order."""
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def drop_initializer_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without the initializers among the graph inputs (IR 3 required them there; then
    they are overridable inputs, which neither constant folding nor TVM treats as constants)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [i for i in out.graph.input if i.name not in {t.name for t in out.graph.initializer}]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    return out


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's basic graph optimisation (constant folding, redundant node elimination,
    semantics-preserving fusions such as Conv+BatchNormalization), written back as ONNX.

    Constant sharing is off: it would merge equal initializers, and with uniform weights every
    two layers of one shape have equal weights, so layers would share one tensor (and, after
    `random_weights`, one random draw). Raises what onnxruntime raises when it cannot load
    the model.
    """
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="onnx_fold_") as tmp:
        path = os.path.join(tmp, "folded.onnx")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = path
        opts.intra_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                             disabled_optimizers=["ConstantSharing"])
        folded = onnx.load(path)
    # onnxruntime lists every opset domain it knows; keep the ones the graph uses.
    used = {n.domain for n in folded.graph.node} | {""}
    kept = [o for o in folded.opset_import if o.domain in used]
    del folded.opset_import[:]
    folded.opset_import.extend(kept)
    return folded


def prepare(entry: BackendModel, weights: str = "own", seed: int = 0) -> PreparedModel:
    """The model as TVM is given it: initializers dropped from the graph inputs, IR version
    `IR_VERSION`, constants folded by onnxruntime, and with `weights="random"` every float
    initializer replaced by `random_weights(..., seed)`.

    When onnxruntime cannot fold the model, it is given unfolded and `notes` says why (the
    node tests' stored outputs do not need onnxruntime); random weights need the folded model.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, not {weights!r}")
    model = drop_initializer_inputs(entry.load())
    model.ir_version = IR_VERSION
    notes: list[str] = []
    try:
        model = fold_constants(model)
    except Exception as err:  # pylint: disable=broad-except
        if weights == "random":
            raise
        notes.append(f"not folded: {describe_error(err)}")
    model.ir_version = IR_VERSION
    if weights == "random":
        return PreparedModel(entry, random_weights(model, seed), "random", seed, tuple(notes))
    return PreparedModel(entry, model, "own", None, tuple(notes))


# ---- random weights -------------------------------------------------------------------------
# Initializers whose values must stay near 1 and positive (a scale, a variance), by the op and
# input index that consumes them; everything else of rank >= 2 read by a Conv/Gemm/MatMul is a
# weight matrix, and the rest are offsets.
_NEAR_ONE = {("BatchNormalization", 1), ("BatchNormalization", 4), ("Mul", 0), ("Mul", 1),
             ("InstanceNormalization", 1), ("LayerNormalization", 1), ("Div", 1)}
_WEIGHT_INPUTS = {("Conv", 1), ("ConvTranspose", 1), ("Gemm", 0), ("Gemm", 1), ("MatMul", 0),
                  ("MatMul", 1)}
# Offsets (biases, BatchNormalization's bias and mean, added constants) are drawn from
# [-OFFSET_SCALE, OFFSET_SCALE].
OFFSET_SCALE = 0.1


def fan_in(op_type: str, index: int, shape: Sequence[int], node: Optional[onnx.NodeProto] = None
           ) -> int:
    """Inputs summed into each output of a weight: C/groups·kernel for Conv weights (O, C/g,
    k...) and for ConvTranspose weights (C, O/g, k...) (an upper bound there: a stride skips
    kernel taps), K for Gemm/MatMul."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} if node else {}
    if op_type == "Conv":
        return int(np.prod(shape[1:]))
    if op_type == "ConvTranspose":
        return int(shape[0] // max(1, attrs.get("group", 1)) * np.prod(shape[2:]))
    if op_type == "Gemm":
        transposed = attrs.get("transB" if index == 1 else "transA", 0)
        k_axis = (1 if transposed else 0) if index == 1 else (0 if transposed else 1)
        return int(shape[k_axis])
    if op_type == "MatMul":
        return int(shape[-2] if index == 1 else shape[-1])
    return int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])


def random_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """A copy whose float initializers are seeded uniform random values of a sensible scale.

    Weight matrices (read by Conv, ConvTranspose, Gemm, MatMul) are He-uniform: U(-b, b) with
    b = sqrt(6 / fan_in), so activations keep their magnitude through ReLU layers; scales and
    variances (BatchNormalization's, multiplied constants) are U(0.5, 1.5); everything else
    (biases, means, added constants) U(-0.1, 0.1). Integer initializers (shapes, indices) are
    kept. The draw is in initializer order from one generator, so a seed fixes the model.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    consumers: dict[str, list[tuple[str, int, onnx.NodeProto]]] = {}
    for node in out.graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, index, node))
    rng = np.random.default_rng(seed)
    for tensor in out.graph.initializer:
        value = numpy_helper.to_array(tensor)
        if value.dtype.kind != "f" or value.size == 0:
            continue
        uses = consumers.get(tensor.name, [])
        roles = {(op, index) for op, index, _ in uses}
        if value.ndim >= 2 and roles & _WEIGHT_INPUTS:
            op, index, node = next(u for u in uses if (u[0], u[1]) in _WEIGHT_INPUTS)
            bound = np.sqrt(6.0 / max(1, fan_in(op, index, value.shape, node)))
            new = rng.uniform(-bound, bound, value.shape)
        elif roles and roles <= _NEAR_ONE:
            new = rng.uniform(0.5, 1.5, value.shape)
        else:
            new = rng.uniform(-OFFSET_SCALE, OFFSET_SCALE, value.shape)
        tensor.CopyFrom(numpy_helper.from_array(new.astype(value.dtype), tensor.name))
    return out


# ---- inputs and stored outputs ---------------------------------------------------------------
def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def input_specs(model: onnx.ModelProto) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, static shape, numpy dtype) of every graph input that is not an initializer;
    a symbolic dimension reads as 1."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        tensor_type = value.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in tensor_type.shape.dim)
        specs.append((value.name, shape, _np_dtype(tensor_type.elem_type)))
    return specs


def light_inputs(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The input the onnx test runner feeds a light model (`generate_dummy_data` with
    random=False): arange(n) / n in the input's shape, a ramp over [0, 1). The light models'
    stored outputs belong to these inputs."""
    inputs = {}
    for name, shape, dtype in input_specs(model):
        n = int(np.prod(shape))
        inputs[name] = (np.arange(n).reshape(shape) / n).astype(dtype)
    return inputs


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input: uniform [0, 1) floats, zeros for integers."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for name, shape, dtype in input_specs(model):
        inputs[name] = (rng.random(shape).astype(dtype) if dtype.kind == "f"
                        else np.zeros(shape, dtype))
    return inputs


def read_tensor(path: Path) -> np.ndarray:
    """A stored `TensorProto` (.pb) as a numpy array."""
    tensor = onnx.TensorProto()
    tensor.ParseFromString(Path(path).read_bytes())
    return numpy_helper.to_array(tensor)


def load_data_sets(entry: BackendModel) -> list[DataSet]:
    """The stored inputs/outputs of a node test; for a light model, its ramp input
    (`light_inputs`) with the stored `light_<name>_output_*.pb`."""
    model = entry.load()
    names = graph_input_names(model)
    if entry.is_light:
        outputs = []
        for k in range(len(model.graph.output)):
            path = entry.path.with_name(f"{entry.path.stem}_output_{k}.pb")
            if not path.exists():
                return []
            outputs.append(read_tensor(path))
        return [DataSet(light_inputs(model), tuple(outputs))]
    sets = []
    for folder in entry.data_dirs:
        inputs = [read_tensor(p) for p in _numbered(folder, "input")]
        outputs = [read_tensor(p) for p in _numbered(folder, "output")]
        if len(inputs) != len(names):
            raise ValueError(f"{entry.name}: {folder.name} holds {len(inputs)} inputs for "
                             f"{len(names)} graph inputs")
        sets.append(DataSet(dict(zip(names, inputs)), tuple(outputs)))
    return sets


def _numbered(folder: Path, prefix: str) -> list[Path]:
    return sorted(folder.glob(f"{prefix}_*.pb"), key=lambda p: int(p.stem.split("_")[-1]))


# ---- TVM and onnxruntime ----------------------------------------------------------------------
def import_model(model: onnx.ModelProto) -> ImportResult:
    """`tvm.relax.frontend.onnx.from_onnx(model)` with the weights as constants; a model the
    frontend rejects (an unsupported operator or attribute, a failed shape inference) gives an
    `ImportResult` whose `reason` says why instead of raising."""
    from tvm.relax.frontend.onnx import from_onnx  # pylint: disable=import-outside-toplevel

    # The frontend prints "Error converting operator <op>, with inputs: ..." before it
    # re-raises a converter's error, whose own message often does not name the operator.
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return ImportResult(from_onnx(model))
    except Exception as err:  # pylint: disable=broad-except
        match = re.search(r"Error converting operator (\w+)", printed.getvalue())
        where = f"operator {match.group(1)}: " if match else ""
        return ImportResult(None, f"not imported: {where}{describe_error(err)}")


@dataclass(frozen=True)
class CompileResult:
    """`tvm.compile(mod, target, relax_pipeline="einweld")` on one module.

    `reason` is None when it built; otherwise "not compiled: ..." and whether stock
    `tvm.compile(mod, target)` builds the same module (if it does, the failure is the einweld
    pipeline's). `fallbacks` name the stages whose module disagreed with their input, which
    the pipeline dropped (its answer is then that of the module it was given).
    """

    executable: object = field(default=None, compare=False, repr=False)
    seconds: Optional[float] = None
    reason: Optional[str] = None
    fallbacks: tuple[str, ...] = ()

    @property
    def compiled(self) -> bool:
        return self.reason is None


def compile_model(mod, target=None) -> CompileResult:
    """Build `mod` with the einweld pipeline for `target` (default: `host_target()`), timing it
    and recording the stages it fell back from; a build error becomes a `reason`."""
    import tvm  # pylint: disable=import-outside-toplevel

    from .. import einweld_pipeline  # pylint: disable=import-outside-toplevel

    einweld_pipeline.register()
    if target is None:
        from ..tir_passes.device import host_target  # pylint: disable=import-outside-toplevel

        target = host_target()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            executable = tvm.compile(mod, target, relax_pipeline="einweld")
        except Exception as err:  # pylint: disable=broad-except
            seconds, error = time.perf_counter() - start, describe_error(err)
            return CompileResult(None, seconds, f"not compiled: {error}"
                                                f"{_stock_verdict(mod, target, error)}")
    fallbacks = tuple(dict.fromkeys(str(w.message).split(":", 1)[0] for w in caught
                                    if "falling back" in str(w.message)))
    return CompileResult(executable, time.perf_counter() - start, None, fallbacks)


def _stock_verdict(mod, target, einweld_error: str) -> str:
    """Whether stock TVM builds a module the einweld pipeline did not."""
    import tvm  # pylint: disable=import-outside-toplevel

    try:
        tvm.compile(mod, target)
    except Exception as err:  # pylint: disable=broad-except
        error = describe_error(err)
        return (" (stock tvm.compile fails the same way)" if error == einweld_error
                else f" (stock tvm.compile fails too: {error})")
    return " (stock tvm.compile builds it: an einweld pipeline failure)"


def run_tvm(executable, inputs: dict[str, np.ndarray], input_names: Sequence[str]
            ) -> list[np.ndarray]:
    """Run a compiled module's `main` on the inputs (by graph input order); outputs in order."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from ..runtime_io import flatten_outputs, vm_input  # pylint: disable=import-outside-toplevel

    main = relax.VirtualMachine(executable, tvm.cpu())["main"]
    return flatten_outputs(main(*[vm_input(inputs[n]) for n in input_names]))


def compare_outputs(got: Sequence[np.ndarray], reference: Sequence[np.ndarray], what: str):
    """`verify.random_testing.compare_arrays` of every output against its reference, normwise
    with the tolerance of the reference's dtype; a missing or extra output is a failure."""
    from ..verify.random_testing import compare_arrays  # pylint: disable=import-outside-toplevel

    pairs = [(f"output {k}", g, r) for k, (g, r) in enumerate(zip(got, reference))]
    if len(got) != len(reference):
        pairs.append((f"{len(got)} outputs for {len(reference)}", np.zeros(1), np.zeros(2)))
    return compare_arrays(pairs, str(np.asarray(reference[0]).dtype), what)


def onnxruntime_session(model: onnx.ModelProto, optimize: bool = True,
                        threads: Optional[int] = None):
    """An onnxruntime CPU session that does not spin: its intra-op pool busy-waits after each
    call otherwise, which on a small machine slows whatever runs next in or beside the process.
    `threads` defaults to the physical cores."""
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel

    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.intra_op_num_threads = threads or physical_cores()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


# onnxruntime 1.3x implements no operator versions older than opset 7 (it refuses opset-6
# Gemm, Add, BatchNormalization, AveragePool-1, ...); the node tests are mostly opset 6.
ONNXRUNTIME_MIN_OPSET = 7


def onnxruntime_model(prepared: PreparedModel) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """The model onnxruntime runs in `prepared`'s place, and notes on how it differs.

    Usually `prepared.proto` itself. A model onnxruntime refused to fold because its opset is
    older than onnxruntime implements is converted to `ONNXRUNTIME_MIN_OPSET` with
    `onnx.version_converter`: the same computation (checked against the stored outputs by the
    tests) in operator versions onnxruntime has. TVM is still given the model as stored.
    """
    if not any(note.startswith("not folded") for note in prepared.notes):
        return prepared.proto, ()
    opset = next((o.version for o in prepared.proto.opset_import if o.domain in ("", "ai.onnx")),
                 None)
    if opset is None or opset >= ONNXRUNTIME_MIN_OPSET:
        return prepared.proto, ()
    from onnx import version_converter  # pylint: disable=import-outside-toplevel

    converted = version_converter.convert_version(prepared.proto, ONNXRUNTIME_MIN_OPSET)
    converted.ir_version = IR_VERSION
    return converted, (f"onnxruntime ran it converted from opset {opset} to "
                       f"{ONNXRUNTIME_MIN_OPSET}",)


def onnxruntime_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray]
                        ) -> list[np.ndarray]:
    """onnxruntime with graph optimisations off on the prepared model: the reference the
    light models are compared with."""
    return list(onnxruntime_session(model, optimize=False).run(None, dict(inputs)))


def describe_error(err: BaseException) -> str:
    """A one-line reason: `Type: first non-empty line of the message`, at most 200 characters.
    An error without a message (a bare `assert` in TOPI) is described by the line that raised
    it: `AssertionError at topi/nn/elemwise.py:137: assert ...`."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # onnxruntime prefixes every message with "[ONNXRuntimeError] : <code> : <NAME> : ".
    message = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", lines[0]) if lines else ""
    if message:
        text = f"{type(err).__name__}: {message}"
    else:
        frames = traceback.extract_tb(err.__traceback__)
        where = ": (no message)"
        if frames:
            frame = frames[-1]
            path = "/".join(Path(frame.filename).parts[-3:])
            where = f" at {path}:{frame.lineno}: {(frame.line or '').strip()}"
        text = f"{type(err).__name__}{where}"
    return text if len(text) <= 200 else text[:197] + "..."
