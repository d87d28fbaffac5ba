"""Instantiation of derived expressions as Relax functions (EinNet §5).

Scopes are instantiated innermost first, each becoming one Relax value that the enclosing
expression then reads as a tensor. A compute-bound expression (`op_cost.kernel_intensity` at
least `op_cost.EOP_MAX_INTENSITY`) that `mapping_table.match` maps to an operator becomes
Relax ops — `matmul`, `nn.conv2d`, with `permute_dims` / `reshape` / `strided_slice` /
`concat` as glue — or, for G2BMM (no Relax op), a named TE kernel; operand layouts that are
not a plain transpose are produced by DLT eOperators. Everything else becomes
an eOperator (`eoperator.py`) with a readable name: OffsetReduce (a sum over shifted reads),
DLT (a pure data-layout transformation), Relu / Tanh / ... (one unary function), Elementwise,
Kernel. Memory-bound scopes read by a memory-bound expression are fused into its eOperator
(named after its stages, e.g. OffsetReduce_Relu).

Stored layout: a value of an expression with traversal iterators x_i ∈ [lo_i, hi_i) is kept in
a Relax tensor whose dimension k holds iterator `layout[k]` at position x − lo (`Placed`); the
consumer's index functions are permuted and shifted to read it, and the scope's zero padding
becomes the padding of that tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import tvm
from tvm import relax

from ..expr import index as ix
from ..expr.expression import (
    Access, BinaryOp, Expr, Iterator, Scope, Tensor, UnaryOp, accesses, input_tensors,
    map_accesses,
)
from .derivation import fresh_name, widen_padding
from .eoperator import emit_eoperator
from ..expr.index_simplify import simplify_index
from .mapping_table import MATCHERS, OperatorMatch
from .op_cost import EOP_MAX_INTENSITY, kernel_intensity


class InstantiationError(NotImplementedError):
    """The expression uses something instantiation does not implement."""


@dataclass(frozen=True)
class Placed:
    """Where the value of an expression lives: Relax var, stored shape, layout, origins."""

    var: relax.Var
    tensor: Tensor
    layout: Tuple[int, ...]
    origin: Tuple[int, ...]

    def read(self, indices: Sequence[ix.IndexExpr], pad) -> Access:
        """The access that replaces `scope[indices]` for a scope with padding `pad`."""
        idx = tuple(simplify_index(ix.sub(indices[d], self.origin[d])) for d in self.layout)
        return Access(self.tensor.with_pad(tuple(pad[d] for d in self.layout)), idx)


def eoperator_kind(expr: Expr) -> str:
    body = expr.body
    if isinstance(body, Access):
        return "OffsetReduce" if expr.sums else "DLT"
    if isinstance(body, UnaryOp) and isinstance(body.arg, Access) and not expr.sums:
        return body.fn.capitalize()
    return "Kernel" if expr.sums else "Elementwise"


def _scopes_of(expr: Expr) -> List[Scope]:
    """The distinct scopes `expr` reads directly, in body order."""
    out: List[Scope] = []
    for a in accesses(expr.body):
        if isinstance(a.source, Scope) and a.source not in out:
            out.append(a.source)
    return out


def _leading(expr: Expr, group: Tuple[str, ...]) -> Tuple[str, ...]:
    """The output's leading traversal iterators that belong to `group`, when the group keeps
    at least one iterator without them (a matmul needs a non-empty row or column group)."""
    lead = []
    for it in expr.traversals:
        if it.name not in group:
            break
        lead.append(it.name)
    return tuple(lead) if len(lead) < len(group) else ()


def _layout_rank(m: OperatorMatch, inner_hint: Optional[str]) -> int:
    """Prefer matches whose output's innermost dimension is the consumer's innermost read
    (`inner_hint`), then ones where it is at least in the output's last group; the sort is
    stable, so ties keep the matcher's order (expression order first)."""
    last = dict(m.groups).get("n", dict(m.groups).get("j", ()))
    if inner_hint is None or not last:
        return 0
    return 0 if last[-1] == inner_hint else 1 if inner_hint in last else 2


def _sum_terms(s) -> List:
    if isinstance(s, BinaryOp) and s.op == "+":
        return _sum_terms(s.lhs) + _sum_terms(s.rhs)
    return [s]


def _extent_of(its: Dict[str, Iterator]):
    """extent(group): the size of the dimension that flattens the iterators of `group`."""
    return lambda group: int(math.prod(its[n].extent for n in group))


class Instantiator:
    """Emits the Relax bindings of one expression tree into a BlockBuilder."""

    def __init__(self, bb: relax.BlockBuilder, values: Dict[str, relax.Expr],
                 match_ops: Sequence[str] = ("conv2d", "g2bmm", "matmul"),
                 threshold: float = EOP_MAX_INTENSITY) -> None:
        self.bb = bb
        self.values = dict(values)
        self.match_ops = tuple(match_ops)
        self.threshold = threshold
        self.kernels: List[Tuple[str, str]] = []  # (kind, name) in emission order
        self.placed: Dict[Scope, Placed] = {}

    # -- naming ---------------------------------------------------------------------------
    def _name(self, stem: str) -> str:
        taken = set(self.values) | {n for _, n in self.kernels}
        return stem if stem not in taken else fresh_name(taken, stem + "_")

    def _tensor(self, var: relax.Var, stem: str, shape, dtype) -> Tensor:
        name = self._name(stem)
        self.values[name] = var
        return Tensor(name, tuple(int(s) for s in shape), dtype=dtype)

    # -- expressions -----------------------------------------------------------------------
    def place(self, expr: Expr, inner_hint: Optional[str] = None) -> Placed:
        """Instantiate `expr` (and its scopes) and return where its value lives."""
        expr = self._replace_scopes(expr)
        for plain in (self._emit_window, self._emit_concat):
            placed = plain(expr)
            if placed is not None:
                return placed
        if kernel_intensity(expr) >= self.threshold:
            for op in self.match_ops:
                matches = sorted(MATCHERS[op](expr), key=lambda m: _layout_rank(m, inner_hint))
                for m in matches:
                    placed = getattr(self, f"_emit_{op}")(expr, m)
                    if placed is not None:
                        return placed
        return self._emit_eoperator(expr)

    def _replace_scopes(self, expr: Expr) -> Expr:
        """Instantiate the scopes `expr` reads and read their values instead.

        Memory-bound scopes read by a memory-bound expression stay nested (with their own
        scopes instantiated): the expression and they become one fused eOperator, one kernel
        with a stage per scope, the paper's fusion of chains of memory-bound operators such
        as OffsetReduce + Relu."""
        inner = expr.traversals[-1].name if expr.traversals else None
        fuse = kernel_intensity(expr) < self.threshold
        for scope in _scopes_of(expr):
            if scope not in self.placed and fuse \
                    and kernel_intensity(scope.expr) < self.threshold:
                kept = Scope(self._replace_scopes(scope.expr), scope.pad)
                body = map_accesses(expr.body, lambda a, s=scope, k=kept: Access(k, a.indices)
                                    if a.source == s else a)
                expr = Expr(expr.traversals, expr.sums, body, expr.dtype)
                continue
            if scope not in self.placed:
                hint = None
                for acc in accesses(expr.body):
                    if acc.source != scope:
                        continue
                    for d, idx in enumerate(acc.indices):
                        if inner is not None and inner in ix.free_vars(idx):
                            hint = scope.expr.traversals[d].name
                self.placed[scope] = self.place(scope.expr, hint)
            placed = self.placed[scope]
            body = map_accesses(expr.body, lambda a, s=scope, p=placed: p.read(a.indices, s.pad)
                                if a.source == s else a)
            expr = Expr(expr.traversals, expr.sums, body, expr.dtype)
        return expr

    def _emit_window(self, expr: Expr) -> Optional[Placed]:
        """A read of a box of one tensor in its own dimension order is a strided_slice."""
        acc = expr.body
        if expr.sums or not isinstance(acc, Access) or not isinstance(acc.source, Tensor) \
                or len(acc.indices) != len(expr.traversals):
            return None
        begin, end = [], []
        for it, idx, n in zip(expr.traversals, acc.indices, acc.source.shape):
            form = ix.linear_form(idx)
            if form is None or form[0] != {it.name: 1}:
                return None
            lo, hi = it.lo + form[1], it.hi + form[1]
            if lo < 0 or hi > n:
                return None
            begin.append(lo)
            end.append(hi)
        value = self.values[acc.source.name]
        if begin != [0] * len(begin) or end != list(acc.source.shape):
            axes = list(range(len(begin)))
            value = self.bb.emit(relax.op.strided_slice(value, axes=axes, begin=begin, end=end))
        return self._identity(value, expr, "Slice")

    def _emit_concat(self, expr: Expr) -> Optional[Placed]:
        """T1[.., c, ..] + T2[.., c − n1, ..] + ..., each tensor read whole and the pieces
        tiling the range of c one after another (what expression merging builds), is a
        Relax concat."""
        terms = _sum_terms(expr.body)
        if expr.sums or len(terms) < 2 or not all(
                isinstance(a, Access) and isinstance(a.source, Tensor)
                and len(a.indices) == len(expr.traversals) for a in terms):
            return None
        pieces, axis = [], None
        for acc in terms:
            offsets = []
            for it, idx in zip(expr.traversals, acc.indices):
                form = ix.linear_form(idx)
                if form is None or form[0] != {it.name: 1}:
                    return None
                offsets.append(it.lo + form[1])  # source position of the range's start
            moved = [d for d, o in enumerate(offsets) if o != 0]
            if len(moved) > 1 or (axis is not None and moved and moved[0] != axis):
                return None
            axis = moved[0] if moved else axis
            pieces.append((-offsets[axis] if moved else 0, acc))
        if axis is None:
            return None
        pieces.sort(key=lambda p: p[0])
        start = 0
        for begin, acc in pieces:
            shape = acc.source.shape
            if begin != start or any(shape[d] != it.extent for d, it in enumerate(expr.traversals)
                                     if d != axis):
                return None
            start += shape[axis]
        if start != expr.traversals[axis].extent:
            return None
        value = self.bb.emit(relax.op.concat([self.values[a.source.name] for _, a in pieces],
                                             axis=axis))
        self.kernels.append(("concat", f"{len(pieces)} along axis {axis}"))
        return self._identity(value, expr, "Concat")

    def _identity(self, var: relax.Var, expr: Expr, stem: str) -> Placed:
        tensor = self._tensor(var, stem, expr.shape, expr.dtype)
        n = len(expr.traversals)
        return Placed(var, tensor, tuple(range(n)), tuple(it.lo for it in expr.traversals))

    def _emit_eoperator(self, expr: Expr, kind: Optional[str] = None) -> Placed:
        if kind is None:
            nested = [eoperator_kind(s.expr) for s in _scopes_of(expr)]
            kind = "_".join(nested + [eoperator_kind(expr)])
        name = self._name(kind)
        var = emit_eoperator(self.bb, expr, self.values, name)
        self.kernels.append(("eOperator", name))
        return self._identity(var, expr, name)

    def operand(self, access: Access, its: Sequence[Iterator]) -> relax.Expr:
        """A Relax value V with V[x − lo] = access at x, for x over the iterators `its`.

        A window (strided_slice) and permutation of the source's dimensions when the access
        reads one iterator per dimension inside the source; a DLT eOperator otherwise."""
        src = access.source
        names = [i.name if isinstance(i, ix.IVar) else None for i in access.indices]
        order = [it.name for it in its]
        plain = (None not in names and sorted(names) == sorted(order)
                 and all(0 <= it.lo and it.hi <= src.shape[names.index(it.name)] for it in its))
        if plain:
            value = self.values[src.name]
            ranges = {it.name: (it.lo, it.hi) for it in its}
            begin = [ranges[n][0] for n in names]
            end = [ranges[n][1] for n in names]
            if begin != [0] * len(names) or end != list(src.shape):
                value = self.bb.emit(relax.op.strided_slice(
                    value, axes=list(range(len(names))), begin=begin, end=end))
            perm = [names.index(n) for n in order]
            if perm != list(range(len(perm))):
                value = self.bb.emit(relax.op.permute_dims(value, perm))
            return value
        dlt = widen_padding(Expr(tuple(its), (), access, access.source.dtype))
        return self._emit_eoperator(dlt, "DLT").var

    def _reshape(self, value: relax.Expr, shape: Sequence[int]) -> relax.Expr:
        shape = [int(s) for s in shape]
        current = getattr(value.ty, "shape", None)
        if current is not None and [int(s) for s in current] == shape:
            return value
        return self.bb.emit(relax.op.reshape(value, shape))

    def _finish(self, expr: Expr, value: relax.Expr, order: Sequence[str], stem: str) -> Placed:
        its = {it.name: it for it in expr.traversals}
        shape = [its[n].extent for n in order]
        value = self._reshape(value, shape)
        tensor = self._tensor(value, stem, shape, expr.dtype)
        pos = [it.name for it in expr.traversals]
        layout = tuple(pos.index(n) for n in order)
        return Placed(value, tensor, layout, tuple(it.lo for it in expr.traversals))

    # -- operators ------------------------------------------------------------------------
    def _emit_matmul(self, expr: Expr, m: OperatorMatch) -> Optional[Placed]:
        """Batch matmul over flattened groups. Leading output iterators that only one operand
        reads (n of an NCHW image in the m group) become broadcast batch dimensions, so the
        result is stored outermost in them, as the consumer reads it, not inside m."""
        its = {it.name: it for it in expr.iterators}
        b, mm, nn, kk = (m.group(g) for g in ("b", "m", "n", "k"))
        ext = _extent_of(its)
        lead_m, mm = _leading(expr, mm), mm
        lead_n = _leading(expr, nn) if not lead_m else ()
        mm = tuple(n for n in mm if n not in lead_m)
        nn = tuple(n for n in nn if n not in lead_n)
        lead = lead_m + lead_n
        x = self.operand(m.x, [its[n] for n in b + lead_m + mm + kk])
        y = self.operand(m.y, [its[n] for n in b + lead_n + kk + nn])
        batch = [ext(b)] if b else []
        if lead:  # the operand without the leading iterators broadcasts along them
            x_lead, y_lead = [ext(lead_m) if lead_m else 1], [ext(lead_n) if lead_n else 1]
        else:
            x_lead = y_lead = []
        x = self._reshape(x, batch + x_lead + [ext(mm), ext(kk)])
        y = self._reshape(y, batch + y_lead + [ext(kk), ext(nn)])
        out = self.bb.emit(relax.op.matmul(x, y))
        self.kernels.append(("matmul", f"{batch + x_lead + [ext(mm), ext(kk)]} x "
                                       f"{batch + y_lead + [ext(kk), ext(nn)]}"))
        return self._finish(expr, out, b + lead + mm + nn, "Matmul")

    def _emit_conv2d(self, expr: Expr, m: OperatorMatch) -> Optional[Placed]:
        its = {it.name: it for it in expr.iterators}
        x, w = m.x, m.y
        n_grp, f_grp, c_grp = m.group("n"), m.group("f"), m.group("c")
        spatial = m.attr("spatial")
        strides, dilation, offsets = m.attr("strides"), m.attr("dilation"), m.attr("offsets")
        # The data must be a plain permutation of (n..., c..., H, W) with full ranges; a grouped
        # convolution reads its channel dimension through (f // Fg)·Cg + c, whole.
        groups, channel_dim = m.attr("groups"), m.attr("channel_dim")
        dims = {}
        for d, idx in enumerate(x.indices):
            if d == channel_dim:
                dims[c_grp[0]] = d
            elif isinstance(idx, ix.IVar):
                it = its[idx.name]
                if it.lo != 0 or it.extent != x.source.shape[d]:
                    return None
                dims[idx.name] = d
        if channel_dim is not None and x.source.shape[channel_dim] != its[c_grp[0]].extent * groups:
            return None
        order = [dims[n] for n in n_grp + c_grp if n in dims]
        if len(order) != len(n_grp) + len(c_grp) or len(order) + 2 != len(x.indices):
            return None
        order += [d for _, _, d in spatial]
        data = self.values[x.source.name]
        if order != list(range(len(order))):
            data = self.bb.emit(relax.op.permute_dims(data, order))
        ext = _extent_of(its)
        size = [x.source.shape[d] for _, _, d in spatial]
        data = self._reshape(data, [ext(n_grp), ext(c_grp) * groups] + size)
        kernel = self.operand(w, [its[n] for n in f_grp + c_grp] + [its[r] for _, r, _ in spatial])
        kernel = self._reshape(kernel, [ext(f_grp), ext(c_grp)] + [its[r].extent
                                                                   for _, r, _ in spatial])
        before, after, out_sizes = [], [], []
        for (t, r, _), a, b, c, n in zip(spatial, strides, dilation, offsets, size):
            pb = -(a * its[t].lo + b * its[r].lo + c)
            if pb < 0:
                return None
            ot, kr = its[t].extent, its[r].extent
            pa = max(0, (ot - 1) * a + b * (kr - 1) + 1 - n - pb)
            before.append(pb)
            after.append(pa)
            out_sizes.append((n + pb + pa - b * (kr - 1) - 1) // a + 1)
        out = self.bb.emit(relax.op.nn.conv2d(data, kernel, strides=list(strides),
                                              padding=before + after, dilation=list(dilation),
                                              groups=groups))
        want = [its[t].extent for t, _, _ in spatial]
        if out_sizes != want:
            out = self.bb.emit(relax.op.strided_slice(out, axes=[2, 3], begin=[0, 0], end=want))
        self.kernels.append(("conv2d", f"{ext(f_grp)}x{ext(c_grp)}x"
                             f"{'x'.join(str(its[r].extent) for _, r, _ in spatial)}"
                             + (f" groups={groups}" if groups > 1 else "")))
        return self._finish(expr, out, n_grp + f_grp + tuple(t for t, _, _ in spatial), "Conv2d")

    def _emit_g2bmm(self, expr: Expr, m: OperatorMatch) -> Optional[Placed]:
        its = {it.name: it for it in expr.iterators}
        b, (i,), (j,), k = m.group("b"), m.group("i"), m.group("j"), m.group("k")
        d = m.attr("dilation")
        x = self.operand(m.x, [its[n] for n in b + (i,) + k])
        u = fresh_name(its, "u")
        back = {i: ix.sub(ix.IVar(u), ix.mul(ix.IVar(j), d))}
        y_idx = tuple(simplify_index(ix.substitute(e, back)) for e in m.y.indices)
        if any(j in ix.free_vars(e) for e in y_idx):
            return None
        lo, hi = ix.bounds(ix.add(ix.IVar(i), ix.mul(ix.IVar(j), d)), expr.ranges)
        u_it = Iterator(u, lo, hi + 1)
        y_its = [its[n] for n in b] + [u_it] + [its[n] for n in k]
        y_expr = widen_padding(Expr(tuple(y_its), (), Access(m.y.source, y_idx), expr.dtype))
        y = self._emit_eoperator(y_expr, "DLT").var
        xt = self._tensor(x, "G2BMM_A", [its[n].extent for n in b + (i,) + k], expr.dtype)
        yt = self._tensor(y, "G2BMM_B", [it.extent for it in y_its], expr.dtype)
        bv = [ix.sub(its[n].var, its[n].lo) for n in b]
        kv = [ix.sub(its[n].var, its[n].lo) for n in k]
        body = (Access(xt, tuple(bv + [ix.sub(its[i].var, its[i].lo)] + kv))
                * Access(yt, tuple(bv + [ix.sub(ix.add(its[i].var, ix.mul(its[j].var, d)), lo)]
                                   + kv)))
        kernel = widen_padding(Expr(tuple(its[n] for n in b + (i, j)), tuple(its[n] for n in k),
                                    body, expr.dtype))
        placed = self._emit_eoperator(kernel, "G2BMM")
        self.kernels[-1] = ("g2bmm", placed.tensor.name)
        pos = [it.name for it in expr.traversals]
        return Placed(placed.var, placed.tensor, tuple(pos.index(n) for n in b + (i, j)),
                      tuple(it.lo for it in expr.traversals))

    def output(self, expr: Expr) -> relax.Expr:
        """The Relax value of `expr` in its own layout (traversal order)."""
        placed = self.place(expr, expr.traversals[-1].name if expr.traversals else None)
        inverse = [placed.layout.index(k) for k in range(len(placed.layout))]
        if inverse == list(range(len(inverse))):
            return placed.var
        return self.bb.emit(relax.op.permute_dims(placed.var, inverse))


@dataclass(frozen=True)
class Instantiated:
    """A Relax module computing an expression, and the kernels it was built from."""

    mod: tvm.IRModule
    input_names: Tuple[str, ...]
    kernels: Tuple[Tuple[str, str], ...]

    def count(self, kind: str) -> int:
        return sum(1 for k, n in self.kernels if k == kind or n.startswith(kind))


def instantiate(expr, name: str = "main", **options) -> Instantiated:
    """A Relax IRModule whose function `name` takes the input tensors (sorted by name) and
    returns the value of `expr`, or a tuple of values when `expr` is a sequence of expressions
    (which may share scopes: a shared scope is instantiated once)."""
    exprs = [expr] if isinstance(expr, Expr) else list(expr)
    tensors: Dict[str, Tensor] = {}
    for e in exprs:
        tensors.update(input_tensors(e))
    bb = relax.BlockBuilder()
    params = {n: relax.Var(n, relax.TensorType(t.shape, t.dtype)) for n, t in sorted(tensors.items())}
    with bb.function(name, list(params.values())):
        with bb.dataflow():
            inst = Instantiator(bb, params, **options)
            outs = [inst.output(e) for e in exprs]
            out = bb.emit_output(outs[0] if isinstance(expr, Expr) else relax.Tuple(outs))
        bb.emit_func_output(out)
    return Instantiated(bb.get(), tuple(params), tuple(inst.kernels))


def build(inst: Instantiated, target: str = "llvm"):
    """Compile with `tvm.compile`; returns a callable(*numpy arrays) -> numpy array."""
    import numpy as np

    ex = tvm.compile(inst.mod, target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())

    def run(*arrays):
        args = [tvm.runtime.tensor(np.require(a, "float32", "C")) for a in arrays]
        out = vm["main"](*args)
        return out.numpy() if hasattr(out, "numpy") else tuple(o.numpy() for o in out)

    return run
