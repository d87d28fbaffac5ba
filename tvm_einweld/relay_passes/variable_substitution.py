"""Variable substitution (EinNet §4.1): compute an expression over new iterators y = Φ(x).

    L_x Σ_z f(x, z)  ↦  L_x {L_y^{box Φ(X)} Σ_z f(ψ(y), z)}[Φ(x)]

Φ is inferred from the index functions present (not enumerated blindly):
  * offsets: an index function that adds several traversal iterators (h + r − 1, y + 3·r2 − 2)
    becomes one new iterator, replacing an iterator with coefficient ±1;
  * coupled non-affine functions: k functions over the same k iterators, such as
    ((y+p)//s − k, (y+p)%s + s·k) in a strided transposed convolution;
  * merges: two adjacent iterators read together everywhere become one, a·B + b;
  * splits: an iterator read next to a multiple of itself (i + 2·j) splits by that factor.
ψ is solved (affine) or fitted (`inverse.py`) and the side condition ψ∘Φ = id on X is proven
with z3 (`prove_left_inverse`), together with Φ(X) lying in the new scope's box. The new
scope's range is the bounding box of Φ(X): the extra points are computed but never read, so
the tensors they read are padded (with zeros) just enough to be readable.

Summation iterators are substituted in place (`SummationIteratorSplitting`): Σ_r f(r) =
Σ_{r1,r0} f(d·r1 + r0) when (r1, r0) ↦ d·r1 + r0 is a bijection onto r's range (z3,
`prove_bijection`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..expr import index as ix
from ..expr.expression import Access, Expr, Iterator, Scope, accesses, substitute_body
from ..expr.index import IndexExpr, IVar
from ..verify.smt import prove_bijection, prove_image_within, prove_left_inverse
from .derivation import LevelRewrite, Rule, fresh_name, widen_padding
from .inverse import infer_inverse


def substitute(expr: Expr, phi: Mapping[str, IndexExpr], psi: Mapping[str, IndexExpr],
               layout: Optional[Sequence[str]] = None) -> LevelRewrite:
    """The substitution y = Φ(x) with inverse ψ, both given (proven in the side conditions).

    phi: {new name: expression over traversal iterators}; psi: {replaced traversal iterator:
    expression over new and kept iterators}. `layout` orders the new scope's traversal
    iterators; by default the new ones, in Φ's order, take the place of the first replaced one.
    """
    trav = {it.name: it for it in expr.traversals}
    replaced = [n for n in trav if n in psi]
    if not replaced or any(n not in trav for n in psi):
        raise ValueError(f"ψ must map traversal iterators of {expr}, got {sorted(psi)}")
    if set(phi) & set(trav) - set(replaced):
        raise ValueError("new iterator names clash with kept iterators")
    ranges = expr.ranges
    new_its = {}
    for name, e in phi.items():
        lo, hi = ix.bounds(e, ranges)
        new_its[name] = Iterator(name, lo, hi + 1)
    if layout is None:  # the new iterators, in Φ's order, where the first replaced one was
        first = min(list(trav).index(n) for n in replaced)
        kept = [n for n in trav if n not in psi]
        before = [n for n in kept if list(trav).index(n) < first]
        layout = before + list(phi) + kept[len(before):]
    scope_travs = tuple(new_its[n] if n in new_its else trav[n] for n in layout)
    if sorted(layout) != sorted(set(trav) - set(replaced) | set(phi)):
        raise ValueError(f"layout {layout} must list the kept and the new iterators")
    # Summation iterators keep their names unless a new iterator takes it.
    taken = set(layout)
    sums, rename = [], {}
    for it in expr.sums:
        name = fresh_name(taken | {s.name for s in expr.sums}, it.name) if it.name in taken \
            else it.name
        taken.add(name)
        rename[it.name] = IVar(name)
        sums.append(Iterator(name, it.lo, it.hi))
    body = substitute_body(expr.body, {**dict(psi), **rename})
    scope = Scope(widen_padding(Expr(scope_travs, tuple(sums), body, expr.dtype)))
    read = tuple(phi[n] if n in phi else IVar(n) for n in layout)
    result = Expr(expr.traversals, (), Access(scope, read), expr.dtype)

    # Kept iterators that Φ or ψ read take part in the round trip as identity components.
    kept_used = sorted((set().union(*(ix.free_vars(e) for e in psi.values())) - set(phi))
                       | (set().union(*(ix.free_vars(e) for e in phi.values())) - set(psi)))
    phi_full = {**dict(phi), **{k: IVar(k) for k in kept_used}}
    psi_full = {**dict(psi), **{k: IVar(k) for k in kept_used}}
    domain = tuple(trav[n] for n in trav if n in psi_full)
    box_domain = expr.traversals
    box = [(it.lo, it.hi) for it in scope_travs]

    def left_inverse():
        return prove_left_inverse(phi_full, psi_full, domain)

    def in_box():
        return prove_image_within(read, box_domain, box)

    text = ", ".join(f"{n} = {e}" for n, e in phi.items())
    return LevelRewrite(result, (left_inverse, in_box), f"substitute {text}")


def _traversal_part(e: IndexExpr, trav: Sequence[str]) -> Optional[Tuple[Dict[str, int], int]]:
    form = ix.linear_form(e)
    if form is None:
        return None
    coeffs, const = form
    return {n: c for n, c in coeffs.items() if n in trav}, const


def offset_substitutions(expr: Expr) -> Iterable[Tuple[Dict[str, IndexExpr], Dict[str, IndexExpr]]]:
    """(Φ, ψ) pairs for index functions that add up several traversal iterators."""
    trav = [it.name for it in expr.traversals]
    taken = {it.name for it in expr.iterators}
    for acc in _distinct_accesses(expr):
        pieces = []
        for idx in acc.indices:
            part = _traversal_part(idx, trav)
            if part is None or len(part[0]) < 2:
                continue
            pieces.append(part)
        if not pieces:
            continue
        groups = [pieces] + ([[p] for p in pieces] if len(pieces) > 1 else [])
        for group in groups:
            phi, psi, used = {}, {}, set(taken)
            for coeffs, const in group:
                if set(coeffs) & set(psi):
                    break
                pick = next((n for n in trav if abs(coeffs.get(n, 0)) == 1 and n not in psi
                             and all(n not in ix.free_vars(e) for e in phi.values())), None)
                if pick is None:
                    break
                new = fresh_name(used, "t")
                used.add(new)
                phi[new] = ix.from_linear(coeffs, const)
                c = coeffs[pick]
                rest = ix.from_linear({k: v for k, v in coeffs.items() if k != pick}, const)
                psi[pick] = ix.mul(ix.sub(IVar(new), rest), c)  # c = ±1 is its own inverse
            else:
                yield phi, psi


def coupled_substitutions(expr: Expr) -> Iterable[Tuple[Dict[str, IndexExpr], Dict[str, IndexExpr]]]:
    """(Φ, ψ) for groups of k non-affine index functions over the same k traversal iterators."""
    trav = {it.name: it for it in expr.traversals}
    fns: List[IndexExpr] = []
    for acc in accesses(expr.body):
        for idx in acc.indices:
            fv = ix.free_vars(idx)
            if fv and fv <= set(trav) and ix.linear_form(idx) is None and idx not in fns:
                fns.append(idx)
    components: List[Tuple[List[IndexExpr], set]] = []
    for f in fns:
        fv = set(ix.free_vars(f))
        merged = [c for c in components if c[1] & fv]
        group = ([f] + [g for c in merged for g in c[0]], fv.union(*[c[1] for c in merged]))
        components = [c for c in components if c not in merged] + [group]
    square = [c for c in components if len(c[0]) == len(c[1])]
    taken = {it.name for it in expr.iterators}
    choices = [square] + ([[c] for c in square] if len(square) > 1 else [])
    for chosen in choices:
        if not chosen:
            continue
        phi, used = {}, set(taken)
        for f_list, _ in chosen:
            for f in f_list:
                new = fresh_name(used, "t")
                used.add(new)
                phi[new] = f
        domain = [trav[n] for n in trav if any(n in c[1] for c in chosen)]
        psi = infer_inverse(phi, domain)
        if psi is not None:
            yield phi, psi


def merge_substitutions(expr: Expr) -> Iterable[Tuple[Dict[str, IndexExpr], Dict[str, IndexExpr]]]:
    """(Φ, ψ) merging adjacent traversal iterators a, b read as neighbouring plain indices
    [.., a, b, ..] by every access that reads either: m = (a − lo_a)·|b| + (b − lo_b)."""
    its = expr.traversals
    for a, b in zip(its, its[1:]):
        ok = True
        for acc in accesses(expr.body):
            names = [i.name if isinstance(i, IVar) else None for i in acc.indices]
            reads = {a.name, b.name} & set().union(*(ix.free_vars(i) for i in acc.indices))
            if not reads:
                continue
            pairs = list(zip(names, names[1:]))
            if (a.name, b.name) not in pairs:
                ok = False
                break
        if not ok:
            continue
        new = fresh_name({it.name for it in expr.iterators}, "m")
        phi = {new: ix.add(ix.mul(ix.sub(a.var, a.lo), b.extent), ix.sub(b.var, b.lo))}
        psi = {a.name: ix.add(ix.floordiv(IVar(new), b.extent), a.lo),
               b.name: ix.add(ix.floormod(IVar(new), b.extent), b.lo)}
        yield phi, psi


def split_substitutions(expr: Expr) -> Iterable[Tuple[Dict[str, IndexExpr], Dict[str, IndexExpr]]]:
    """(Φ, ψ) splitting a traversal iterator v by a factor d read next to it: an index function
    c·v + d·c·w + ... (a dilation d, as in i + 2·j) suggests v ↦ ((v − lo) % d, (v − lo) // d),
    which turns the dilated read into a dense one on each residue class."""
    seen = set()
    taken = {it.name for it in expr.iterators}
    for acc in accesses(expr.body):
        for idx in acc.indices:
            form = ix.linear_form(idx)
            if form is None:
                continue
            for it in expr.traversals:
                cv = form[0].get(it.name)
                if not cv:
                    continue
                for w, cw in form[0].items():
                    if w == it.name or cw % cv or abs(cw // cv) < 2:
                        continue
                    d = abs(cw // cv)
                    if (it.name, d) in seen or it.extent <= d:
                        continue
                    seen.add((it.name, d))
                    low, high = fresh_name(taken, "t"), None
                    high = fresh_name(taken | {low}, "t")
                    off = ix.sub(it.var, it.lo)
                    phi = {low: ix.floormod(off, d), high: ix.floordiv(off, d)}
                    psi = {it.name: ix.add(ix.add(ix.mul(IVar(high), d), IVar(low)), it.lo)}
                    yield phi, psi


def _distinct_accesses(expr: Expr) -> List[Access]:
    out: List[Access] = []
    for acc in accesses(expr.body):
        if acc not in out:
            out.append(acc)
    return out


class VariableSubstitution(Rule):
    """Substitutions of traversal iterators inferred from the index functions.

    `kinds` selects among "offset", "coupled", "merge" and "split" (all by default).
    """

    name = "variable_substitution"

    def __init__(self, kinds: Iterable[str] = ("offset", "coupled", "merge", "split")) -> None:
        self.kinds = tuple(kinds)

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        makers = {"offset": offset_substitutions, "coupled": coupled_substitutions,
                  "merge": merge_substitutions, "split": split_substitutions}
        for kind in self.kinds:
            for phi, psi in makers[kind](expr):
                yield substitute(expr, phi, psi)


# --- summation iterators ---------------------------------------------------------------------

def split_sum_iterator(expr: Expr, name: str, factor: int) -> LevelRewrite:
    """Σ_r ↦ Σ_{r_outer, r_inner} with r = lo + factor·r_outer + r_inner."""
    it = expr.iterator(name)
    if it not in expr.sums:
        raise ValueError(f"{name} is not a summation iterator")
    taken = {i.name for i in expr.iterators}
    outer = fresh_name(taken, name)
    inner = fresh_name(taken | {outer}, name)
    outer_it = Iterator(outer, 0, -(-it.extent // factor))
    inner_it = Iterator(inner, 0, factor)
    psi = {name: ix.add(ix.add(ix.mul(IVar(outer), factor), IVar(inner)), it.lo)}
    phi = {outer: ix.floordiv(ix.sub(it.var, it.lo), factor),
           inner: ix.floormod(ix.sub(it.var, it.lo), factor)}
    sums = []
    for s in expr.sums:
        sums += [outer_it, inner_it] if s.name == name else [s]
    body = substitute_body(expr.body, psi)
    result = widen_padding(Expr(expr.traversals, tuple(sums), body, expr.dtype))

    def bijection():
        return prove_bijection(phi, psi, (it,), (outer_it, inner_it))

    return LevelRewrite(result, (bijection,),
                     f"split Σ {name} = {psi[name]} ({outer}: {outer_it.lo}..{outer_it.hi}, "
                     f"{inner}: 0..{factor})")


class SummationIteratorSplitting(Rule):
    """Split a summation iterator by a proper divisor of its extent (one iterator into two)."""

    name = "summation_iterator_splitting"
    # Not searched: it applies to almost every state (one instance per divisor); its one
    # combination that matters for operators is `WindowSplitting`.
    searched = False

    def __init__(self, names: Optional[Iterable[str]] = None,
                 factors: Optional[Iterable[int]] = None) -> None:
        self.names = set(names) if names is not None else None
        self.factors = set(factors) if factors is not None else None

    def candidates(self, expr: Expr, is_top: bool) -> Iterable[LevelRewrite]:
        for it in expr.sums:
            if self.names is not None and it.name not in self.names:
                continue
            for d in range(2, it.extent):
                if it.extent % d == 0 and (self.factors is None or d in self.factors):
                    yield split_sum_iterator(expr, it.name, d)
