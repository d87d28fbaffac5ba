"""The model zoo: the EinNet and Welder evaluation models, built offline with onnx.helper.

Every model is a function `builder(batch) -> onnx.ModelProto` with seeded random weights
(nothing is downloaded). `ZOO` maps a name to its `ZooModel` entry::

    from tvm_einweld.models import ZOO, build_model, random_inputs
    model = build_model("infogan", batch=1)
    inputs = random_inputs(model)          # {input name: np.ndarray}, seeded
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import onnx

from .csrnet import csrnet_backend
from .fsrcnn import fsrcnn
from .gan import dcgan, infogan
from .gcn import gcn
from .mobilenet import mobilenetv2_stage
from .nafnet import nafnet_block
from .nerf import nerf_mlp
from .resnet import resnet18
from .transformer import bert_layer, longformer_layer, vit_block


@dataclass(frozen=True)
class ZooModel:
    name: str
    builder: Callable[[int], onnx.ModelProto]
    family: str  # "einnet" (the EinNet evaluation) or "welder" (Welder's memory-bound set)
    batches: tuple[int, ...]  # batch sizes that fit a 2-core, 24 GiB machine

    @property
    def summary(self) -> str:
        return " ".join((self.builder.__doc__ or "").strip().split("\n\n")[0].split())

    def build(self, batch: int = 1) -> onnx.ModelProto:
        return self.builder(batch)


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel("infogan", infogan, "einnet", (1, 16)),
        ZooModel("dcgan", dcgan, "einnet", (1, 16)),
        ZooModel("fsrcnn", fsrcnn, "einnet", (1, 16)),
        ZooModel("gcn", gcn, "einnet", (1, 16)),
        ZooModel("resnet18", resnet18, "einnet", (1, 16)),
        ZooModel("csrnet", csrnet_backend, "einnet", (1, 16)),
        # Batch 16 would gather 1.6 GB key/value windows per layer: batch 1 only.
        ZooModel("longformer", longformer_layer, "einnet", (1,)),
        ZooModel("bert", bert_layer, "welder", (1, 16)),
        ZooModel("vit", vit_block, "welder", (1, 16)),
        ZooModel("mobilenetv2", mobilenetv2_stage, "welder", (1, 16)),
        ZooModel("nafnet", nafnet_block, "welder", (1, 16)),
        ZooModel("nerf", nerf_mlp, "welder", (1, 16)),
    ]
}


def get_model(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}") from None


def build_model(name: str, batch: int = 1) -> onnx.ModelProto:
    return get_model(name).build(batch)


def input_shapes(model: onnx.ModelProto, bind: Optional[Mapping[str, int]] = None
                 ) -> dict[str, tuple[int, ...]]:
    """Shapes of the graph inputs (initializers excluded). A dynamic dimension takes its size
    from `bind` (by its symbolic name, e.g. {"batch": 4}) and is 1 otherwise, never 0: a
    check on an empty tensor checks nothing (see `dynamic_dims`)."""
    bind = dict(bind or {})
    inits = {t.name for t in model.graph.initializer}
    return {
        vi.name: tuple(d.dim_value if d.dim_value > 0 else int(bind.get(d.dim_param, 1))
                       for d in vi.type.tensor_type.shape.dim)
        for vi in model.graph.input
        if vi.name not in inits
    }


def dynamic_dims(model: onnx.ModelProto) -> dict[str, list[str]]:
    """{input name: [symbolic names of its dynamic dimensions]} for inputs that have any."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        names = [d.dim_param or "?" for d in vi.type.tensor_type.shape.dim if d.dim_value <= 0]
        if vi.name not in inits and names:
            out[vi.name] = names
    return out


def parse_input_shapes(specs: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """{input name: shape} from "NAME:1x3x224x224" items; each spec may hold several,
    comma-separated. ValueError (one sentence) for a malformed item or a name given twice."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in (i.strip() for spec in specs for i in spec.split(",")):
        if not item:
            continue
        name, sep, dims = item.rpartition(":")  # rpartition: input names may hold ':'
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            shape = ()
        if not sep or not name or not shape or min(shape) < 1:
            raise ValueError(f"malformed input shape {item!r}: expected NAME:DIMxDIMx... with "
                             f"positive sizes, e.g. x:1x3x224x224")
        if name in shapes:
            raise ValueError(f"input {name!r} is given a shape twice")
        shapes[name] = shape
    return shapes


def bind_input_shapes(model: onnx.ModelProto,
                      shapes: Optional[Mapping[str, Sequence[int]]] = None
                      ) -> tuple[onnx.ModelProto, dict[str, dict[str, int]]]:
    """A copy of `model` whose graph inputs all have static shapes: an input named in `shapes`
    takes that shape (its static dimensions must agree), every other dynamic dimension becomes
    1 (a check on an empty tensor checks nothing). Outputs and value infos that use the same
    symbolic dimension get the same size. Returns the copy and {input: {dimension: size}} for
    each dimension that was dynamic (named by its symbol, or by its position as "dim K").
    ValueError (one sentence) for an unknown input, a wrong rank or a contradicted static
    dimension."""
    shapes = dict(shapes or {})
    inits = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    unknown = sorted(set(shapes) - {vi.name for vi in inputs})
    if unknown:
        raise ValueError(f"the model has no input {unknown[0]!r}; its inputs are "
                         f"{', '.join(vi.name for vi in inputs)}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    bound: dict[str, dict[str, int]] = {}
    symbols: dict[str, tuple[int, str]] = {}  # symbol -> (size, input that bound it)
    for vi in out.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        given = shapes.get(vi.name)
        if given is not None and len(given) != len(dims):
            raise ValueError(f"input {vi.name!r} has {len(dims)} dimensions, the given shape "
                             f"{'x'.join(map(str, given))} has {len(given)}")
        for k, d in enumerate(dims):
            size = 1 if given is None else int(given[k])
            if d.dim_value > 0:
                if size != d.dim_value and given is not None:
                    raise ValueError(f"input {vi.name!r}: dimension {k} is {d.dim_value} in the "
                                     f"model, the given shape says {size}")
                continue
            symbol = d.dim_param
            if symbol:
                first = symbols.setdefault(symbol, (size, vi.name))
                if first[0] != size:
                    raise ValueError(f"dimension {symbol!r} is {first[0]} for input {first[1]!r} "
                                     f"and {size} for input {vi.name!r}")
            bound.setdefault(vi.name, {})[symbol or f"dim {k}"] = size
            d.Clear()
            d.dim_value = size
    for vi in list(out.graph.output) + list(out.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in symbols:
                size = symbols[d.dim_param][0]
                d.Clear()
                d.dim_value = size
    return out, bound


def input_dtypes(model: onnx.ModelProto) -> dict[str, np.dtype]:
    """numpy dtype of every graph input (initializers excluded)."""
    inits = {t.name for t in model.graph.initializer}
    return {vi.name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
            for vi in model.graph.input if vi.name not in inits}


# Ops whose integer input at this position indexes the data input along `axis`.
_INDEX_INPUTS = {"Gather": 1, "GatherElements": 1, "GatherND": 1, "ScatterElements": 1}


def index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """{integer graph input: exclusive upper bound of valid values} for inputs used as
    indices (Gather and friends), from the indexed tensor's size along the op's axis."""
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input):
            dims = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
            if dims and all(d > 0 for d in dims):
                shapes.setdefault(vi.name, dims)
    except Exception:  # pylint: disable=broad-except  # inference is a help, not a need
        pass
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        pos = _INDEX_INPUTS.get(node.op_type)
        if pos is None or len(node.input) <= pos:
            continue
        data = shapes.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if data and -len(data) <= axis < len(data):
            size = data[axis]
            bounds[node.input[pos]] = min(bounds.get(node.input[pos], size), size)
    return bounds


def random_inputs(model: onnx.ModelProto, seed: int = 0,
                  bind: Optional[Mapping[str, int]] = None) -> dict[str, np.ndarray]:
    """Random values for every graph input in its own dtype, reproducible from `seed`:
    floats standard normal, booleans either value, integers used as indices within the
    indexed dimension (`index_bounds`), other integers in {0, 1}. Dynamic dimensions as in
    `input_shapes`."""
    rng = np.random.default_rng(seed)
    dtypes, bounds = input_dtypes(model), index_bounds(model)
    out = {}
    for name, shape in input_shapes(model, bind).items():
        dtype = dtypes[name]
        if dtype.kind == "f":
            out[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            out[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            out[name] = rng.integers(0, max(1, bounds.get(name, 2)), shape).astype(dtype)
    return out


__all__ = ["ZOO", "ZooModel", "get_model", "build_model", "input_shapes", "dynamic_dims",
           "parse_input_shapes", "bind_input_shapes", "input_dtypes", "index_bounds",
           "random_inputs"]
