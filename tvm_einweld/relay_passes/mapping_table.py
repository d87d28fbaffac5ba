"""Operator matching with the iterator-mapping table (EinNet §5.1, Table 2).

Every iterator of a two-input expression  L Σ X[...] · Y[...]  gets a signature: whether it
appears in X's index functions, in Y's, in the output (is a traversal iterator), and whether it
is *compound* (shares an index function with another iterator, like h and r in h + r). An
operator's row in the table lists, per signature group, how many iterators its canonical
expression has there. Matching (`match`) tries both tensor mappings (X→input 0 or input 1),
requires the groups to agree, pairs compound iterators through their shared index function,
and reads the operator's attributes off the coefficients of the index functions flattened by
the tensors' row-major strides (`index.linear_form`): transposes and leading dimensions of a
matmul, strides, dilations and padding of a convolution, the dilation of a G2BMM.

Attributes are derived for matmul, conv2d (with groups), conv2d_transpose, G2BMM and GBMM;
instantiation (`instantiate.py`) emits Relax ops for the first three it needs.

`expression_distance(expr, op)` counts the iterators that do not fit the operator's groups (the
paper's "expression distance", minimised by the search; 0 when the expression has exactly the
canonical iterators; several iterators of one group can still instantiate by flattening).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Iterator as PyIterator, List, Mapping, Optional, Tuple

from ..expr import index as ix
from ..expr.expression import Access, BinaryOp, Expr, Tensor

# (in X, in Y, in output, compound)
Signature = Tuple[bool, bool, bool, bool]


@dataclass(frozen=True)
class OperatorRow:
    """One row of the table: {group name: (signature, canonical count)}; count ANY means any
    positive number of iterators (element-wise operators have one per dimension)."""

    name: str
    groups: Tuple[Tuple[str, Signature, int], ...]
    body_op: str = "*"

    def count(self, sig: Signature) -> int:
        return sum(n for _, s, n in self.groups if s == sig)


T, F = True, False
ANY = -1
TABLE: Dict[str, OperatorRow] = {
    row.name: row for row in (
        OperatorRow("elementwise", (("i", (T, T, T, F), ANY),), body_op="any"),
        OperatorRow("matmul", (("m", (T, F, T, F), 1), ("n", (F, T, T, F), 1),
                               ("k", (T, T, F, F), 1))),
        OperatorRow("batch_matmul", (("b", (T, T, T, F), 1), ("m", (T, F, T, F), 1),
                                     ("n", (F, T, T, F), 1), ("k", (T, T, F, F), 1))),
        OperatorRow("conv2d", (("n", (T, F, T, F), 1), ("f", (F, T, T, F), 1),
                               ("c", (T, T, F, F), 1), ("hw", (T, F, T, T), 2),
                               ("rs", (T, T, F, T), 2))),
        OperatorRow("conv2d_transpose", (("n", (T, F, T, F), 1), ("f", (F, T, T, F), 1),
                                         ("c", (T, T, F, F), 1), ("hw", (T, T, T, T), 2),
                                         ("rs", (T, T, F, T), 2))),
        OperatorRow("g2bmm", (("b", (T, T, T, F), 1), ("i", (T, T, T, T), 1),
                              ("j", (F, T, T, T), 1), ("k", (T, T, F, F), 1))),
        OperatorRow("gbmm", (("b", (T, T, T, F), 1), ("i", (T, T, T, T), 1),
                             ("j", (T, T, F, T), 1), ("k", (F, T, T, F), 1))),
    )
}


def operands(expr: Expr) -> Optional[Tuple[Access, Access]]:
    """(X, Y) when the body is a product of two tensor accesses."""
    b = expr.body
    if isinstance(b, BinaryOp) and isinstance(b.lhs, Access) and isinstance(b.rhs, Access):
        return b.lhs, b.rhs
    return None


def signatures(expr: Expr, x: Access, y: Access) -> Dict[str, Signature]:
    """The table signature of every iterator of `expr` for operands (x, y)."""
    trav = {it.name for it in expr.traversals}
    out = {}
    for it in expr.iterators:
        in_x = any(it.name in ix.free_vars(i) for i in x.indices)
        in_y = any(it.name in ix.free_vars(i) for i in y.indices)
        compound = any(it.name in ix.free_vars(i) and len(ix.free_vars(i)) > 1
                       for i in x.indices + y.indices)
        out[it.name] = (in_x, in_y, it.name in trav, compound)
    return out


def _mismatch(sigs: Mapping[str, Signature], row: OperatorRow) -> int:
    counts: Dict[Signature, int] = {}
    for s in sigs.values():
        counts[s] = counts.get(s, 0) + 1
    known = {s for _, s, _ in row.groups}
    d = sum(abs(counts.get(s, 0) - row.count(s)) if row.count(s) != ANY
            else (0 if counts.get(s, 0) else 1) for s in known)
    return d + sum(n for s, n in counts.items() if s not in known)


def expression_distance(expr: Expr, op: str) -> int:
    """Iterators that do not fit operator `op`'s groups, over the best tensor mapping.

    An expression that is not a binary product gets one mismatch per iterator.
    """
    row = TABLE[op]
    pair = operands(expr)
    if pair is None:
        return len(expr.iterators)
    x, y = pair
    if row.body_op == "any":
        return _mismatch(signatures(expr, x, y), row)
    return min(_mismatch(signatures(expr, a, b), row) for a, b in ((x, y), (y, x)))


# --- matching with attributes ---------------------------------------------------------------

@dataclass(frozen=True)
class OperatorMatch:
    """A tensor mapping and iterator grouping of `expr` onto operator `op`, with attributes."""

    op: str
    x: Access
    y: Access
    groups: Tuple[Tuple[str, Tuple[str, ...]], ...]
    attrs: Tuple[Tuple[str, object], ...] = ()

    def group(self, name: str) -> Tuple[str, ...]:
        return dict(self.groups)[name]

    def attr(self, name: str):
        return dict(self.attrs)[name]


def flattened(access: Access) -> Optional[Tuple[Dict[str, int], int]]:
    """The row-major flat offset of an access as a linear form, when it is affine."""
    flat: ix.IndexExpr = ix.IConst(0)
    for idx, n, o in zip(access.indices, access.source.shape, access.source.origin):
        flat = ix.add(ix.mul(flat, n), ix.sub(idx, o))
    return ix.linear_form(flat)


def _grouped(expr: Expr, sigs: Mapping[str, Signature], row: OperatorRow
             ) -> Optional[Dict[str, Tuple[str, ...]]]:
    """Iterators by group name (in expression order), or None if some iterator fits none."""
    groups: Dict[str, List[str]] = {g: [] for g, _, _ in row.groups}
    by_sig = {s: g for g, s, _ in row.groups}
    for it in expr.iterators:
        sig = sigs[it.name]
        g = by_sig.get(sig)
        if g is None and not sig[0]:
            # An iterator only the second operand reads may be compound there: that operand
            # (a weight) is re-laid out by a DLT anyway, which flattens its index functions.
            g = by_sig.get(sig[:3] + (not sig[3],))
        if g is None:
            return None
        groups[g].append(it.name)
    return {g: tuple(v) for g, v in groups.items()}


def _mappings(expr: Expr) -> PyIterator[Tuple[Access, Access]]:
    pair = operands(expr)
    if pair is not None and all(isinstance(a.source, Tensor) for a in pair):
        yield pair
        yield pair[1], pair[0]


MAX_ORDERINGS = 24


def _orderings(groups: Mapping[str, Tuple[str, ...]]) -> PyIterator[Dict[str, Tuple[str, ...]]]:
    """The iterator mappings within groups: every order of each group's iterators (the order
    they flatten in), expression order first, at most MAX_ORDERINGS in all."""
    names = list(groups)
    choices = [list(itertools.permutations(groups[g])) for g in names]
    for combo in itertools.islice(itertools.product(*choices), MAX_ORDERINGS):
        yield dict(zip(names, combo))


def match_matmul(expr: Expr) -> PyIterator[OperatorMatch]:
    """Batch matmul: every group may hold several iterators (they flatten into one dimension,
    in each order `_orderings` yields).

    Attributes: transpose flags and leading dimensions from the flattened coefficients."""
    row = TABLE["batch_matmul"]
    for x, y in _mappings(expr):
        grouped = _grouped(expr, signatures(expr, x, y), row)
        if grouped is None or not grouped["m"] and not grouped["n"] or not grouped["k"]:
            continue
        for groups in _orderings(grouped):
            yield _matmul_match(x, y, groups)


def _matmul_match(x: Access, y: Access, groups: Mapping[str, Tuple[str, ...]]) -> OperatorMatch:
    """Transpose flags and leading dimensions: compare the flattened coefficients of the
    innermost iterators of the two groups each operand reads."""
    attrs = []
    for name, acc, outer, inner in (("a", x, "m", "k"), ("b", y, "k", "n")):
        form = flattened(acc)
        if form is not None and groups[outer] and groups[inner]:
            c_outer = abs(form[0].get(groups[outer][-1], 0))
            c_inner = abs(form[0].get(groups[inner][-1], 0))
            attrs += [(f"transpose_{name}", c_outer < c_inner),
                      (f"ld{name}", max(c_outer, c_inner))]
    return OperatorMatch("matmul", x, y, tuple(groups.items()), tuple(attrs))


def _pair_spatial(x: Access, hw: Tuple[str, ...], rs: Tuple[str, ...]):
    """(t, r, stride, dilation, offset, dim of x) for each compound index a·t + b·r + c of x."""
    pairs = []
    for d, idx in enumerate(x.indices):
        form = ix.linear_form(idx)
        if form is None:
            continue
        coeffs, const = form
        ts = [n for n in coeffs if n in hw]
        rs_ = [n for n in coeffs if n in rs]
        if len(ts) == 1 and len(rs_) == 1 and len(coeffs) == 2:
            pairs.append((ts[0], rs_[0], coeffs[ts[0]], coeffs[rs_[0]], const, d))
    return pairs


def grouped_channel(expr: Expr, x: Access, w: Access) -> Optional[Tuple[int, str, str, int]]:
    """(dim, f, c, groups) when a data index is (f // Fg)·Cg + c: a grouped convolution's
    channel, with f the output channel (traversal, read by the weight) and c ∈ [0, Cg)."""
    from ..expr.index_simplify import atom_form

    trav = {it.name for it in expr.traversals}
    w_vars = set().union(*(ix.free_vars(i) for i in w.indices))
    for d, idx in enumerate(x.indices):
        coeffs, const = atom_form(idx)
        if const or len(coeffs) != 2:
            continue
        # f // Fg, or f itself when Fg = 1 (depthwise: the constructors fold f // 1 to f).
        divs = [(a.lhs.name, a.rhs.value) if isinstance(a, ix.IBin) else (a.name, 1)
                for a in coeffs
                if (isinstance(a, ix.IBin) and a.op == "//" and isinstance(a.lhs, ix.IVar)
                    and a.lhs.name in trav and a.lhs.name in w_vars)
                or (isinstance(a, ix.IVar) and a.name in trav and a.name in w_vars)]
        plain = [a for a in coeffs if isinstance(a, ix.IVar) and a.name not in trav]
        if len(divs) != 1 or len(plain) != 1 or coeffs[plain[0]] != 1:
            continue
        (f, fg), c = divs[0], plain[0].name
        cg = coeffs[ix.IVar(f) if fg == 1 else ix.floordiv(ix.IVar(f), fg)]
        f_it, c_it = expr.iterator(f), expr.iterator(c)
        if (f_it.lo, c_it.lo) == (0, 0) and c_it.extent == cg and f_it.extent % fg == 0:
            return d, f, c, f_it.extent // fg
    return None


def match_conv2d(expr: Expr) -> PyIterator[OperatorMatch]:
    """2-D convolution: two compound index functions a·t + b·r + c of the data (stride a,
    dilation b, padding −c), n / f / c groups of plain iterators (several flatten into one);
    a data channel (f // Fg)·Cg + c makes it a grouped convolution (attribute `groups`)."""
    row = TABLE["conv2d"]
    for x, w in _mappings(expr):
        grouped = grouped_channel(expr, x, w)
        if grouped is not None:  # group as if the data read channel c alone
            d, _, c, _ = grouped
            plain_x = Access(x.source, x.indices[:d] + (ix.IVar(c),) + x.indices[d + 1:])
            sigs = signatures(expr, plain_x, w)
        else:
            sigs = signatures(expr, x, w)
        groups = _grouped(expr, sigs, row)
        if groups is None or len(groups["hw"]) != 2 or len(groups["rs"]) != 2:
            continue
        pairs = _pair_spatial(x, groups["hw"], groups["rs"])
        if len(pairs) != 2 or pairs[0][5] > pairs[1][5]:
            continue
        if any(a <= 0 or b <= 0 for _, _, a, b, _, _ in pairs):
            continue
        if grouped is not None and (groups["f"] != (grouped[1],) or groups["c"] != (grouped[2],)):
            continue
        attrs = (("strides", (pairs[0][2], pairs[1][2])), ("dilation", (pairs[0][3], pairs[1][3])),
                 ("offsets", (pairs[0][4], pairs[1][4])),
                 ("spatial", tuple((t, r, d) for t, r, _, _, _, d in pairs)),
                 ("groups", grouped[3] if grouped else 1),
                 ("channel_dim", grouped[0] if grouped else None))
        yield OperatorMatch("conv2d", x, w, tuple(groups.items()), attrs)


def match_g2bmm(expr: Expr) -> PyIterator[OperatorMatch]:
    """G2BMM: Y is read at a function of i + d·j (j the band iterator, traversal, not in X)."""
    trav = {it.name for it in expr.traversals}
    for x, y in _mappings(expr):
        sigs = signatures(expr, x, y)
        bands = [n for n, s in sigs.items() if s == (False, True, True, True)]
        if len(bands) != 1:
            continue
        j = bands[0]
        found = None
        for idx in y.indices:
            form = ix.linear_form(idx)
            if form is None or j not in form[0]:
                continue
            rows = sorted((n for n in form[0] if n != j and n in trav and sigs[n][0]),
                          key=lambda n: -abs(form[0][n]))
            # i is the iterator whose coefficient divides j's: idx = c·(i + d·j) + ...
            for i in rows:
                ci, cj = form[0][i], form[0][j]
                if cj % ci == 0:
                    found = (i, cj // ci)
                    break
        if found is None:
            continue
        i, dil = found
        rest = {n: s for n, s in sigs.items() if n not in (i, j)}
        batch = tuple(n for n in rest if rest[n][:3] == (True, True, True))
        k = tuple(n for n, s in rest.items() if s[:3] == (True, True, False))
        if len(batch) + len(k) != len(rest) or not k:
            continue
        groups = (("b", batch), ("i", (i,)), ("j", (j,)), ("k", k))
        yield OperatorMatch("g2bmm", x, y, groups, (("dilation", dil),))


def match_gbmm(expr: Expr) -> PyIterator[OperatorMatch]:
    """GBMM: C[b, i, k] = Σ_j A[b, i, j + w] · B[b, i + d·j, k]; j is the summed band."""
    row = TABLE["gbmm"]
    for a, y in _mappings(expr):
        groups = _grouped(expr, signatures(expr, a, y), row)
        if groups is None or any(len(groups[g]) != 1 for g in ("i", "j")) or not groups["k"]:
            continue
        (i,), (j,) = groups["i"], groups["j"]
        for idx in y.indices:
            form = ix.linear_form(idx)
            if form is not None and set(form[0]) == {i, j} and form[0][j] % form[0][i] == 0:
                yield OperatorMatch("gbmm", a, y, tuple(groups.items()),
                            (("dilation", form[0][j] // form[0][i]),))
                break


def match_conv2d_transpose(expr: Expr) -> PyIterator[OperatorMatch]:
    """Transposed convolution in the canonical form (y + p) // s − k and (y + p) % s + s·k:
    stride s and padding p read off the paired floor division and modulo."""
    row = TABLE["conv2d_transpose"]
    for x, w in _mappings(expr):
        groups = _grouped(expr, signatures(expr, x, w), row)
        if groups is None or len(groups["hw"]) != 2 or len(groups["rs"]) != 2:
            continue
        strides, pads = [], []
        for t in groups["hw"]:
            divs = [e for idx in x.indices for e in _floor_terms(idx, "//")
                    if t in ix.free_vars(e.lhs)]
            if len(divs) != 1:
                break
            form = ix.linear_form(divs[0].lhs)
            if form is None or form[0] != {t: 1}:
                break
            strides.append(divs[0].rhs.value)
            pads.append(form[1])
        else:
            yield OperatorMatch("conv2d_transpose", x, w, tuple(groups.items()),
                        (("strides", tuple(strides)), ("padding", tuple(pads))))


def _floor_terms(e: ix.IndexExpr, op: str) -> List[ix.IBin]:
    if not isinstance(e, ix.IBin):
        return []
    own = [e] if e.op == op else []
    return own + _floor_terms(e.lhs, op) + _floor_terms(e.rhs, op)


MATCHERS = {"matmul": match_matmul, "conv2d": match_conv2d, "g2bmm": match_g2bmm,
            "gbmm": match_gbmm, "conv2d_transpose": match_conv2d_transpose}


def match(expr: Expr, ops=("conv2d", "g2bmm", "matmul")) -> Optional[OperatorMatch]:
    """The first match of `expr` onto one of `ops`, tried in order."""
    for op in ops:
        for m in MATCHERS[op](expr):
            return m
    return None
