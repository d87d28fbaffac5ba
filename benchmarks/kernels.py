"""Single-kernel benchmark: `python benchmarks/kernels.py [--quick]` writes benchmarks/kernels.md
and benchmarks/kernels.json (issue 12 part 6, issue 13 part 4).

What: one row per GEMM-class and convolution shape of the model zoo (MatMul, Gemm, Conv,
ConvTranspose; every distinct (op, input shapes, attributes), taken from the zoo's ONNX graphs
after shape inference, not typed in), plus the memory-bound kernels of BERT and ResNet-18
(GELU, LayerNorm, Softmax, a broadcast bias add, max-pooling, the head transpose; ViT's softmax,
whose rows of 197 are no whole number of vectors) and BERT's
MatMul + bias + residual + LayerNorm as one region. Each is cut out of its zoo model as a small
ONNX model (weights stay initializers, i.e. constants, as in the model) and run by:

- `einweld`: tvm_einweld's pipeline (`relax_pipeline="einweld"`: derivations, tile-graph fusion,
  the analytic CPU rules with compile-time weight packing, then TVM's lowering) on the Relax
  module `from_onnx` makes of it, its outputs bound once (`BindOutputs`, the VM's counterpart
  of IO binding: without it the Relax VM holds the last result while the next call allocates,
  so two output buffers alternate and a kernel's stores miss the cache its inputs share);
- `onnxruntime`: the same ONNX model, all graph optimisations, intra-op threads = physical cores,
  `session.intra_op.allow_spinning` = 0, inputs and outputs bound once (IO binding);
- `numpy` (GEMM rows): `np.matmul`, or an im2col / col2im GEMM for convolutions;
- `tvm-untuned`: stock `tvm.compile(mod, host_target())`;
- `metaschedule-64` (GEMM rows, not with `--quick`): stock `static_shape_tuning_pipeline` with 64
  trials (weight pre-packing except where stock 0.27 is known wrong: ConvTranspose and grouped
  convolutions); the tuning databases are kept under the work dir, so a re-run does not re-tune.
  Tuning costs ~1.5 s per trial, so rows are tuned in a fixed priority order (the largest kernel
  of each model in turn) while the time budget allows; the report names the rows left untuned.

Why: the zoo benchmark says how whole models compare; this one says where each kernel stands
against the machine (the FMA peak from a C micro-benchmark, `machine.measure_fma_peak`; the
bandwidth of a copy of the same number of bytes on every core, which is the L2 bandwidth where
the working set fits L2) and against onnxruntime's single op, so that a slow model can be traced
to its kernels. Targets it measures, not asserts: GEMM-class >= 80 % of the FMA peak when
M*N*K >= 2^24 and >= 1.0x onnxruntime on the geomean; memory-bound >= 70 % of the copy bandwidth
and >= 1.0x onnxruntime.

How: every runner lives in its own worker process (`bench.isolation`, one per runner, reused
from row to row) with every thread count set to the physical cores; each output is checked
against onnxruntime without graph optimisations before timing and once more after, and a wrong
or failed runner is shown as such in its cell, never timed. Rounds alternate across the runners
(`bench.timing.alternate_rounds`); a cell is the median of the rounds. The 1-minute load average
is recorded before and after every row: on a shared machine it says how far to trust a row.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from tvm_einweld import machine
from tvm_einweld.bench.check import compare_outputs
from tvm_einweld.bench.isolation import WorkerError, WorkerProcess, bench_threads, error_line
from tvm_einweld.bench.report import retimed_note
from tvm_einweld.bench.roofline import graph_cost
from tvm_einweld.bench.runners import graph_input_names, reference_outputs, with_settings
from tvm_einweld.bench.harness import time_and_recheck
from tvm_einweld.models import ZOO, build_model, random_inputs

HERE = Path(__file__).resolve().parent
GEMM, MEMORY, FUSED = "gemm", "memory", "fused"
CONTRACTIONS = ("MatMul", "Gemm", "Conv", "ConvTranspose")
OK, WRONG, FAILED, SKIPPED = "ok", "wrong", "failed", "skipped"
LARGE_MNK = 2 ** 24  # the GEMM target applies from M*N*K = 2^24 (batch folded into M)
SINGLE_OP_COMPILE_S = 10.0  # issue 14: a single operator compiles in at most this


# ==== kernels, cut out of the zoo ===============================================================
@dataclass(frozen=True)
class Kernel:
    """One row: a small ONNX model cut out of a zoo model."""

    key: str  # stable id (file names, the tuning cache)
    section: str  # GEMM, MEMORY or FUSED
    label: str  # what it is, e.g. "Conv 3x3/s2 64->128 @56x56"
    op: str
    occurs: tuple[tuple[str, int], ...]  # (zoo model, how many times) where the shape occurs
    onnx_bytes: bytes
    flops: float  # a multiply-add counts 2
    bytes: float  # compulsory bytes: inputs + weights + outputs, each once

    @property
    def model(self) -> onnx.ModelProto:
        return onnx.load_from_string(self.onnx_bytes)

    @property
    def mnk(self) -> float:
        """M*N*K of the GEMM it amounts to (batch and output pixels folded into M)."""
        return self.flops / 2

    @property
    def where(self) -> str:
        return ", ".join(f"{m} x{n}" if n > 1 else m for m, n in self.occurs)


class _Graph:
    """A shape-inferred zoo model: nodes, producers, shapes, initializers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = shape_inference.infer_shapes(build_model(name, 1))
        g = self.model.graph
        self.nodes = list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        self.types = {vi.name: vi for vi in [*g.input, *g.value_info, *g.output]}
        self.producer = {o: n for n in self.nodes for o in n.output}

    def shape(self, value: str) -> tuple[int, ...]:
        if value in self.inits:
            return tuple(self.inits[value].dims)
        return tuple(d.dim_value for d in self.types[value].type.tensor_type.shape.dim)

    def extract(self, nodes: Sequence[onnx.NodeProto], name: str) -> onnx.ModelProto:
        """The region `nodes` as a model: values from outside become graph inputs (initializers
        stay initializers), values no region node consumes become its outputs."""
        produced = {o for n in nodes for o in n.output}
        consumed = list(dict.fromkeys(i for n in nodes for i in n.input if i))
        inputs = [self.types[i] for i in consumed if i not in produced and i not in self.inits]
        weights = [self.inits[i] for i in consumed if i in self.inits]
        outputs = [self.types[o] for n in nodes for o in n.output if o not in consumed]
        graph = helper.make_graph(list(nodes), name, inputs, outputs, weights)
        return helper.make_model(graph, opset_imports=self.model.opset_import, ir_version=8)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _x(shape: Iterable[int]) -> str:
    return "x".join(map(str, shape))


def _contraction_label(g: _Graph, node: onnx.NodeProto) -> str:
    a, b = g.shape(node.input[0]), g.shape(node.input[1])
    attrs = _attrs(node)
    if node.op_type == "MatMul":
        batch = [d for d in a[:-2] if d > 1]
        core = f"{_x(a[-2:])} . {_x(b[-2:])}"
        return f"MatMul {_x(batch)}x({core})" if batch else f"MatMul {core}"
    if node.op_type == "Gemm":
        return f"Gemm {_x(a)} . {_x(b)}{'^T' if attrs.get('transB') else ''}"
    kernel, strides = attrs.get("kernel_shape", b[2:]), attrs.get("strides", [1, 1])
    group, dilation = attrs.get("group", 1), attrs.get("dilations", [1, 1])
    c_out = b[0] if node.op_type == "Conv" else b[1] * group
    text = "Conv" if node.op_type == "Conv" else "ConvT"
    text += f" {_x(kernel)}" + (f"/s{strides[0]}" if max(strides) > 1 else "")
    text += f" {a[1]}->{c_out} @{_x(a[2:])}"
    if max(dilation) > 1:
        text += f" d{dilation[0]}"
    if group > 1:
        text += " dw" if group == a[1] == c_out else f" g{group}"
    return text


def _key(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def _kernel(g: _Graph, nodes: Sequence[onnx.NodeProto], section: str, label: str,
            occurs: tuple[tuple[str, int], ...]) -> Kernel:
    model = g.extract(nodes, _key(label))
    cost = graph_cost(model)
    return Kernel(_key(f"{section}_{label}"), section, label, nodes[-1].op_type, occurs,
                  model.SerializeToString(), cost.flops, cost.min_bytes)


def contraction_kernels(graphs: Sequence[_Graph]) -> list[Kernel]:
    """Every distinct MatMul / Gemm / Conv / ConvTranspose of the zoo, in zoo order."""
    found: dict[tuple, list] = {}  # signature -> [graph, node, {model: count}]
    for g in graphs:
        for node in g.nodes:
            if node.op_type not in CONTRACTIONS:
                continue
            signature = (node.op_type,
                         tuple((g.shape(i), i in g.inits) for i in node.input if i),
                         tuple(sorted((k, str(v)) for k, v in _attrs(node).items())))
            entry = found.setdefault(signature, [g, node, {}])
            entry[2][g.name] = entry[2].get(g.name, 0) + 1
    return [_kernel(g, [node], GEMM, _contraction_label(g, node), tuple(counts.items()))
            for g, node, counts in found.values()]


# ---- memory-bound regions: (label, zoo model, picker: graph -> region nodes or None) ----------
def _first(g: _Graph, test: Callable[[onnx.NodeProto], bool]) -> Optional[onnx.NodeProto]:
    return next((n for n in g.nodes if test(n)), None)


def _gelu(g: _Graph) -> Optional[list]:
    """The exported GELU around the first Erf: x / sqrt2 -> Erf -> +1 -> * x -> * 0.5."""
    erf = _first(g, lambda n: n.op_type == "Erf")
    div = erf and g.producer.get(erf.input[0])
    if div is None:
        return None
    region, known = [div, erf], {div.input[0], *div.output, *erf.output}
    for node in g.nodes:  # grow along element-wise ops fed only by the region (and constants)
        ins = [i for i in node.input if i and i not in g.inits]
        if (node not in region and node.op_type in ("Add", "Mul", "Div") and ins
                and all(i in known for i in ins) and any(i not in (div.input[0],) for i in ins)):
            region.append(node)
            known.update(node.output)
    return region


def _single(op: str, test: Callable[[_Graph, onnx.NodeProto], bool] = lambda g, n: True):
    def pick(g: _Graph) -> Optional[list]:
        node = _first(g, lambda n: n.op_type == op and test(g, n))
        return [node] if node is not None else None

    return pick


def _bias_add(g: _Graph, node: onnx.NodeProto) -> bool:
    """An Add of an activation and a 1-D constant (a bias broadcast over the rows), the widest."""
    shapes = [g.shape(i) for i in node.input]
    return (node.input[1] in g.inits and len(shapes[1]) == 1 and len(shapes[0]) == 3
            and shapes[0][-1] == max(g.shape(n.input[1])[0] for n in g.nodes
                                     if n.op_type == "Add" and n.input[1] in g.inits
                                     and len(g.shape(n.input[1])) == 1))


def _gemm_layer_norm(g: _Graph) -> Optional[list]:
    """The first LayerNormalization with the Adds and the MatMul that feed it (projection + bias
    + residual + LayerNorm, as in a post-norm transformer)."""
    norm = _first(g, lambda n: n.op_type == "LayerNormalization"
                  and getattr(g.producer.get(n.input[0]), "op_type", "") == "Add")
    if norm is None:
        return None
    region, node = [norm], g.producer[norm.input[0]]
    while node is not None and node.op_type == "Add":
        region.insert(0, node)
        feeders = [g.producer.get(i) for i in node.input]
        node = next((f for f in feeders if f is not None and f.op_type in ("Add", "MatMul")), None)
    if node is None or node.op_type != "MatMul":
        return None
    return [node, *region]


def _attention(g: _Graph) -> Optional[list]:
    """The first softmax with the scaled score MatMul before it and the MatMul by V after it
    (Q K^T * scale -> Softmax -> . V, the heads batched)."""
    norm = _first(g, lambda n: n.op_type == "Softmax")
    scale = norm and g.producer.get(norm.input[0])
    scores = scale and scale.op_type in ("Mul", "Div") and g.producer.get(scale.input[0])
    values = norm and _first(g, lambda n: n.op_type == "MatMul" and n.input[0] == norm.output[0])
    if not scores or scores.op_type != "MatMul" or values is None:
        return None
    return [scores, scale, norm, values]


MEMORY_REGIONS: tuple[tuple[str, str, str, Callable[[_Graph], Optional[list]]], ...] = (
    (MEMORY, "GELU (erf) {}", "bert", _gelu),
    (MEMORY, "LayerNorm {}", "bert", _single("LayerNormalization")),
    (MEMORY, "Softmax {}", "bert", _single("Softmax")),
    (MEMORY, "Softmax {}", "vit", _single("Softmax")),  # rows of 197: not whole vectors
    (MEMORY, "Add bias broadcast {}", "bert", _single("Add", _bias_add)),
    (MEMORY, "MaxPool 3x3/s2 {}", "resnet18", _single("MaxPool")),
    (MEMORY, "Transpose {}", "bert", _single(
        "Transpose", lambda g, n: list(_attrs(n)["perm"]) == [0, 2, 1, 3]
        and g.shape(n.input[0])[1] > g.shape(n.input[0])[2])),
    (FUSED, "MatMul+bias+residual+LayerNorm {}", "bert", _gemm_layer_norm),
    (FUSED, "Attention QK^T+softmax+.V {}", "bert", _attention),
)


def memory_kernels(graphs: Mapping[str, _Graph]) -> list[Kernel]:
    kernels = []
    for section, label, name, pick in MEMORY_REGIONS:
        g = graphs[name]
        nodes = pick(g)
        if not nodes:
            continue
        shape = g.shape(nodes[0].input[0])
        described = _x(d for d in shape if d > 1)
        if nodes[-1].op_type == "Transpose":
            described += "->" + _x(d for d in g.shape(nodes[-1].output[0]) if d > 1)
        if section == FUSED:  # named by the product it starts with
            described = _contraction_label(g, nodes[0]).removeprefix("MatMul ")
        kernels.append(_kernel(g, nodes, section, label.format(described), ((name, 1),)))
    return kernels


def zoo_kernels() -> list[Kernel]:
    graphs = {name: _Graph(name) for name in ZOO}
    return [*contraction_kernels(list(graphs.values())), *memory_kernels(graphs)]


# Tuning order: the largest kernel of each model in turn, models in this order.
TUNING_MODELS = ("bert", "resnet18", "nerf", "mobilenetv2", "dcgan", "fsrcnn", "infogan", "vit",
                 "csrnet", "nafnet", "gcn", "longformer")


def tuning_order(kernels: Sequence[Kernel]) -> list[Kernel]:
    by_model: dict[str, list[Kernel]] = {}
    for k in kernels:
        by_model.setdefault(k.occurs[0][0], []).append(k)
    queues = [sorted(by_model.pop(m), key=lambda k: -k.flops)
              for m in (*TUNING_MODELS, *list(by_model)) if m in by_model]
    order = []
    while any(queues):
        for queue in queues:
            if queue:
                order.append(queue.pop(0))
    return order


# ==== runners (each prepared in its own worker process) =========================================
class _Lazy:
    """A TVM tensor read back only when a check asks (np.asarray), not in the timed calls."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def __array__(self, dtype=None, copy=None):
        array = self.tensor.numpy()
        return array.astype(dtype) if dtype is not None else array


def _tvm_run(executable, model: onnx.ModelProto, extra_args: Sequence = (),
             outputs: Sequence[tuple] = ()):
    """Call `main` with the inputs converted once; outputs stay TVM tensors until read.
    `outputs`: (shape, dtype) of the buffers a `BindOutputs` main takes after its inputs,
    allocated once (as onnxruntime's IO binding: every call writes the same memory)."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(executable, tvm.cpu())
    main, names, bound = vm["main"], graph_input_names(model), {}
    extra_args = [tvm.runtime.empty(shape, dtype) for shape, dtype in outputs] + list(extra_args)

    def tensors(result) -> list:
        return [result] if hasattr(result, "numpy") else [t for r in result for t in tensors(r)]

    def run(inputs):
        if bound.get("inputs") is not inputs:
            bound["inputs"] = inputs
            bound["args"] = [tvm.runtime.tensor(np.require(inputs[n], requirements="C")) for n in names]
        return [_Lazy(t) for t in tensors(main(*bound["args"], *extra_args))]

    run.vm = vm  # keeps the VM alive with the function
    return with_settings(run, tvm_pool_threads=tvm.get_global_func("runtime.NumThreads")())


def _host_target():
    from tvm_einweld.tir_passes.device import host_target

    return host_target()


def prepare_einweld(model: onnx.ModelProto, trials: int, work_dir: Path):
    """The "einweld" pipeline: the pass sequence `relax_pipeline="einweld"` resolves to
    (`tvm_einweld.pipeline`), built here so that what its stages did can be read back."""
    import tvm
    from tvm.relax.frontend.onnx import from_onnx
    from tvm_einweld.einweld_pipeline import EinweldOptimize, lowering
    from tvm_einweld.relay_passes.output_buffers import BindOutputs

    target = _host_target()
    stages, outputs = EinweldOptimize(target), BindOutputs()
    pipeline = tvm.transform.Sequential([stages, outputs, lowering()])
    run = _tvm_run(tvm.compile(from_onnx(model), target, relax_pipeline=pipeline), model,
                   outputs=outputs.outputs["main"])
    rules = sorted(set((stages.rules.scheduled if stages.rules else {}).values()))
    tiled = list(stages.fusion.report.replaced if stages.fusion and
                 getattr(stages.fusion, "report", None) else ())
    fused = [g for g in tiled if len(g) > 1]
    dropped = [c.stage for c in stages.checks if c.ran and not c.equal]
    # What the derivation replaced the operator by (a Winograd form names its algorithm).
    derived = sorted({" ".join(o.chosen.steps) if o.chosen.label == "winograd" else
                      o.chosen.label for r in (stages.derivation.last_results
                                               if stages.derivation else ())
                      if r.applied for o in r.ops if o.chosen is not o.original})
    return with_settings(run, rules=",".join(rules) or "none", tile_kernels=len(tiled),
                         derived=",".join(derived) or "none",
                         fused_groups=len(fused),
                         fused_nodes=max((len(g) for g in fused), default=0),
                         dropped_stages=",".join(dropped) or "none",
                         io_binding="yes (BindOutputs)",
                         compile_stages=", ".join(f"{k} {v:.1f}s"
                                                  for k, v in stages.stage_seconds.items()))


def prepare_tvm_untuned(model: onnx.ModelProto, trials: int, work_dir: Path):
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    return _tvm_run(tvm.compile(from_onnx(model), _host_target()), model)


def prepare_onnxruntime(model: onnx.ModelProto, trials: int, work_dir: Path):
    from tvm_einweld.bench.runners import onnxruntime_session

    threads = bench_threads()
    session = onnxruntime_session(model, optimize=True, threads=threads, spinning=False)
    binding = session.io_binding()
    outputs = []
    for out in session.get_outputs():
        array = np.empty([int(d) for d in out.shape], np.float32)
        binding.bind_output(out.name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        outputs.append(array)
    bound: dict = {}

    def run(inputs):
        if bound.get("inputs") is not inputs:
            bound["inputs"] = inputs
            bound["arrays"] = {n: np.require(inputs[n], requirements="C") for n in graph_input_names(model)}
            for name, array in bound["arrays"].items():
                binding.bind_cpu_input(name, array)
        session.run_with_iobinding(binding)
        return outputs

    return with_settings(run, intra_op_num_threads=threads, inter_op_num_threads=1,
                         allow_spinning="0", graph_optimization="all", io_binding="yes")


def _numpy_conv(x: np.ndarray, w: np.ndarray, attrs: dict, out_shape) -> Callable[[np.ndarray], np.ndarray]:
    """Conv as im2col + one (grouped) GEMM per image, NCHW."""
    group = attrs.get("group", 1)
    (kh, kw), (sh, sw) = w.shape[2:], attrs.get("strides", [1, 1])
    dh, dw = attrs.get("dilations", [1, 1])
    pt, pl, pb, pr = attrs.get("pads", [0, 0, 0, 0])
    oh, ow = out_shape[2:]
    c_in = x.shape[1]
    weights = w.reshape(group, w.shape[0] // group, -1)  # (G, Cout/G, Cin/G*kh*kw)

    def conv(x: np.ndarray) -> np.ndarray:
        out = np.empty(out_shape, np.float32)
        for n in range(x.shape[0]):
            padded = np.pad(x[n], ((0, 0), (pt, pb), (pl, pr)))
            windows = np.lib.stride_tricks.sliding_window_view(
                padded, (dh * (kh - 1) + 1, dw * (kw - 1) + 1), axis=(1, 2))
            windows = windows[:, ::sh, ::sw, ::dh, ::dw][:, :oh, :ow]  # (C, OH, OW, kh, kw)
            cols = np.ascontiguousarray(windows.transpose(0, 3, 4, 1, 2))  # the im2col copy
            cols = cols.reshape(group, c_in // group * kh * kw, oh * ow)
            out[n] = np.matmul(weights, cols).reshape(out_shape[1:])
        return out

    return conv


def _numpy_conv_transpose(x: np.ndarray, w: np.ndarray, attrs: dict, out_shape):
    """ConvTranspose as one GEMM (every input pixel times the weights) + col2im (strided adds)."""
    if attrs.get("group", 1) != 1:
        raise NotImplementedError("grouped ConvTranspose")
    c_in, c_out, kh, kw = w.shape
    (sh, sw), (dh, dw) = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    pt, pl = attrs.get("pads", [0, 0, 0, 0])[:2]
    oh, ow = out_shape[2:]
    weights = np.ascontiguousarray(w.reshape(c_in, -1).T)  # (Cout*kh*kw, Cin)

    def conv_transpose(x: np.ndarray) -> np.ndarray:
        n_, _, h, wid = x.shape
        full_h = max(sh * (h - 1) + dh * (kh - 1) + 1, pt + oh)
        full_w = max(sw * (wid - 1) + dw * (kw - 1) + 1, pl + ow)
        out = np.empty(out_shape, np.float32)
        for n in range(n_):
            cols = (weights @ x[n].reshape(c_in, -1)).reshape(c_out, kh, kw, h, wid)
            full = np.zeros((c_out, full_h, full_w), np.float32)
            for i in range(kh):
                for j in range(kw):
                    full[:, i * dh:i * dh + sh * (h - 1) + 1:sh,
                         j * dw:j * dw + sw * (wid - 1) + 1:sw] += cols[:, i, j]
            out[n] = full[:, pt:pt + oh, pl:pl + ow]
        return out

    return conv_transpose


def numpy_function(model: onnx.ModelProto) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    """The model's one contraction in numpy (BLAS for the GEMM)."""
    (node,) = model.graph.node
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out_shape = tuple(d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim)
    attrs = _attrs(node)

    def operand(i: int, inputs) -> np.ndarray:
        name = node.input[i]
        return weights[name] if name in weights else inputs[name]

    bias = weights.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if node.op_type == "MatMul":
        out = np.empty(out_shape, np.float32)
        return lambda inputs: np.matmul(operand(0, inputs), operand(1, inputs), out=out)
    if node.op_type == "Gemm":
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            raise NotImplementedError("Gemm with transA / alpha / beta")
        out = np.empty(out_shape, np.float32)
        b = weights[node.input[1]]
        b = np.ascontiguousarray(b.T) if attrs.get("transB", 0) else b

        def gemm(inputs):
            np.matmul(operand(0, inputs), b, out=out)
            if bias is not None:
                np.add(out, bias, out=out)
            return out

        return gemm
    make = {"Conv": _numpy_conv, "ConvTranspose": _numpy_conv_transpose}[node.op_type]
    x_name = node.input[0]
    x_shape = next(tuple(d.dim_value for d in i.type.tensor_type.shape.dim)
                   for i in model.graph.input if i.name == x_name)
    conv = make(np.empty(x_shape, np.float32), weights[node.input[1]], attrs, out_shape)
    column = bias.reshape(1, -1, 1, 1) if bias is not None else None

    def convolution(inputs):
        out = conv(inputs[x_name])
        if column is not None:
            out += column
        return out

    return convolution


def prepare_numpy(model: onnx.ModelProto, trials: int, work_dir: Path):
    fn = numpy_function(model)
    return with_settings(lambda inputs: [fn(inputs)], numpy=np.__version__,
                         blas_threads=os.environ.get("OPENBLAS_NUM_THREADS", "unset"))


# Stock TVM 0.27's weight pre-packing is wrong on tuned ConvTranspose and fails to schedule
# depthwise convolutions (benchmarks/RESULTS.md); those rows are tuned without it.
def _prepack_works(model: onnx.ModelProto) -> bool:
    (node,) = model.graph.node
    return node.op_type != "ConvTranspose" and _attrs(node).get("group", 1) == 1


TUNED_MARK = "einweld_kernels_tuned.json"


def prepare_metaschedule(model: onnx.ModelProto, trials: int, work_dir: Path):
    """Stock static_shape_tuning_pipeline with `trials` MetaSchedule trials, or with the
    database a finished earlier run left in `work_dir` (then nothing is tuned)."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx
    from tvm_einweld.bench.runners import count_tuning_tasks, measurement_settings

    target = _host_target()
    prepack = _prepack_works(model)
    mod, params = relax.frontend.detach_params(from_onnx(model, keep_params_in_input=prepack))
    work_dir.mkdir(parents=True, exist_ok=True)
    mark = work_dir / TUNED_MARK
    cached = mark.exists() and json.loads(mark.read_text()).get("trials") == trials
    per_task = None if cached else -(-trials // max(1, count_tuning_tasks(mod, target)))
    start = time.perf_counter()
    with measurement_settings():
        mod = relax.pipeline.static_shape_tuning_pipeline(
            total_trials=0 if cached else trials, target=target, work_dir=str(work_dir),
            cpu_weight_prepack=prepack, max_trials_per_task=per_task)(mod)
    tuning_seconds = time.perf_counter() - start
    if not cached:
        mark.write_text(json.dumps({"trials": trials, "seconds": round(tuning_seconds, 1)}))
    executable = tvm.compile(mod, target)
    weights = []
    if prepack and "main" in params:
        vm = relax.VirtualMachine(executable, tvm.cpu())
        weights = list(vm["main_transform_params"](params["main"]))
    run = _tvm_run(executable, model, weights)
    return with_settings(run, trials=trials, weight_prepack=prepack,
                         database="reused" if cached else "tuned now")


@dataclass(frozen=True)
class RunnerSpec:
    name: str
    prepare: Callable
    sections: tuple[str, ...]  # the rows it runs on
    description: str
    environment: tuple[tuple[str, str], ...] = ()


# OpenBLAS must not start a pool beside TVM's in a TVM worker (bench.runners.TVM_ENVIRONMENT).
_TVM_ENV = (("OPENBLAS_NUM_THREADS", "1"),)
EINWELD = RunnerSpec("einweld", prepare_einweld, (GEMM, MEMORY, FUSED),
                     'tvm.compile(mod, host_target(), relax_pipeline="einweld"), outputs bound '
                     'once (BindOutputs)', _TVM_ENV)
ONNXRUNTIME = RunnerSpec("onnxruntime", prepare_onnxruntime, (GEMM, MEMORY, FUSED),
                         "onnxruntime CPU, all graph optimisations, IO binding, no spinning")
NUMPY = RunnerSpec("numpy", prepare_numpy, (GEMM,),
                   "np.matmul; convolutions as im2col (col2im) + np.matmul")
TVM_UNTUNED = RunnerSpec("tvm-untuned", prepare_tvm_untuned, (GEMM, MEMORY, FUSED),
                         "stock tvm.compile(mod, host_target())", _TVM_ENV)
METASCHEDULE = RunnerSpec("metaschedule-64", prepare_metaschedule, (GEMM,),
                          "stock static_shape_tuning_pipeline, 64 MetaSchedule trials", _TVM_ENV)
RUNNERS = (EINWELD, ONNXRUNTIME, NUMPY, TVM_UNTUNED, METASCHEDULE)
TRIALS = 64


# ==== the machine: FMA peak and copy bandwidth ==================================================
def copy_gbs(nbytes: int, threads: int) -> float:
    """GB/s (read + written) of a copy of a working set of `nbytes` on `threads` cores."""
    return machine.measure_native_copy_gbs(int(nbytes), threads, 0.05, 7) or float("nan")


@dataclass(frozen=True)
class MachineLine:
    """Peaks measured at the start and at the end of the run (each the best of 10 runs): other
    jobs on a shared machine only ever lower a peak, so the reference is the highest."""

    cpu: str
    cores: int  # physical cores the runtimes get
    caches: dict[str, int]
    fma_isa: str
    fma_one_core: tuple[float, ...]  # GFLOP/s, one per measurement
    fma_all_cores: tuple[float, ...]
    copy_large: tuple[float, ...]  # GB/s, 256 MiB working set, all cores
    copy_l2: tuple[float, ...]  # GB/s, half the L2 of the cores used, all cores
    numpy_profile: str  # machine.profile().describe(): the project's machine line
    loads: tuple[tuple[float, float, float], ...]  # load averages at each measurement

    @property
    def peak_gflops(self) -> float:
        """The FMA peak every GFLOP/s is held against: the all-core measurement, or the cores
        times the one-core peak where that is higher (the all-core loop reads low while other
        jobs hold a core)."""
        return max(max(self.fma_all_cores, default=0.0),
                   self.cores * max(self.fma_one_core, default=0.0))

    def describe(self) -> str:
        caches = ", ".join(f"{k} {v // 1024} KiB" for k, v in self.caches.items())
        return (f"{self.cpu}, {self.cores} physical cores ({caches}); FMA peak "
                f"({self.fma_isa}, fp32) {max(self.fma_one_core, default=0):.0f} GFLOP/s one "
                f"core, {max(self.fma_all_cores, default=0):.0f} all cores (measured: "
                f"{_samples(self.fma_one_core)} / {_samples(self.fma_all_cores)}); "
                f"reference peak {self.peak_gflops:.0f} GFLOP/s; copy on all cores "
                f"{max(self.copy_large, default=0):.1f} GB/s (256 MiB), "
                f"{max(self.copy_l2, default=0):.1f} GB/s (L2-resident)")

    def remeasured(self) -> "MachineLine":
        again = measure_machine_line(self.cores, profile=self.numpy_profile)
        return dataclasses.replace(
            self, fma_one_core=self.fma_one_core + again.fma_one_core,
            fma_all_cores=self.fma_all_cores + again.fma_all_cores,
            copy_large=self.copy_large + again.copy_large, copy_l2=self.copy_l2 + again.copy_l2,
            loads=self.loads + again.loads)


def _samples(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


def measure_machine_line(threads: int, profile: Optional[str] = None) -> MachineLine:
    load = os.getloadavg()
    one = machine.measure_fma_peak(1, 0.1, 10)
    every = machine.measure_fma_peak(threads, 0.1, 10)
    caches = machine.cache_sizes()
    return MachineLine(
        machine.cpu_model(), threads, caches, (one or every).isa if one or every else "none",
        (one.gflops,) if one else (), (every.gflops,) if every else (),
        (copy_gbs(256 << 20, threads),), (copy_gbs(threads * caches.get("L2", 1 << 20) // 2,
                                                   threads),),
        profile or machine.profile().describe(), (load,))


# ==== measuring =================================================================================
@dataclass(frozen=True)
class Cell:
    runner: str
    status: str  # OK, WRONG, FAILED or SKIPPED
    detail: str  # agreement with the reference, the error, or why skipped
    seconds: Optional[float] = None  # median of the rounds
    spread: Optional[float] = None  # (max - min) / median of the rounds
    rounds: tuple[float, ...] = ()
    prepare_seconds: Optional[float] = None
    settings: tuple[tuple[str, str], ...] = ()
    one_call: bool = False  # slower than Plan.slow_call: `seconds` is its first call, not rounds


@dataclass(frozen=True)
class Row:
    kernel: str  # Kernel.key
    label: str
    section: str
    where: str
    flops: float
    bytes: float
    cells: tuple[Cell, ...]
    copy_gbs: Optional[float]  # memory rows: a copy of the same bytes, all cores
    load_before: float
    load_after: float
    seconds: float  # wall time of the row (preparing included)
    # Core-to-core round trip (ns) before and after the rounds (`machine.measure_round_trip_ns`)
    round_trip_before: Optional[float] = None
    round_trip_after: Optional[float] = None
    # Round trips around earlier attempts at the rounds, discarded as timed in the slow phase
    # (`bench.timing.time_in_fast_phase`).
    slow_attempts: tuple[tuple[Optional[float], Optional[float]], ...] = ()

    def cell(self, runner: str) -> Optional[Cell]:
        return next((c for c in self.cells if c.runner == runner), None)

    def time(self, runner: str) -> Optional[float]:
        c = self.cell(runner)
        return c.seconds if c and c.status == OK else None


@dataclass(frozen=True)
class Plan:
    repeats: int
    warmup: int = 1
    min_round_seconds: float = 0.05
    threads: int = 1
    budget_seconds: float = 3600.0  # metaschedule rows are tuned while this allows
    prepare_timeout: float = 1800.0
    # A runner whose first call takes longer (stock untuned TVM on the large GEMMs: seconds)
    # is not put through the rounds; its first call is reported, marked as one call.
    slow_call: float = 1.0


class Workers:
    """One worker process per runner, started on first use and reused for every row; a
    worker that failed is replaced."""

    def __init__(self, plan: Plan, log_dir: Path) -> None:
        self.plan, self.log_dir, self.open = plan, log_dir, {}

    def get(self, spec: RunnerSpec) -> WorkerProcess:
        if spec.name not in self.open:
            self.open[spec.name] = WorkerProcess(
                spec.prepare, self.plan.threads, self.log_dir / f"{spec.name}.log",
                timeout=600.0, environment=dict(spec.environment), name=spec.name)
        return self.open[spec.name]

    def replace(self, name: str) -> None:
        worker = self.open.pop(name, None)
        if worker is not None:
            worker.close(kill=True)

    def start(self, specs: Sequence[RunnerSpec]) -> None:
        for spec in specs:  # their imports overlap
            self.get(spec)

    def close(self) -> None:
        for name in list(self.open):
            self.open.pop(name).close()


def measure_row(kernel: Kernel, specs: Sequence[RunnerSpec], workers: Workers, plan: Plan,
                work_dir: Path, skipped: Mapping[str, str], log: Callable[[str], None]) -> Row:
    start, load_before = time.monotonic(), os.getloadavg()[0]
    model = kernel.model
    inputs = random_inputs(model, seed=0)
    expected = reference_outputs(model, inputs)
    copy_before = copy_gbs(kernel.bytes, plan.threads) if kernel.section == MEMORY else None
    cells: dict[str, Cell] = {}
    ready: dict[str, WorkerProcess] = {}
    for spec in specs:
        if spec.name in skipped:
            cells[spec.name] = Cell(spec.name, SKIPPED, skipped[spec.name])
            continue
        worker = workers.get(spec)
        begun = time.perf_counter()
        try:
            prepared = worker.prepare(kernel.onnx_bytes, TRIALS, work_dir / kernel.key / spec.name,
                                      inputs, timeout=plan.prepare_timeout)
        except WorkerError as err:
            cells[spec.name] = Cell(spec.name, FAILED, str(err),
                                    prepare_seconds=time.perf_counter() - begun)
            workers.replace(spec.name)
            log(f"  {spec.name}: failed: {err}")
            continue
        agreement = compare_outputs(prepared.outputs, expected)
        status = OK if agreement.ok else WRONG
        cells[spec.name] = Cell(spec.name, status, agreement.detail,
                                prepare_seconds=prepared.prepare_seconds,
                                settings=prepared.settings)
        log(f"  {spec.name}: {status} ({agreement.detail}), prepared in "
            f"{prepared.prepare_seconds:.1f} s")
        if status == OK and prepared.call_seconds > plan.slow_call:
            cells[spec.name] = dataclasses.replace(cells[spec.name],
                                                   seconds=prepared.call_seconds, one_call=True)
        elif status == OK:
            ready[spec.name] = worker

    timings, problems, _, timed = time_and_recheck(ready, expected, plan.repeats, plan.warmup,
                                                   plan.min_round_seconds, log)
    for name, (status, detail) in problems.items():
        cells[name] = dataclasses.replace(cells[name], status=status, detail=detail)
        if status == FAILED:
            workers.replace(name)
    for name, timing in timings.items():
        cells[name] = dataclasses.replace(cells[name], seconds=timing.median,
                                          spread=timing.spread, rounds=timing.samples)
    # The copy is measured before and after the timing; the higher figure is the reference.
    bandwidth = (max(copy_before, copy_gbs(kernel.bytes, plan.threads))
                 if copy_before is not None else None)
    row = Row(kernel.key, kernel.label, kernel.section, kernel.where, kernel.flops, kernel.bytes,
              tuple(cells[s.name] for s in specs), bandwidth, load_before, os.getloadavg()[0],
              time.monotonic() - start, *timed.round_trips, timed.slow_attempts)
    trips = " -> ".join(f"{t:.0f}" if t is not None else "?"
                        for t in (row.round_trip_before, row.round_trip_after))
    log("  " + "  ".join(f"{c.runner} {_ms(c.seconds)}" if c.seconds else
                         f"{c.runner} {c.status}" for c in row.cells)
        + f"  (row {row.seconds:.0f} s, load {load_before:.1f} -> {row.load_after:.1f}, "
          f"round trip {trips} ns)")
    return row


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.3g} ms"


def run_rows(kernels: Sequence[Kernel], specs: Sequence[RunnerSpec], plan: Plan,
             work_dir: Path, log: Callable[[str], None],
             progress: Callable[[list[Row], list[str]], None] = lambda rows, untuned: None
             ) -> tuple[list[Row], list[str]]:
    """Memory-bound and fused rows first, then the GEMM rows in tuning order; a GEMM row is
    tuned (metaschedule-64) when its database is cached or the time left allows it.
    `progress` gets the rows so far after each row (the report is written as it grows)."""
    started = time.monotonic()
    gemm = tuning_order([k for k in kernels if k.section == GEMM])
    order = [k for k in kernels if k.section != GEMM] + gemm
    tuner = next((s for s in specs if s.name == METASCHEDULE.name), None)
    workers = Workers(plan, work_dir / "logs")
    workers.start([s for s in specs if s is not tuner])
    rows: list[Row] = []
    untuned: list[str] = []
    row_seconds: list[float] = []  # rows without tuning
    tune_seconds: list[float] = []
    try:
        for index, kernel in enumerate(order, 1):
            applicable = [s for s in specs if kernel.section in s.sections]
            skipped: dict[str, str] = {}
            if tuner in applicable:
                cached = (work_dir / kernel.key / tuner.name / TUNED_MARK).exists()
                left = plan.budget_seconds - (time.monotonic() - started)
                gemm_left = len(order) - index + 1  # GEMM rows come last
                rest = gemm_left * (statistics.mean(row_seconds) if row_seconds else 30.0)
                tune = statistics.mean(tune_seconds) if tune_seconds else TRIALS * 1.5 + 60
                if not cached and rest + tune > left:
                    skipped[tuner.name] = "not tuned: time budget"
                    untuned.append(kernel.label)
            log(f"[{index}/{len(order)}] {kernel.label} ({kernel.where}; "
                f"{kernel.flops / 1e6:.1f} MFLOP, {kernel.bytes / 2**10:.0f} KiB)")
            try:
                row = measure_row(kernel, applicable, workers, plan, work_dir, skipped, log)
            except Exception as err:  # a row that breaks the harness is reported, not fatal
                log(f"  row failed: {error_line(err)}")
                row = Row(kernel.key, kernel.label, kernel.section, kernel.where, kernel.flops,
                          kernel.bytes, tuple(Cell(s.name, FAILED, f"row: {error_line(err)}")
                                              for s in applicable), None, os.getloadavg()[0],
                          os.getloadavg()[0], 0.0)
            rows.append(row)
            position = {k.key: i for i, k in enumerate(kernels)}
            progress(sorted(rows, key=lambda r: position[r.kernel]), untuned)
            tuned = row.cell(tuner.name) if tuner else None
            if kernel.section != GEMM:
                continue
            if tuned is not None and tuned.status != SKIPPED and "reused" not in \
                    dict(tuned.settings).get("database", ""):
                tune_seconds.append(tuned.prepare_seconds or 0.0)
                row_seconds.append(row.seconds - (tuned.prepare_seconds or 0.0))
            else:
                row_seconds.append(row.seconds)
    finally:
        workers.close()
    position = {k.key: i for i, k in enumerate(kernels)}
    return sorted(rows, key=lambda r: position[r.kernel]), untuned


# ==== the report ================================================================================
@dataclass(frozen=True)
class Report:
    command: str
    date: str
    quick: bool
    repeats: int  # timed rounds per runner and row
    machine: MachineLine
    threads: int
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    wall_seconds: float
    runners: tuple[tuple[str, str], ...]  # (name, description)
    rows: tuple[Row, ...]
    untuned: tuple[str, ...]  # GEMM rows metaschedule-64 had no time for
    not_measured: tuple[str, ...]  # zoo contractions not in this run
    niceness: int = 0  # the benchmark's own (`nice -n 5` gives 5)


def _tuples(value):
    """JSON lists back into the tuples the dataclasses hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def load_report(path: Path) -> Report:
    """A report read back from its JSON (to render it again)."""
    data = {k: _tuples(v) for k, v in json.loads(path.read_text()).items()}
    machine_line = MachineLine(**{k: _tuples(v) for k, v in data["machine"].items()})
    rows = tuple(Row(**{**dict(r), "cells": tuple(Cell(**dict(c)) for c in dict(r)["cells"])})
                 for r in data["rows"])
    return Report(**{**data, "machine": machine_line, "rows": rows})


def _geomean(values: Sequence[float]) -> Optional[float]:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _rule(row: Row) -> str:
    """Which analytic rule scheduled einweld's kernels, and whether TileGraphFusion's tile
    kernel (chosen by measuring candidates at compile time) took the node, fused or alone.
    "none": neither a rule nor (where the run recorded it) a tile kernel: TVM's default."""
    cell = row.cell(EINWELD.name)
    settings = dict(cell.settings) if cell else {}
    if "rules" not in settings:
        return "?"
    parts = [] if settings["rules"] == "none" else [settings["rules"]]
    if settings.get("derived", "none") != "none":
        parts.insert(0, settings["derived"] + ":")
    fused = settings.get("fused_groups", "0") != "0"
    if settings.get("tile_kernels", "0") != "0":
        parts.append("tile kernel" + (" (fused)" if fused else ""))
    elif fused:
        parts.append("tile group")
    return " + ".join(parts).replace(": + ", ": ") or "none"


def _winograd(row: Row) -> bool:
    """Whether einweld ran the row's convolution in a Winograd form: fewer multiply-adds than
    the direct convolution whose count its GFLOP/s uses (an effective figure, which may pass
    the FMA peak)."""
    cell = row.cell(EINWELD.name)
    return "Winograd" in dict(cell.settings).get("derived", "") if cell else False


def _speedup(row: Row, base: str = ONNXRUNTIME.name) -> Optional[float]:
    ours, theirs = row.time(EINWELD.name), row.time(base)
    return theirs / ours if ours and theirs else None


def _cell_text(row: Row, runner: str, unit: Callable[[float], str]) -> str:
    c = row.cell(runner)
    if c is None:
        return ""
    if c.status == OK and c.seconds is not None:
        return unit(c.seconds) + (" (1 call)" if c.one_call else "")
    if c.status == SKIPPED:
        return "not tuned" if "budget" in c.detail else "skipped"
    return f"**{c.status.upper()}**"


def _pct(x: Optional[float]) -> str:
    return f"{100 * x:.0f} %" if x is not None else "-"


def _rate(amount: float, seconds: Optional[float], reference: float) -> list[str]:
    """[amount per second in G/s, that as a % of `reference` (per second)], or two dashes
    without a time: the GFLOP/s / % peak and GB/s / % copy cells of a row."""
    if not seconds:
        return ["-", "-"]
    return [f"{amount / seconds / 1e9:.1f}", _pct(amount / seconds / reference)]


def _ratio(x: Optional[float]) -> str:
    return f"{x:.2f}x" if x is not None else "-"


def _round_trip_lines(rows: Sequence[Row]) -> list[str]:
    """The core-to-core round trips measured around the rows' rounds, and the rows timed while
    it was slow (`machine.slow_round_trips`)."""
    trips = machine.row_round_trips((r.round_trip_before, r.round_trip_after) for r in rows)
    known = [t for t in trips if t is not None]
    if not known:
        return []
    slow = [rows[i].label for i in machine.slow_round_trips(trips)]
    return [f"Core round trip (a cache line between two cores and back, before and after each "
            f"row's rounds, `machine.measure_round_trip_ns`): median "
            f"{statistics.median(known):.0f} ns, range {min(known):.0f}-{max(known):.0f}; "
            + (f"rows timed at over twice the fastest, whose multi-threaded times read high "
               f"(a VM host placing the CPUs apart): {', '.join(slow)}."
               if slow else "no row over twice the fastest.")
            + (f" Timed again once the round trip was back within twice the fastest "
               f"(`bench.timing.time_in_fast_phase`; the discarded attempt's round trip): "
               + "; ".join(r.label + retimed_note(r.slow_attempts) for r in again) + "."
               if (again := [r for r in rows if r.slow_attempts]) else "") + "  "]


def render(report: Report) -> str:
    m = report.machine
    peak = m.peak_gflops * 1e9
    rows = report.rows
    gemm = [r for r in rows if r.section == GEMM]
    memory = [r for r in rows if r.section == MEMORY]
    fused = [r for r in rows if r.section == FUSED]
    loads = [x for r in rows for x in (r.load_before, r.load_after)] or [report.load_start[0]]
    loaded = max(report.load_start[0], report.load_end[0], *loads) >= 0.5 * report.threads
    lines = [
        "# Single kernels: tvm_einweld vs onnxruntime, numpy, stock TVM and the machine",
        "",
        f"Command: `{report.command.strip()}`"
        + (f" at niceness {report.niceness}" if report.niceness else "") + "  ",
        f"Date: {report.date} (wall time {report.wall_seconds / 60:.0f} min)  ",
        f"Machine: {m.describe()}  ",
        f"Project machine line: {m.numpy_profile}  ",
        f"Load average (1/5/15 min): {_load(report.load_start)} at the start, "
        f"{_load(report.load_end)} at the end; over the rows (1-min, before and after each, "
        f"in the JSON) median {statistics.median(loads):.1f}, range {min(loads):.1f}-"
        f"{max(loads):.1f}, on {report.threads} cores.",
        *_round_trip_lines(rows),
        "",
    ]
    if loaded:
        lines += [f"**Measured under load**: the machine ({report.threads} cores) was shared with "
                  "other jobs (1-minute load at or above half the cores during the run). Every "
                  "runner is hit alike (alternating rounds), so the ratios hold better than the "
                  "absolute numbers; peaks are the best of repeated runs, so the % of peak "
                  "columns read low.", ""]
    lines += _summary(report, gemm, memory, fused, peak)
    lines += ["", "## GEMM-class and convolution kernels", "",
              f"GFLOP/s = 2 x multiply-adds / median time; % peak = of the {report.threads}-core "
              f"FMA peak ({m.peak_gflops:.0f} GFLOP/s, see the machine line). ours/ORT = onnxruntime time / "
              "einweld time (above 1: einweld faster). numpy, tvm-untuned and metaschedule-64: "
              "time (GFLOP/s, % peak). * marks M*N*K >= 2^24 (the 80 % target's scope). Times "
              "are medians of alternating rounds; \"(1 call)\": slower than 1 s per call, its "
              "first call only. \"einweld rule\": the analytic rule that scheduled einweld's "
              "kernel; \"tile kernel\" / \"tile group\": TileGraphFusion's kernel won its "
              "compile-time measurement; \"none\": no rule scheduled it (a run that did not "
              "record tile kernels cannot tell TVM's default from a lone tile kernel).", "",
              "| kernel | in | MFLOP | einweld | GFLOP/s | % peak | onnxruntime | GFLOP/s | "
              "% peak | ours/ORT | numpy | tvm-untuned | metaschedule-64 | einweld rule |",
              "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in gemm:
        ours, ort = r.time(EINWELD.name), r.time(ONNXRUNTIME.name)

        def rate(seconds: float, r: Row = r) -> str:  # time (GFLOP/s, % peak)
            return (f"{_ms(seconds)} ({r.flops / seconds / 1e9:.0f}, "
                    f"{_pct(r.flops / seconds / peak)})")

        lines.append(" | ".join([
            f"| {r.label}{' *' if r.flops / 2 >= LARGE_MNK else ''}", r.where,
            f"{r.flops / 1e6:.1f}", _cell_text(r, EINWELD.name, _ms),
            *_rate(r.flops, ours, peak), _cell_text(r, ONNXRUNTIME.name, _ms),
            *_rate(r.flops, ort, peak), _ratio(_speedup(r)), *(_cell_text(r, name, rate) for name in
                                   (NUMPY.name, TVM_UNTUNED.name, METASCHEDULE.name)),
            _rule(r)]) + " |")
    lines += ["", "## Memory-bound kernels", "",
              "GB/s = compulsory bytes (inputs + weights + outputs, each once) / median time; "
              "copy = the bandwidth of a copy of the same number of bytes on every core "
              "(L2-resident where the working set fits the cores' L2; C memcpy, best of 7, "
              "measured before and after the row's timing, the higher kept).", "",
              "| kernel | in | KiB | copy GB/s | einweld | GB/s | % copy | onnxruntime | GB/s | "
              "% copy | ours/ORT | tvm-untuned | einweld rule |",
              "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in memory:
        ours, ort = r.time(EINWELD.name), r.time(ONNXRUNTIME.name)
        copy = r.copy_gbs or float("nan")
        lines.append(" | ".join([
            f"| {r.label}", r.where, f"{r.bytes / 1024:.0f}", f"{copy:.1f}",
            _cell_text(r, EINWELD.name, _ms), *_rate(r.bytes, ours, copy * 1e9),
            _cell_text(r, ONNXRUNTIME.name, _ms), *_rate(r.bytes, ort, copy * 1e9),
            _ratio(_speedup(r)),
            _cell_text(r, TVM_UNTUNED.name, _ms), _rule(r)]) + " |")
    if fused:
        lines += ["", "## Fused region", "",
                  "Not in either geomean. `fused` says whether the einweld pipeline made one "
                  "kernel of more than one node (TileGraphFusion).", "",
                  "| kernel | in | MFLOP | einweld | GFLOP/s | % peak | fused | onnxruntime | "
                  "ours/ORT | tvm-untuned |", "|---|---|--:|--:|--:|--:|---|--:|--:|--:|"]
        for r in fused:
            ours = r.time(EINWELD.name)
            settings = dict(r.cell(EINWELD.name).settings) if r.cell(EINWELD.name) else {}
            groups = settings.get("fused_groups", "?")
            lines.append(" | ".join([
                f"| {r.label}", r.where, f"{r.flops / 1e6:.1f}", _cell_text(r, EINWELD.name, _ms),
                *_rate(r.flops, ours, peak),
                f"{groups} group(s), up to {settings.get('fused_nodes', '?')} nodes"
                if groups not in ("0", "?") else "no",
                _cell_text(r, ONNXRUNTIME.name, _ms), _ratio(_speedup(r)),
                _cell_text(r, TVM_UNTUNED.name, _ms)]) + " |")
    lines += _problems(rows)
    lines += _settings(report)
    lines += ["", "## Notes", "",
              "- numpy runs OpenBLAS with one thread per physical core, as asked of every "
              "runtime. On a shared 2-core machine OpenBLAS's busy-waiting threads make small "
              "GEMMs erratic: timed apart from this run under the same load, the "
              "12x(128x128 . 128x64) batch MatMul took 0.25-0.36 ms per call with "
              "OPENBLAS_NUM_THREADS=1 and 0.15-92 ms with 2. Its small-kernel cells say more "
              "about that than about BLAS.",
              "- Microsecond kernels are dominated by the cost of a call (Relax VM dispatch, "
              "waking a thread pool, onnxruntime's session run): the copy reference has no such "
              "cost, so the small memory-bound rows cannot approach it.",
              "- einweld's prepare time (in the JSON) includes the pipeline's whole-module "
              "checks, which compile and run stock untuned TVM as the reference: tens of "
              "seconds on the large GEMMs."]
    if report.untuned or report.not_measured:
        lines += ["", "## Not measured", ""]
        if report.untuned:
            lines.append(f"metaschedule-64 was dropped for {len(report.untuned)} GEMM rows to "
                         f"keep the run within its time budget (rows are tuned in order: the "
                         f"largest kernel of each model in turn): "
                         + "; ".join(report.untuned) + ".")
        if report.not_measured:
            lines.append(f"Zoo contractions not in this run ({'--quick' if report.quick else '--rows'}"
                         f"): " + "; ".join(report.not_measured) + ".")
    lines += ["", "Not rows here: Longformer's two Einsums (batched matrix-vector products over "
              "gathered key/value windows, memory-bound) are measured in the zoo benchmark "
              "only.", ""]
    return "\n".join(lines)


def _load(load: Sequence[float]) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def _fastest_round_pct(rows: list[Row], peak: float, prefixes: tuple[str, ...] = ("",)
                       ) -> list[float]:
    """Sorted fractions of `peak` that einweld reaches in its fastest round, over the rows
    whose label starts with one of `prefixes` (every row by default)."""
    return sorted(r.flops / min(c.rounds) / peak for r in rows
                  if r.label.startswith(prefixes) and (c := r.cell(EINWELD.name)) and c.rounds)


def _best_of_kind(rows: list[Row], peak: float, prefixes: tuple[str, ...]) -> str:
    """'>= 80 % on k of n, median p' over the rows whose label starts with one of `prefixes`,
    each at its fastest einweld round."""
    pct = _fastest_round_pct(rows, peak, prefixes)
    if not pct:
        return "none"
    return f">= 80 % on {sum(p >= 0.8 for p in pct)} of {len(pct)}, median " \
           f"{_pct(statistics.median(pct))}"


def _summary(report: Report, gemm: list[Row], memory: list[Row], fused: list[Row],
             peak: float) -> list[str]:
    m = report.machine
    g_speed = [s for s in map(_speedup, gemm) if s]
    m_speed = [s for s in map(_speedup, memory) if s]
    # The peak figures leave out Winograd rows: their GFLOP/s counts multiply-adds not run.
    large = [r for r in gemm if r.flops / 2 >= LARGE_MNK and r.time(EINWELD.name)
             and not _winograd(r)]
    winograd = [r for r in gemm if r.time(EINWELD.name) and _winograd(r)]
    large_pct = sorted((r.flops / r.time(EINWELD.name) / peak, r.label) for r in large)
    mem_pct = [r.bytes / r.time(EINWELD.name) / 1e9 / r.copy_gbs for r in memory
               if r.time(EINWELD.name) and r.copy_gbs]
    gm = _geomean(g_speed)
    versus = {name: [s for r in gemm if (s := _speedup(r, name))]
              for name in (NUMPY.name, METASCHEDULE.name, TVM_UNTUNED.name)}
    lines = ["## Summary", "",
             f"- GEMM-class and convolution rows: geomean einweld vs onnxruntime **{_ratio(gm)}** "
             f"over {len(g_speed)} rows (target >= 1.0x); einweld faster on "
             f"{sum(s >= 1 for s in g_speed)}.",
             "- GEMM-class rows, einweld vs the others (geomean of their time / einweld's): "
             + "; ".join(f"{name} {_ratio(_geomean(v))} over {len(v)} rows"
                         for name, v in versus.items()) + ".",
             f"- Memory-bound rows: geomean einweld vs onnxruntime "
             f"**{_ratio(_geomean(m_speed))}** over {len(m_speed)} rows (target >= 1.0x); "
             f"einweld at {', '.join(_pct(p) for p in mem_pct)} of the copy bandwidth of the "
             f"same bytes (target >= 70 %).",
             f"- Rows with M*N*K >= 2^24 (direct kernels): {len(large)}; einweld reaches "
             f">= 80 % of the {m.peak_gflops:.0f} GFLOP/s FMA peak on "
             f"{sum(p >= 0.8 for p, _ in large_pct)}; median "
             f"{_pct(statistics.median([p for p, _ in large_pct])) if large_pct else '-'}, "
             f"range {_pct(large_pct[0][0]) if large_pct else '-'}-"
             f"{_pct(large_pct[-1][0]) if large_pct else '-'}.",
             ]
    best_pct = _fastest_round_pct(large, peak)
    if best_pct:  # the peak is a best-of-runs figure: the like-for-like kernel time is its best
        lines.append(f"  In each row's fastest round (the statistic of the peak, the best of "
                     f"10 runs) rather than the median: >= 80 % on "
                     f"{sum(p >= 0.8 for p in best_pct)} of {len(best_pct)}, median "
                     f"{_pct(statistics.median(best_pct))}, range {_pct(best_pct[0])}-"
                     f"{_pct(best_pct[-1])}; of the MatMul/Gemm rows among them: "
                     + _best_of_kind(large, peak, ("MatMul", "Gemm")) + "; the convolutions: "
                     + _best_of_kind(large, peak, ("Conv",)) + ".")
    if winograd:
        lines.append(f"- Rows einweld ran in a Winograd form ({len(winograd)}, left out of the "
                     f"peak figures above): effective GFLOP/s (the direct convolution's "
                     f"multiply-adds / time) "
                     + ", ".join(f"{r.label} {r.flops / r.time(EINWELD.name) / 1e9:.0f} "
                                 f"({_pct(r.flops / r.time(EINWELD.name) / peak)})"
                                 for r in winograd) + ".")
    compiles = sorted((c.prepare_seconds, r.label) for r in report.rows for c in r.cells
                      if c.runner == EINWELD.name and c.prepare_seconds is not None)
    if compiles:
        over = [label for t, label in compiles if t > SINGLE_OP_COMPILE_S]
        lines.append(f"- einweld compile of one operator (the pipeline, its checks and the "
                     f"build, in the runner's worker process): median "
                     f"{statistics.median(t for t, _ in compiles):.1f} s, max "
                     f"{compiles[-1][0]:.1f} s ({compiles[-1][1]}); {len(over)} of "
                     f"{len(compiles)} over {SINGLE_OP_COMPILE_S:g} s (target <= "
                     f"{SINGLE_OP_COMPILE_S:g} s)" + (f": {'; '.join(over[:6])}" if over else "")
                     + ".")
    for r in fused:
        lines.append(f"- {r.label}: einweld vs onnxruntime {_ratio(_speedup(r))}.")
    slow = sorted((s, r.label) for r in gemm + memory if (s := _speedup(r)))[:6]
    if slow:
        lines.append("- Slowest vs onnxruntime: "
                     + "; ".join(f"{label} {s:.2f}x" for s, label in slow) + ".")
    bad = [(r.label, c.runner, c.status) for r in report.rows for c in r.cells
           if c.status in (WRONG, FAILED)]
    lines.append(f"- Cells wrong or failed: {len(bad)}"
                 + (" (" + "; ".join(f"{l}: {n} {s}" for l, n, s in bad[:8])
                    + ("; ..." if len(bad) > 8 else "") + ")" if bad else "") + ".")
    return lines


def _problems(rows: Sequence[Row]) -> list[str]:
    bad = [(r, c) for r in rows for c in r.cells if c.status in (WRONG, FAILED)]
    if not bad:
        return []
    lines = ["", "## Wrong or failed cells", "", "| kernel | runner | status | detail |",
             "|---|---|---|---|"]
    for r, c in bad:
        lines.append(f"| {r.label} | {c.runner} | {c.status} | "
                     f"{c.detail.replace('|', '/')[:300]} |")
    return lines


def _settings(report: Report) -> list[str]:
    lines = ["", "## Runners and thread settings", "",
             f"Every runner in its own worker process (tvm_einweld.bench.isolation), one per "
             f"runner for the whole run, CPUs {','.join(map(str, machine.usable_cpus()))}; "
             f"{report.threads} threads for every runtime. Rounds: "
             f"{report.repeats} timed rounds after one warm-up, each about "
             "50 ms of back-to-back calls (at least one), alternating across the runners; "
             "a cell is the median round.", ""]
    seen: dict[str, dict[str, list[str]]] = {}  # runner -> setting -> values over the rows
    for r in report.rows:
        for c in r.cells:
            for key, value in c.settings:
                values = seen.setdefault(c.runner, {}).setdefault(key, [])
                if value not in values:
                    values.append(value)
    skip = {"compile_stages", "rules", "fused_groups", "fused_nodes", "dropped_stages",
            "database", "tile_kernels"}
    for name, description in report.runners:
        settings = ", ".join(f"{k}={'|'.join(v)}" for k, v in seen.get(name, {}).items()
                             if k not in skip)
        lines.append(f"- `{name}`: {description}. {settings}")
    rules = sorted({dict(c.settings).get("rules", "") for r in report.rows for c in r.cells
                    if c.runner == EINWELD.name and c.settings})
    lines.append(f"- einweld's analytic rules that scheduled the kernels, over all rows: "
                 f"{'; '.join(x for x in rules if x)}; stages dropped by a failed check: "
                 + (", ".join(sorted({f"{r.label}: {dict(c.settings)['dropped_stages']}"
                                      for r in report.rows for c in r.cells
                                      if c.runner == EINWELD.name
                                      and dict(c.settings).get("dropped_stages", "none")
                                      != "none"})) or "none") + ".")
    return lines


# ==== command line ==============================================================================
QUICK_GEMM_ROWS = 6
QUICK_MEMORY = ("LayerNorm", "Softmax", "Transpose", "MatMul+bias")


def select(kernels: Sequence[Kernel], quick: bool, pattern: Optional[str]
           ) -> tuple[list[Kernel], list[str]]:
    if pattern:
        patterns = [p.strip().lower() for p in pattern.split(",") if p.strip()]
        chosen = [k for k in kernels if any(p in k.label.lower() for p in patterns)]
    elif quick:
        chosen = tuning_order([k for k in kernels if k.section == GEMM])[:QUICK_GEMM_ROWS]
        chosen += [k for k in kernels if k.section != GEMM
                   and any(k.label.startswith(p) for p in QUICK_MEMORY)]
    else:
        chosen = list(kernels)
    keys = {k.key for k in chosen}
    return ([k for k in kernels if k.key in keys],
            [k.label for k in kernels if k.key not in keys and k.section == GEMM])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="6 GEMM rows, 4 other rows, 3 rounds, no metaschedule-64 (minutes)")
    parser.add_argument("--rows", help="only rows whose label contains one of these "
                        "comma-separated texts")
    parser.add_argument("--runners", help="comma-separated runner names (default: all)")
    parser.add_argument("--budget-minutes", type=float, default=55.0,
                        help="metaschedule-64 tunes rows while the run can still end within "
                        "this (estimated from the rows so far)")
    parser.add_argument("--work-dir", type=Path, default=machine.cache_dir() / "kernels_bench",
                        help="tuning databases and worker logs (kept between runs)")
    parser.add_argument("--output", type=Path, default=HERE / "kernels",
                        help="writes OUTPUT.md and OUTPUT.json")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="only write OUTPUT.md again from a report's JSON")
    args = parser.parse_args(argv)
    if args.render:
        args.output.with_suffix(".md").write_text(render(load_report(args.render)))
        return 0
    command = " ".join(["python benchmarks/kernels.py", *map(shlex.quote, sys.argv[1:])])
    started, load_start = time.monotonic(), os.getloadavg()
    log = lambda text: print(text, flush=True)  # noqa: E731

    threads = machine.physical_cores()
    log(f"extracting kernels from the zoo ({', '.join(ZOO)}) ...")
    kernels = zoo_kernels()
    chosen, not_measured = select(kernels, args.quick, args.rows)
    specs = [s for s in RUNNERS if not (args.quick and s is METASCHEDULE)]
    if args.runners:
        wanted = args.runners.split(",")
        specs = [s for s in RUNNERS if s.name in wanted]
    log(f"{len(chosen)} rows, runners {', '.join(s.name for s in specs)}, {threads} threads")
    line = measure_machine_line(threads)
    log(line.describe())
    plan = Plan(repeats=3 if args.quick else 7, threads=threads,
                budget_seconds=args.budget_minutes * 60 - (time.monotonic() - started))
    def write(rows: list[Row], untuned: list[str], line: MachineLine = line) -> None:
        report = Report(command, datetime.datetime.now().astimezone().isoformat(
            timespec="seconds"), args.quick, plan.repeats, line, threads, load_start,
            os.getloadavg(), time.monotonic() - started,
            tuple((s.name, s.description) for s in specs), tuple(rows), tuple(untuned),
            tuple(not_measured), os.nice(0))
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.with_suffix(".md").write_text(render(report))
        args.output.with_suffix(".json").write_text(json.dumps(dataclasses.asdict(report),
                                                               indent=1))

    with machine.own_decisions(args.work_dir):
        rows, untuned = run_rows(chosen, specs, plan, args.work_dir, log, write)
    line = line.remeasured()
    log(line.describe())
    write(rows, untuned, line)
    log(f"wrote {args.output.with_suffix('.md')} and .json "
        f"({(time.monotonic() - started) / 60:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
