"""The paper's motivating derivations, applied by hand as fixed rule sequences (no search).

Each function takes the operator's input tensors, builds its canonical expression, applies the
rules in a fixed order (each step through `apply_at`, so every step's side conditions are
proven) and returns the whole derivation. Nothing here knows a shape: the rules read everything
from the index functions, so the same sequence works for any shape with the same structure.

  conv3x3_to_matmul          EinNet Fig. 5: Conv → Matmul + OffsetReduce
  conv_transpose_to_matmul   stride-2 ConvTranspose → Matmul + OffsetReduce
  conv5x5_to_conv3x3         Fig. 6: Conv5x5 → Conv3x3 with 4× output channels + OffsetReduce
  dilated_g2bmm              Fig. 14: dilated G2BMM → non-dilated G2BMM + layout eOperators
  merged_matmuls             §4.2: two matmuls sharing an input → one matmul
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

from ..expr import canonical
from ..expr.expression import Expr, Tensor
from .boundary import BoundaryRelaxing, BoundaryTightening
from .derivation import Derivation, apply_at
from .inter_expression import Merged, merge_expressions
from .summation_splitting import SummationSplitting
from .traversal_merging import TraversalMerging
from .variable_substitution import SummationIteratorSplitting, VariableSubstitution


@dataclass(frozen=True)
class DerivationCase:
    """An original expression (or several), the rule applications, and the result(s)."""

    name: str
    original: Tuple[Expr, ...]
    steps: Tuple[Union[Derivation, Merged], ...]
    derived: Tuple[Expr, ...]
    op: str = ""                       # the original operator, for `original_module`
    attrs: Tuple[Tuple[str, object], ...] = ()


def _run(name: str, expr: Expr, steps, op: str, verify: bool, **attrs) -> DerivationCase:
    """Apply the steps in order; with `verify`, each step is also screened and random-tested
    against the expression before it (slow for large shapes: the interpreter runs)."""
    done = []
    current = expr
    for step in steps:
        # A step is (rule, path), or a function of the current expression giving one (for a
        # rule whose parameters name iterators an earlier step created).
        rule, path = step(current) if callable(step) else step
        d = apply_at(rule, current, path, verify=verify)
        done.append(d)
        current = d.result
    return DerivationCase(name, (expr,), tuple(done), (current,), op, tuple(attrs.items()))


def conv3x3_to_matmul(data: Tensor, weight: Tensor, padding=(1, 1, 1, 1),
                      verify: bool = False) -> DerivationCase:
    """Σ_{c,r,s} → Σ_{r,s} {Σ_c}; h+r ↦ t1, w+s ↦ t2 (the bounding box relaxes the ranges);
    inline; tighten t1, t2 back to the data's extent (the rows read only padding)."""
    expr = canonical.conv2d(data, weight, padding=padding)
    return _run("conv3x3 → Matmul + OffsetReduce", expr, [
        (SummationSplitting(inner={"c"}), "top"),
        (VariableSubstitution(("offset",)), "top/scope0"),
        (TraversalMerging(), "top"),
        (BoundaryTightening(), "top/scope0"),
        (BoundaryTightening(), "top/scope0"),
    ], "conv2d", verify, padding=tuple(padding))


def conv_transpose_to_matmul(data: Tensor, weight: Tensor, strides=(2, 2),
                             padding=(1, 1, 1, 1), verify: bool = False) -> DerivationCase:
    """Σ_{c,k1,k2} → Σ_{k1,k2} {Σ_c}; the coupled pairs ((y+p)//s − k, (y+p)%s + s·k) ↦ new
    iterators (ψ fitted, proven); inline; tighten the input-row iterators."""
    expr = canonical.conv2d_transpose(data, weight, strides=strides, padding=padding)
    return _run("stride-2 ConvTranspose → Matmul + OffsetReduce", expr, [
        (SummationSplitting(inner={"c"}), "top"),
        (VariableSubstitution(("coupled",)), "top/scope0"),
        (TraversalMerging(), "top"),
        (BoundaryTightening(), "top/scope0"),
        (BoundaryTightening(), "top/scope0"),
    ], "conv2d_transpose", verify, strides=tuple(strides), padding=tuple(padding))


def conv5x5_to_conv3x3(data: Tensor, weight: Tensor, padding=(2, 2, 2, 2),
                       verify: bool = False) -> DerivationCase:
    """Relax r, s from 5 to 6; split each as 3·r1 + r2; Σ_{c,r2,s2} into a scope; substitute
    y + 3·r1 − 2 ↦ t1 (and for x); inline. The scope is a 3×3 conv with (r1, s1) as 4× output
    channels, the outer expression an OffsetReduce."""
    expr = canonical.conv2d(data, weight, padding=padding)
    c, r, s = expr.sums

    def inner_sum(current: Expr):
        # The channel and the two within-kernel offsets (the new summation iterators of
        # extent 3 that splitting r and s created) go into the scope.
        new = {it.name for it in current.sums} - {it.name for it in expr.sums}
        offsets = {it.name for it in current.sums if it.name in new and it.extent == 3}
        return SummationSplitting(inner={c.name} | offsets), "top"

    return _run("conv5x5 → conv3x3 (4× channels) + OffsetReduce", expr, [
        (BoundaryRelaxing({r.name: (r.lo, r.lo + 6)}), "top"),
        (BoundaryRelaxing({s.name: (s.lo, s.lo + 6)}), "top"),
        (SummationIteratorSplitting([r.name], [3]), "top"),
        (SummationIteratorSplitting([s.name], [3]), "top"),
        inner_sum,
        (VariableSubstitution(("offset",)), "top/scope0"),
        (TraversalMerging(), "top"),
    ], "conv2d", verify, padding=tuple(padding))


def dilated_g2bmm(a: Tensor, b: Tensor, width: int, dilation: int,
                  verify: bool = False) -> DerivationCase:
    """Split the row iterator i by the dilation (i % d, i // d): each residue class is a
    non-dilated G2BMM; instantiation adds the layout eOperators around it."""
    expr = canonical.g2bmm(a, b, width=width, dilation=dilation)
    return _run("dilated G2BMM → G2BMM + DLTs", expr, [
        (VariableSubstitution(("split",)), "top"),
    ], "g2bmm", verify)


def merged_matmuls(a: Tensor, b1: Tensor, b2: Tensor) -> DerivationCase:
    """A·B1 and A·B2 → one A·[B1 ‖ B2], each result a window of it."""
    e1, e2 = canonical.matmul(a, b1), canonical.matmul(a, b2)
    merged = merge_expressions(e1, e2)
    return DerivationCase("two matmuls sharing an input → one matmul", (e1, e2), (merged,),
                          merged.results, "matmul")


def original_module(case: DerivationCase):
    """The original operator(s) as a Relax module: TVM's own conv2d / conv2d_transpose /
    matmul ops; G2BMM, which Relax lacks, as a TE kernel of its canonical expression with the
    same default schedule the derived kernels get. Inputs are sorted by name."""
    from tvm import relax

    from ..expr.expression import input_tensors
    from .eoperator import emit_eoperator

    tensors = {}
    for e in case.original:
        tensors.update(input_tensors(e))
    params = {n: relax.Var(n, relax.TensorType(t.shape, t.dtype)) for n, t in sorted(tensors.items())}
    attrs = dict(case.attrs)
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        with bb.dataflow():
            args = list(params.values())
            if case.op == "conv2d":
                out = relax.op.nn.conv2d(args[0], args[1], padding=list(attrs["padding"]))
            elif case.op == "conv2d_transpose":
                out = relax.op.nn.conv2d_transpose(args[0], args[1], strides=list(attrs["strides"]),
                                                   padding=list(attrs["padding"]))
            elif case.op == "g2bmm":
                out = emit_eoperator(bb, case.original[0], params, "G2BMM")
            elif case.op == "matmul":
                shared = [n for n in params if all(n in input_tensors(e) for e in case.original)]
                out = relax.Tuple([relax.op.matmul(params[shared[0]], params[w])
                                   for e in case.original for w in input_tensors(e)
                                   if w != shared[0]])
            else:
                raise NotImplementedError(f"no original module for operator {case.op!r}")
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    return bb.get()
