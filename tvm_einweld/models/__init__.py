"""The model zoo: the EinNet and Welder evaluation models, built offline with onnx.helper.

Every model is a function `builder(batch) -> onnx.ModelProto` with seeded random weights
(nothing is downloaded). `ZOO` maps a name to its `ZooModel` entry::

    from tvm_einweld.models import ZOO, build_model, random_inputs
    model = build_model("infogan", batch=1)
    inputs = random_inputs(model)          # {input name: np.ndarray}, seeded
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Static shapes of the graph inputs (initializers excluded)."""
    inits = {t.name for t in model.graph.initializer}
    return {
        vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        for vi in model.graph.input
        if vi.name not in inits
    }


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal fp32 inputs for every graph input, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in input_shapes(model).items()}


__all__ = ["ZOO", "ZooModel", "get_model", "build_model", "input_shapes", "random_inputs"]
