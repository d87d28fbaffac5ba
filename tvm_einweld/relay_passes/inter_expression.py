"""Inter-expression rules (EinNet §4.2): expression splitting, merging and fusion.

Splitting cuts one traversal range in two, L^X f = L^{X1} f ∪ L^{X2} f; the pieces are scopes
whose zero padding covers the other piece and the result is their sum, so X must be the
disjoint union of X1 and X2 (`prove_partition`: a point in both would count twice).

Merging is its inverse for two independent expressions with the same computation that differ
in one input tensor read along one traversal iterator (two matmuls sharing their left input,
with different weights): the differing inputs are concatenated along the dimension that
iterator indexes, one expression computes both results, and each original becomes a window of
it. The concatenation is itself an expression, T1[c] + T2[c − N1] with each operand padded by
the other's extent; its side conditions prove that each term is zero on the other's half.

Fusion substitutes a producer expression for the tensor a consumer reads (the paper's E1 ∘ E2),
as a scope with the tensor's padding; traversal merging can then inline it so that chains of
memory-bound expressions become one eOperator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

from ..expr import index as ix
from ..expr.expression import (
    Access, BinaryOp, Constant, Expr, Iterator, Scalar, Scope, Tensor, UnaryOp, accesses,
    map_accesses,
)
from ..verify.smt import ProofResult, prove_constant_region, prove_partition
from .derivation import (
    LevelRewrite, Derivation, Rule, RuleNotApplicable, SideCondition, check, replace_source,
    widen_padding,
)
from .traversal_merging import inline_scope


# --- splitting -------------------------------------------------------------------------------

def split_expression(expr: Expr, name: str, at: int) -> LevelRewrite:
    """L^X f ↦ {L^{X1} f}[x] + {L^{X2} f}[x] with X1, X2 the two halves of `name` at `at`."""
    it = expr.iterator(name)
    if it not in expr.traversals or not it.lo < at < it.hi:
        raise ValueError(f"cannot split traversal {name} of {expr} at {at}")
    parts = []
    for lo, hi in ((it.lo, at), (at, it.hi)):
        its = tuple(Iterator(name, lo, hi) if t.name == name else t for t in expr.traversals)
        part = Expr(its, expr.sums, expr.body, expr.dtype)
        pad = tuple((lo - it.lo, it.hi - hi) if t.name == name else (0, 0)
                    for t in expr.traversals)
        parts.append((Scope(part, pad), its))
    read = tuple(t.var for t in expr.traversals)
    body = Access(parts[0][0], read) + Access(parts[1][0], read)
    result = Expr(expr.traversals, (), body, expr.dtype)

    def partition() -> ProofResult:
        return prove_partition(expr.traversals, [parts[0][1], parts[1][1]])

    return LevelRewrite(result, (partition,), f"split {name} at {at}")


class ExpressionSplitting(Rule):
    """Split one traversal range in two halves (`at` fixes the cut for hand sequencing)."""

    name = "expression_splitting"
    # Not searched: a split level is two operators where there was one; hand-sequenced
    # derivations use it.
    searched = False

    def __init__(self, names: Optional[Iterable[str]] = None, at: Optional[int] = None) -> None:
        self.names = set(names) if names is not None else None
        self.at = at

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        for it in expr.traversals:
            if it.extent < 2 or (self.names is not None and it.name not in self.names):
                continue
            yield split_expression(expr, it.name, self.at if self.at is not None
                                   else it.lo + it.extent // 2)


# --- merging ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Merged:
    """Two expressions rewritten to read one merged scope; `results[i]` equals input i."""

    rule: str
    merged: Scope
    results: Tuple[Expr, Expr]
    side_conditions: Tuple[SideCondition, ...]
    description: str
    proofs: Tuple[ProofResult, ...] = ()


def _zip_bodies(a: Scalar, b: Scalar, diff: Dict[Tuple[str, str], Tuple[Access, Access]]) -> bool:
    """Whether a and b are the same computation up to tensors; differing access pairs are
    collected in `diff` keyed by (tensor in a, tensor in b)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, Access):
        if a.indices != b.indices or a.source.ndim != b.source.ndim:
            return False
        if a.source != b.source:
            if not (isinstance(a.source, Tensor) and isinstance(b.source, Tensor)):
                return False
            diff[(a.source.name, b.source.name)] = (a, b)
        return True
    if isinstance(a, BinaryOp):
        return a.op == b.op and _zip_bodies(a.lhs, b.lhs, diff) and _zip_bodies(a.rhs, b.rhs, diff)
    if isinstance(a, UnaryOp):
        return a.fn == b.fn and _zip_bodies(a.arg, b.arg, diff)
    return isinstance(a, Constant) and a == b


def merge_expressions(e1: Expr, e2: Expr, cat_name: Optional[str] = None) -> Merged:
    """Merge two expressions that differ in one input tensor along one traversal iterator.

    Raises RuleNotApplicable when they do not have that form or a side condition fails.
    """
    diff: Dict[Tuple[str, str], Tuple[Access, Access]] = {}
    if e1.sums != e2.sums or len(e1.traversals) != len(e2.traversals) \
            or not _zip_bodies(e1.body, e2.body, diff):
        raise RuleNotApplicable("expressions differ in more than their input tensors")
    if len(diff) != 1:
        raise RuleNotApplicable(f"expressions must differ in exactly one input, not {len(diff)}")
    (a1, a2), = diff.values()
    # The merge iterator: a traversal iterator that indexes one dimension of the differing
    # input as a plain iterator from 0 and appears in no other access.
    pairs = []
    for t1, t2 in zip(e1.traversals, e2.traversals):
        if t1.name != t2.name:
            raise RuleNotApplicable("expressions must use the same traversal iterators")
        dims = [d for d, i in enumerate(a1.indices) if i == t1.var]
        others = [acc for acc in accesses(e1.body) if acc != a1
                  and any(t1.name in ix.free_vars(i) for i in acc.indices)]
        if len(dims) == 1 and not others and t1.lo == 0 and t2.lo == 0:
            pairs.append((t1, t2, dims))
        elif t1 != t2:
            raise RuleNotApplicable(f"{t1} and {t2} differ but cannot be merged")
    if len(pairs) != 1:
        raise RuleNotApplicable("expressions need exactly one iterator that only the "
                                "differing input reads")
    t1, t2, dims = pairs[0]
    axis = dims[0]
    n1, n2 = a1.source.shape[axis], a2.source.shape[axis]
    if (t1.extent, t2.extent) != (n1, n2) or any(
            i != axis and x != y for i, (x, y) in enumerate(zip(a1.source.shape, a2.source.shape))):
        raise RuleNotApplicable("the differing inputs must be read whole and agree off the axis")

    # The concatenation: cat[c] = T1[c] + T2[c − n1], each term zero on the other's half.
    shape = list(a1.source.shape)
    shape[axis] = n1 + n2
    cat_its = tuple(Iterator(f"c{d}", 0, n) for d, n in enumerate(shape))
    idx1 = tuple(it.var for it in cat_its)
    idx2 = tuple(ix.sub(it.var, n1) if d == axis else it.var for d, it in enumerate(cat_its))
    term1 = widen_padding(Expr(cat_its, (), Access(a1.source, idx1), e1.dtype))
    term2 = widen_padding(Expr(cat_its, (), Access(a2.source, idx2), e1.dtype))
    cat = Scope(Expr(cat_its, (), term1.body + term2.body, e1.dtype))
    axis_name = cat_its[axis].name
    conditions = (
        lambda: prove_constant_region(term1, {axis_name: (n1, n1 + n2)}),
        lambda: prove_constant_region(term2, {axis_name: (0, n1)}),
    )
    big = Iterator(t1.name, 0, n1 + n2)
    travs = tuple(big if t.name == t1.name else t for t in e1.traversals)
    body = replace_source(Expr(travs, e1.sums, e1.body, e1.dtype), a1.source, cat).body
    merged = Scope(Expr(travs, e1.sums, body, e1.dtype))
    read1 = tuple(t.var for t in e1.traversals)
    read2 = tuple(ix.add(t.var, n1) if t.name == t1.name else t.var for t in e2.traversals)
    first = Expr(e1.traversals, (), Access(merged, read1), e1.dtype)
    second = Expr(e2.traversals, (), Access(merged, read2), e2.dtype)
    proofs = tuple(c() for c in conditions)
    failed = [p for p in proofs if not p.proven]
    if failed:
        raise RuleNotApplicable("expression merging: " + "; ".join(map(str, failed)))
    return Merged("expression_merging", merged, (first, second), conditions,
                  f"merge along {t1.name}: {a1.source.name} ‖ {a2.source.name}", proofs)


# --- fusion ----------------------------------------------------------------------------------

def fuse(consumer: Expr, tensor: str, producer: Expr, inline: bool = True) -> Derivation:
    """Substitute `producer` for the input `tensor` of `consumer`, then (by default) inline it.

    The producer must compute the tensor's shape from origin 0; its scope takes the tensor's
    padding, so reads of the padding still see zeros. Inlining is traversal merging, with its
    side condition proven; a producer with a summation read under anything but a plain copy
    (relu(Σ ...)) stays a scope, which instantiation fuses into the consumer's eOperator.
    """
    found = [a for a in accesses(consumer.body)
             if isinstance(a.source, Tensor) and a.source.name == tensor]
    if not found:
        raise RuleNotApplicable(f"{consumer} does not read {tensor}")
    src = found[0].source
    if producer.shape != src.shape or any(it.lo for it in producer.traversals):
        raise RuleNotApplicable(f"producer of shape {producer.shape} cannot stand for "
                                f"{tensor}{list(src.shape)}")

    def to_scope(a: Access) -> Access:
        if isinstance(a.source, Tensor) and a.source.name == tensor:
            return Access(Scope(producer, a.source.pad), a.indices)
        return a

    fused = Expr(consumer.traversals, consumer.sums, map_accesses(consumer.body, to_scope),
                 consumer.dtype)
    derivation = check("expression_fusion", LevelRewrite(fused, (), f"fuse producer of {tensor}"))
    if not inline:
        return derivation
    for acc in list(accesses(fused.body)):
        if isinstance(acc.source, Scope) and acc.source.expr == producer:
            try:
                candidate = inline_scope(derivation.result, acc)
            except ValueError:  # a sum under a non-linear consumer stays a scope
                continue
            step = check("expression_fusion", candidate)
            derivation = Derivation("expression_fusion", step.result,
                                    derivation.side_conditions + step.side_conditions,
                                    f"fuse and inline producer of {tensor}",
                                    derivation.proofs + step.proofs)
    return derivation


# --- rule objects for the inter-expression rules (they read two expressions) -------------------

class ExpressionMerging:
    """Merging as a rule object: `apply(first, second)` yields the merged pair when the two
    expressions have that form and its side conditions are proven (nothing otherwise)."""

    name = "expression_merging"

    def apply(self, first: Expr, second: Expr) -> Iterable[Merged]:
        try:
            yield merge_expressions(first, second)
        except RuleNotApplicable:
            return


class ExpressionFusion:
    """Fusion as a rule object: `apply(consumer, producers)` yields, for each input of the
    consumer that a producer ({tensor name: expression}) computes, the fused expression."""

    name = "expression_fusion"

    def __init__(self, inline: bool = True) -> None:
        self.inline = inline

    def apply(self, consumer: Expr, producers: Dict[str, Expr]) -> Iterable[Derivation]:
        for tensor, producer in producers.items():
            try:
                yield fuse(consumer, tensor, producer, self.inline)
            except RuleNotApplicable:
                continue
