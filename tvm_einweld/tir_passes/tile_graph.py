"""The tile-graph of a legalized Relax function (Welder §3.1).

Nodes are the `call_tir` bindings of the function's dataflow blocks (one PrimFunc each, as Relax
has them after `LegalizeOps` and, optionally, stock `FuseOps`/`FuseTIR` of injective ops); edges
are the tensors one node writes and another reads. Anything else (a Relax op left unlegalized, a
call_tir with several outputs or symbolic shapes, an already scheduled PrimFunc, a binding outside
a dataflow block) is not a node: the tensors it reads count as graph outputs and those it writes
as graph inputs, so such bindings act as barriers for fusion.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tvm import ir, relax, tirx

from .rules import is_scheduled


@dataclass(frozen=True)
class Tensor:
    """A tensor of the graph: a Relax variable or constant with a static shape."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Node:
    """One call_tir: `output = func(*inputs)`; `inputs` and `output` name graph tensors."""

    name: str
    gvar: ir.GlobalVar
    func: tirx.PrimFunc
    inputs: tuple[str, ...]
    output: str


@dataclass(frozen=True)
class TileGraph:
    """Nodes in topological (program) order, tensors by name, and the outputs: the tensors
    that must stay in memory (returned by the function or read by a binding that is no node).

    `exprs` maps each tensor name to the Relax expression (variable or constant) that holds it.
    """

    nodes: tuple[Node, ...]
    tensors: dict[str, Tensor] = field(hash=False)
    outputs: frozenset[str]
    exprs: dict = field(hash=False, compare=False, default_factory=dict)

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def producer(self, tensor: str) -> Node | None:
        for node in self.nodes:
            if node.output == tensor:
                return node
        return None

    def consumers(self, tensor: str) -> list[Node]:
        return [n for n in self.nodes if tensor in n.inputs]

    def edges(self) -> list[tuple[Node, Node, str]]:
        """(producer, consumer, tensor) for every tensor passed between two nodes."""
        return [(p, c, p.output) for p in self.nodes for c in self.consumers(p.output)]


def _static_shape(ty) -> tuple[int, ...] | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return tuple(int(d) for d in ty.shape.values)
    except (TypeError, AttributeError):
        return None


def _tensor_of(expr, name: str) -> Tensor | None:
    shape = _static_shape(expr.ty)
    if shape is None:
        return None
    return Tensor(name, shape, str(expr.ty.dtype))


def build_tile_graph(mod: ir.IRModule, func_name: str = "main") -> TileGraph:
    """Tile-graph of `mod[func_name]`; tensor names are the Relax variables' names (made unique)."""
    func = mod[func_name]
    names: dict[object, str] = {}
    tensors: dict[str, Tensor] = {}

    def name_of(expr) -> str | None:
        if expr in names:
            return names[expr]
        base = expr.name if isinstance(expr, relax.Var) else "const"
        name = base
        while name in tensors:
            name = f"{base}_{len(tensors)}"
        tensor = _tensor_of(expr, name)
        if tensor is None:
            return None
        names[expr] = name
        tensors[name] = tensor
        return name

    for param in func.params:
        name_of(param)
    nodes: list[Node] = []
    read_outside: list = []  # values read by bindings that are not nodes
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(binding, relax.VarBinding) and value in names:
                names[binding.var] = names[value]  # `gv = lv`: an alias, not a new tensor
                continue
            node = None
            if isinstance(block, relax.DataflowBlock):
                node = _node_of(mod, binding, name_of)
            if node is None:
                read_outside.extend(relax.analysis.free_vars(value))
            else:
                nodes.append(node)
    # A tensor read outside the tile graph (by an untileable call, e.g. a packed function)
    # must stay in memory like a returned one: it is never a group's intermediate.
    outputs = frozenset(_returned_names(func.body.body, names)
                        + [names[v] for v in read_outside if v in names])
    exprs: dict[str, object] = {}
    for expr, name in names.items():
        exprs.setdefault(name, expr)  # the first expression of an alias chain defines it
    return TileGraph(tuple(nodes), tensors, outputs, exprs)


def _node_of(mod: ir.IRModule, binding, name_of) -> Node | None:
    """The node of a `call_tir` binding with static shapes, or None when it is not tileable."""
    value = binding.value
    call_tir = ir.Op.get("relax.call_tir")
    if not (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
            and value.op == call_tir):
        return None
    gvar, args = value.args[0], value.args[1]
    callee = mod[gvar]
    if not isinstance(callee, tirx.PrimFunc) or not isinstance(args, relax.Tuple):
        return None
    if len(value.args) > 2:  # symbolic-shape arguments: not tileable statically
        return None
    if len(callee.params) != len(args.fields) + 1:
        return None
    if is_scheduled(callee):
        return None  # already scheduled (e.g. by an earlier TileGraphFusion): not re-tiled
    if gathers(callee):
        return None
    inputs = [name_of(a) for a in args.fields]
    output = name_of(binding.var)
    if output is None or any(i is None for i in inputs):
        return None
    return Node(output, gvar, callee, tuple(inputs), output)


def gathers(func: tirx.PrimFunc) -> bool:
    """Whether `func` loads at an index read from memory (a gather: `take`, embedding
    lookups). Such a node is not tileable: no propagation bounds the region its tile reads
    (it is the whole input), so a tile gains no reuse, and its tile's local copy of the
    gathered rows is as large as the tile times the row (Longformer's window gather: 4 MB
    per tile; those groups failed their checks and cost 20 s of measuring per compile)."""
    from .propagate import leaf_blocks
    from .rules.cpu.injective import reads_through_index

    return any(reads_through_index(block) for block in leaf_blocks(func))


def _returned_names(expr, names) -> list[str]:
    if isinstance(expr, relax.Tuple):
        return [n for f in expr.fields for n in _returned_names(f, names)]
    return [names[expr]] if expr in names else []


@dataclass(frozen=True)
class SubGraph:
    """Connected nodes fused into one kernel: one output tensor, inputs read from outside.

    Every node but the last has all its consumers inside, so the group is convex and can be
    replaced by one call placed where its last node was.
    """

    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]
    output: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n.name for n in self.nodes)

    @property
    def intermediates(self) -> tuple[str, ...]:
        return tuple(n.output for n in self.nodes[:-1])


def subgraph(graph: TileGraph, names) -> SubGraph | None:
    """The SubGraph of the named nodes, or None when they do not form a single-output group."""
    names = frozenset(names)
    nodes = tuple(n for n in graph.nodes if n.name in names)
    if len(nodes) != len(names) or not nodes:
        return None
    sink = nodes[-1]
    for node in nodes[:-1]:
        consumers = graph.consumers(node.output)
        if node.output in graph.outputs or not consumers:
            return None
        if any(c.name not in names for c in consumers):
            return None
    produced = {n.output for n in nodes}
    inputs: list[str] = []
    for node in nodes:
        for tensor in node.inputs:
            if tensor not in produced and tensor not in inputs:
                inputs.append(tensor)
    return SubGraph(nodes, tuple(inputs), sink.output)
