"""`DerivationTransform`: EinNet's end-to-end optimiser (Algorithm 1) as a Relax module pass.

For every Relax function:

1. split it into subprograms at activations (`subprograms.py`); operators without a canonical
   expression are left alone;
2. for every operator of a subprogram, collect candidate programs (`candidates.py`):
   * the original call (always a candidate, so nothing gets slower by the cost model's own
     estimate),
   * with `providers=True` only, numpy's BLAS for a matmul (`numpy_gemm.py`, a Python
     callback: off by default, the analytic GEMM kernels are faster and need no Python at
     inference),
   * the states of the distance-guided derivation search (`search.py`) from the operator's
     canonical expression, instantiated as predefined operators plus eOperators
     (`instantiate.py`; matched matmuls take the faster provider);
   * for a stride-1 3x3 convolution (dilated too) on a CPU, its Winograd form
     (`winograd.py`: a batched matmul between an input and an output transform eOperator,
     the algorithm's identity proven in exact arithmetic), when its roofline beats the direct
     convolution's;
   then, across operators, inter-expression merging: two operators that differ in one input
   become one operator on the concatenated inputs (EinNet §4.2, Algorithm 1 line 11);
3. cost every candidate (`op_cost.program_kernels`: compute-bound predefined operators
   timed on the target, eOperators and memory-bound operators (reshape, add, ...) from
   bytes moved and measured bandwidth, weight-only kernels free
   because `FoldConstant` evaluates them at compile time) and keep the cheapest; a
   non-original choice must beat the original by `min_speedup`. An operator with no other
   candidate keeps its roofline estimate: there is nothing for a timing to decide;
4. time the rewrite against the original subprogram (with `confirm_by_measurement`): one that
   is not faster there is not used, and so not checked either; then verify the rewritten
   subprogram as a whole against the original one: `tvm.compile` both and compare on random
   inputs (`verify.random_testing.compare_relax`), and require every side condition proof of
   the derivations used to be proven. A subprogram that fails keeps its original operators,
   and the report says why;
5. splice the chosen programs in, keeping every original variable, then fold weight-only
   expressions (`relax.transform.FoldConstant`, the paper's compile-time evaluation);
6. run the rewritten module as a whole against the given one (`verify.module_check`: its own
   constants, random, constant, zero and large inputs); if they disagree, return the given
   module with a warning.

Why it is correct: every replacement computes the same tensor as the call it replaces: it is
derived by proven rules, instantiated, and then checked end to end on random inputs against
the original subprogram; anything unverified is not applied.

`log` (a path, or a list) receives one JSON record per subprogram: rule sequence, verification
evidence, estimated and measured times; so does every `RewriteLog` instrument of the current
`PassContext` (`rewrite_log.py`), which also reaches the pass inside a pipeline.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.target import Target

from .. import machine
from ..cost_model import measured_peaks, peaks_for
from ..expr.expression import Expr
from ..expr.from_relax import expr_of_call
from ..expr.fingerprint import structurally_equal
from ..verify.random_testing import compare_relax
from . import numpy_gemm, winograd
from .candidates import (
    Emit, OpResult, Program, Providers, SubprogramResult, derived_emit, gemm_emit, merged_emits,
    original_emit, subprogram_inputs, subprogram_module, unchanged_result, winograd_emit,
)
from .op_cost import flops, program_kernels, roofline_seconds, static_shape, time_calls
from .derivation import Rule
from .registry import default_rules
from .rewrite_log import active_logs, write_records
from .search import (
    Budget, Distance, SearchResult, State, default_targets, distance_guided_search,
)
from .subprograms import OpNode, Subprogram, rebuild_function, split_module

_LOG = logging.getLogger("tvm_einweld.progress")

# A measured rewrite is kept only when it is this much faster than the original in all but
# one of alternating rounds (`tir_passes.measure.compare_modules`): timings of one subprogram
# on a shared machine differ by a few percent.
MIN_MEASURED_GAIN = 1.05
# The verification note of a rewrite that measured no faster: it is not used, so not checked.
NOT_FASTER = "not checked: not faster when measured"


@tvm.transform.module_pass(opt_level=0, name="DerivationTransform")
class DerivationTransform:
    """Rewrites operators of every Relax function into cheaper, verified equivalent programs
    found by derivation search (EinNet); see the module docstring for what and why.

    Parameters: `max_depth`, `max_states`, `time_limit_s` (per operator) and `seed` bound the
    search; `search_budget_s` is the search time of a whole module, split over its distinct
    operators by FLOPs, each getting between `min_search_s` and `time_limit_s`
    (`_search_limits`; the defaults, 1 s and 10 s, found the same derivations as 2 s and 20 s
    on ResNet-18, GCN, InfoGAN, FSRCNN and DCGAN, whose searches hit their time limit after
    75-140 states, and cut the derivation stage by 20-35 %; the remaining differences were
    choices between candidates within the timing noise); operators computing the same function
    of their arguments share one search, and one whose search found nothing cheaper is recorded
    in the decision cache (`machine.cached`, keyed by its computation, the target, these
    settings and the package version) and not searched again, so its next compile repeats the
    decision; `rules` / `targets` override the rule set (`registry.default_rules`) and the
    converging targets; `target` (a `tvm.target.Target`, or the string or dict one is made
    from) is where candidates are timed and verified; `min_speedup` is the estimated gain a
    rewrite needs (0 applies the cheapest alternative whatever it costs, for testing);
    `max_instantiations` caps derived candidates per operator; `providers` enables the numpy
    GEMM provider (a Python callback; off by default); `log` is a JSON-lines path or a list
    receiving one record per subprogram; `confirm_by_measurement` times a verified rewrite
    against the original subprogram and drops it unless it is `MIN_MEASURED_GAIN` faster (the
    eOperator estimate is a lower bound for kernels that run below memory bandwidth); the
    `measured_attempts` cheapest rewrites by estimate are each verified and timed, and the
    fastest is kept. `measure=False` times nothing: operators are costed by the roofline at the
    target's nominal peaks (`cost_model`), no rewrite is confirmed by timing, and the search is
    bounded by states and depth only (not by `time_limit_s`, which ends a search at a point
    that depends on the machine's speed and load), so the same module always gets the same
    rewrites. `check_whole=False` leaves the check of the whole returned module to the caller
    (the einweld pipeline checks its final module whole). Computations holding less than
    `min_flop_share` of the module's summation FLOPs are not searched (`_minor_signatures`).
    `winograd=False` leaves out the Winograd candidates of stride-1 convolutions
    (`winograd.py`).
    """

    def __init__(self, max_depth: int = 7, max_states: int = 400, time_limit_s: float = 1.0,
                 seed: int = 0, rules: Optional[Sequence[Rule]] = None,
                 targets: Optional[Mapping[str, Distance]] = None,
                 target: Union[str, dict, Target] = "llvm",
                 min_speedup: float = 1.1, max_instantiations: int = 8,
                 providers: bool = False, verify_trials: int = 2,
                 log: Union[None, str, Path, list] = None,
                 confirm_by_measurement: bool = True, measured_attempts: int = 3,
                 measure: bool = True, search_budget_s: float = 10.0,
                 min_search_s: float = 0.25, check_whole: bool = True,
                 min_flop_share: float = 0.01, winograd: bool = True) -> None:
        self.winograd = winograd
        self.budget = Budget(max_depth=max_depth, max_states=max_states,
                             time_limit_s=time_limit_s if measure else float("inf"), seed=seed)
        self.search_budget_s = search_budget_s
        self.min_search_s = min(min_search_s, time_limit_s)
        self._limits: Dict[tuple, float] = {}  # search seconds per operator signature
        self.min_flop_share = min_flop_share
        self._minor: Dict[tuple, float] = {}  # signature -> FLOP share, for those not searched
        self.measure = measure
        self.target = target if isinstance(target, Target) else Target(target)
        self.peaks = peaks_for(self.target, measure)
        self.rules = rules
        self.targets = targets
        self.min_speedup = min_speedup
        self.max_instantiations = max_instantiations
        self.providers = providers
        self.verify_trials = verify_trials
        self.log = log
        self.confirm_by_measurement = confirm_by_measurement and measure
        self.measured_attempts = max(1, measured_attempts)
        self.last_results: Tuple[SubprogramResult, ...] = ()
        self.check_whole = check_whole
        self.checks: list = []  # the whole-module check of the last run (verify.module_check)
        # Search outcomes of this pass object by operator signature (`_op_signature`), and the
        # signatures whose "no winner" decision was written to the decision cache.
        self._searched: Dict[tuple, tuple] = {}
        self._recorded: set = set()

    def transform_module(self, mod: tvm.IRModule, ctx: Optional[tvm.transform.PassContext] = None
                         ) -> tvm.IRModule:
        """The pass entry point: `analyse` with the rewrites applied, logged, and the result
        checked whole against `mod` (`verify.module_check.checked`)."""
        from ..verify.module_check import checked

        new_mod, results = self.analyse(mod, apply=True)
        self.last_results = results
        self._write_log(results)
        # Each subprogram was checked alone; the module that is returned is checked whole
        # (unless the caller checks a later module whole: the einweld pipeline).
        self.checks = []
        if not self.check_whole:
            return new_mod
        return checked("DerivationTransform", mod, new_mod, self.target, self.checks)

    def analyse(self, mod: tvm.IRModule, apply: bool = True
                ) -> Tuple[tvm.IRModule, Tuple[SubprogramResult, ...]]:
        """Search, cost and verify every subprogram; return the rewritten module (the input
        unchanged when nothing was applied or `apply` is False) and the per-subprogram results."""
        results: List[SubprogramResult] = []
        out = mod
        device = tvm.device(self.target.get_target_device_type(), 0)
        if not device.exist:
            warnings.warn(f"DerivationTransform: no {self.target.kind.name} device on this machine to time "
                          f"and verify candidates on; the module is left unchanged")
            return mod, ()
        splits = split_module(mod)
        total = sum(len(split.subprograms) for split in splits.values())
        every_op = [op for split in splits.values() for sub in split.subprograms for op in sub.ops]
        self._minor = self._minor_signatures(every_op)
        self._limits = self._search_limits(every_op, self._minor)
        for fname, split in splits.items():
            replacements: Dict[relax.Var, Callable] = {}
            for sub in split.subprograms:
                start, outcome = time.perf_counter(), ""
                try:
                    res = self.optimise_subprogram(sub)
                except Exception as err:  # an optimisation must never break the user's build
                    res = unchanged_result(sub, f"not optimised: {type(err).__name__}: {err}")
                    outcome = f": {res.verification}"
                results.append(res)
                # Progress (logger "tvm_einweld.progress": the CLI shows it on stderr).
                _LOG.info("subprogram %d/%d %s#%d (%s): %.1f s%s", len(results), total,
                          sub.function, sub.index, ", ".join(sub.kinds),
                          time.perf_counter() - start, outcome)
                if res.applied:
                    for o in res.ops:
                        if o.chosen is not o.original:
                            replacements[o.op.var] = _bound(o.chosen.emit, sub)
            if apply and replacements:
                out = rebuild_function(out, fname, replacements)
        if out is not mod:
            out = relax.transform.FoldConstant()(out)
        return out, tuple(results)

    def optimise_subprogram(self, sub: Subprogram) -> SubprogramResult:
        """Choose, verify and (with `confirm_by_measurement`) time the rewrite of `sub`.
        eOperator times are estimates, so the estimate's favourite is not always the fastest
        in fact: the `measured_attempts` cheapest rewrites by estimate are each verified and
        timed, and the fastest one that beats the original is kept."""
        ops = self.merge_pairs(sub, [self.optimise_op(op) for op in sub.ops])
        result = best = self._try_rewrite(sub, ops)
        for _ in range(self.measured_attempts - 1):
            if result.measured_after_s is None or \
                    (not result.verified and result.verification != NOT_FASTER):
                break  # rejected by verification, or nothing measured: no more attempts
            ops = tuple(self._next_choice(o) for o in result.ops)
            if all(o.chosen is o.original for o in ops):
                break
            result = self._try_rewrite(sub, ops)
            if result.applied and (not best.applied or
                                   result.measured_after_s < best.measured_after_s):
                best = result
        return best if best.applied else result

    def _next_choice(self, o: OpResult) -> OpResult:
        """`o` with the cheapest candidate not timed yet chosen (or the original)."""
        untried = tuple(c for c in o.candidates
                        if c is o.original or all(c is not t for t in o.tried))
        return replace(o, chosen=self.choose(untried))

    def _try_rewrite(self, sub: Subprogram, ops: Tuple[OpResult, ...]) -> SubprogramResult:
        """`sub` with the chosen candidates of `ops`, verified and (with
        `confirm_by_measurement`) timed against the original: applied, or rejected with why."""
        if all(o.chosen is o.original for o in ops):
            return SubprogramResult(sub, ops, False, True, "original kept (cheapest)")
        before = subprogram_module(sub.ops)
        after = subprogram_module(sub.ops, [o.chosen.emit for o in ops])
        before_s = after_s = None
        if self.confirm_by_measurement:
            # eOperator times are estimates; the rewrite must also be faster when measured, by
            # a margin (MIN_MEASURED_GAIN) in nearly every one of alternating rounds, so that a
            # difference inside the timing noise keeps the original; the verdict is cached.
            # Timed before it is checked: a rewrite that is not faster is never used, so its
            # check (running the original's unscheduled kernels) would only cost compile time.
            from .op_cost import measured_comparison

            shapes = (subprogram_module(sub.ops, constants_as_params=True),
                      subprogram_module(sub.ops, [o.chosen.emit for o in ops],
                                        constants_as_params=True))
            verdict = measured_comparison(before, after, self.target, MIN_MEASURED_GAIN, shapes)
            before_s, after_s = verdict.before, verdict.after
            ops = tuple(o if o.chosen is o.original else replace(o, tried=o.tried + (o.chosen,))
                        for o in ops)
            if not verdict.faster:
                note = (f"rewrite not applied: {verdict.describe()} needed "
                        f"(estimated {sum(o.chosen.seconds for o in ops):.3g} s; "
                        f"{' + '.join(n for o in ops for n in o.chosen.ops)})")
                kept = tuple(replace(o, chosen=o.original, notes=o.notes + (note,))
                             for o in ops)
                return SubprogramResult(sub, kept, False, False, NOT_FASTER, before_s, after_s)
        unproven = [str(p) for o in ops for p in o.chosen.proofs if not p.proven]
        try:
            test = self._check_rewrite(sub, ops)
            ok, evidence = test.equal and not unproven, str(test)
        except Exception as err:  # a candidate that does not even build is not applied
            ok, evidence = False, f"verification could not run: {type(err).__name__}: {err}"
        if unproven:
            evidence += "; unproven side conditions: " + "; ".join(unproven)
        if not ok:
            kept = tuple(replace(o, chosen=o.original,
                                 notes=o.notes + (f"rewrite rejected: {evidence}",))
                         for o in ops)
            return SubprogramResult(sub, kept, False, False, evidence, before_s, after_s)
        return SubprogramResult(sub, ops, True, True, evidence, before_s, after_s)

    def _check_rewrite(self, sub: Subprogram, ops: Tuple[OpResult, ...]):
        """The rewritten subprogram against the original, with its weights as parameters:
        drawn at random (a permutation of uniform or repeated weights is invisible with the
        model's own values) and, as one more input set, the model's own constants with
        random activations (the values the rewrite will really see)."""
        from ..verify.module_check import InputSet
        from ..verify.inputs import random_array

        before = subprogram_module(sub.ops, constants_as_params=True)
        after = subprogram_module(sub.ops, [o.chosen.emit for o in ops],
                                  constants_as_params=True)
        rng = np.random.default_rng(self.budget.seed)
        own = tuple(arg.value.numpy() if isinstance(arg, Constant) else
                    random_array(rng, static_shape(arg.ty), str(arg.ty.dtype))
                    for arg in subprogram_inputs(sub.ops, constants_as_params=True))
        return compare_relax(after, before, trials=self.verify_trials, target=self.target,
                             extra_inputs=[InputSet("own constants", own)])

    def optimise_op(self, op: OpNode) -> OpResult:
        """The candidates of one operator (the original first; see the module docstring, step
        2) with their costs, and the cheapest by `choose`."""
        notes: List[str] = []
        # The original is costed by the roofline until there is something to choose between:
        # timing it (a build and ~0.4 s) decides nothing when no alternative is found, and
        # most operators have none (GCN: 20 of 31 convolutions, ~8 s of a cold compile).
        candidates = [self._program("original", op, original_emit(op), timed=False)]
        if self.providers and op.kind == "relax.matmul" and \
                self.target.kind.name == "llvm" and \
                numpy_gemm.supports(*op.args):
            candidates.append(self._program("numpy_gemm", op, gemm_emit(op)))
        if not op.expr.sums:
            # No summation: an element-wise or layout operator is memory-bound as it stands;
            # derivations (EinNet §4) gain on reductions, so the search is not run for it.
            return OpResult(op, tuple(candidates), candidates[0], None,
                            ("no summation: nothing to derive",))
        signature = _op_signature(op)
        if signature in self._minor:
            return OpResult(op, tuple(candidates), candidates[0], None,
                            (f"not searched: {self._minor[signature]:.2%} of the module's "
                             f"FLOPs (below min_flop_share {self.min_flop_share:g}: a "
                             "derivation could save no more than that)",))
        disk_key = self._decision_key(signature)
        if signature in self._searched:
            # The same computation on other tensors (a repeated layer): its derived candidates
            # are this operator's with the tensor names translated, so it is not searched again.
            first, derived, stats, found_notes, best = self._searched[signature]
            candidates += [replace(p, emit=_renamed_emit(p.emit, first.names, op.names))
                           for p in derived]
            notes += list(found_notes) + [f"search shared with {first.var.name} (same "
                                          f"computation, other tensors)"]
        elif disk_key is not None and machine.cached_value(disk_key) == _NO_WINNER:
            return OpResult(op, tuple(candidates), candidates[0], None,
                            ("search skipped: a compile before found no derived candidate "
                             f"{self.min_speedup:g}x cheaper than this operator (decision "
                             "cache)",))
        else:
            derived, stats, best, found_notes = self._search_op(op, signature)
            self._searched[signature] = (op, tuple(derived), stats, tuple(found_notes), best)
            candidates += derived
            notes += found_notes
        candidates += self._winograd(op)
        if len(candidates) > 1:
            candidates = self._timed_original(op, candidates)
        chosen = self.choose(candidates)
        if chosen is candidates[0] and disk_key is not None and \
                signature not in self._recorded:
            # The search's outcome cannot change the program: record it so that the next
            # compile of this computation skips the search (and repeats this decision).
            self._recorded.add(signature)
            machine.cached(disk_key, lambda: _NO_WINNER)
        return OpResult(op, tuple(candidates), chosen, stats, tuple(notes), best)

    def _minor_signatures(self, ops: Sequence[OpNode]) -> Dict[tuple, float]:
        """{signature: FLOP share} of the computations with summations whose instances together
        hold less than `min_flop_share` of the module's summation FLOPs: a derivation saves at
        most such an operator's own time, so it is not searched (Amdahl; GCN: 14 of its 31
        convolutions, 3.5 % of its FLOPs, each costing a search and a timing). FLOPs are
        static, so what is skipped does not depend on the machine."""
        totals: Dict[tuple, float] = {}
        for op in ops:
            if op.expr.sums:
                signature = _op_signature(op)
                totals[signature] = totals.get(signature, 0.0) + float(flops(op.expr))
        whole = sum(totals.values())
        if whole <= 0:
            return {}
        return {s: f / whole for s, f in totals.items() if f / whole < self.min_flop_share}

    def _search_limits(self, ops: Sequence[OpNode], skipped: Mapping[tuple, float]
                       ) -> Dict[tuple, float]:
        """Seconds of search per distinct operator signature with summations: the module's
        `search_budget_s` split in proportion to their FLOPs (a derived program saves at most
        the operator's own time, which grows with them), each share within [`min_search_s`,
        `time_limit_s`]; shares above the per-operator limit go to the others
        (water-filling). Operators the decision cache has decided keep their share unused, so
        an operator searched again gets the time it got in the first compile (and, up to the
        machine's speed, the same outcome). The `skipped` signatures (`_minor_signatures`) get
        no share. Empty when the search is bounded by states alone (`measure=False`): there,
        time plays no part."""
        if not math.isfinite(self.budget.time_limit_s):
            return {}
        weights: Dict[tuple, float] = {}
        for op in ops:
            if not op.expr.sums:
                continue
            signature = _op_signature(op)  # a canonical expression: built once per operator
            if signature not in skipped:
                weights.setdefault(signature, float(max(1, flops(op.expr))))
        limits: Dict[tuple, float] = {}
        budget, open_ = self.search_budget_s, dict(weights)
        while open_:
            total = sum(open_.values())
            capped = {s for s, w in open_.items()
                      if budget * w / total >= self.budget.time_limit_s}
            if not capped:
                for s, w in open_.items():
                    limits[s] = max(self.min_search_s, budget * w / total)
                break
            for s in capped:
                limits[s] = self.budget.time_limit_s
                budget -= self.budget.time_limit_s
                del open_[s]
        return limits

    def _search_op(self, op: OpNode, signature: tuple):
        """(derived candidates, search statistics, best state per depth, notes) of `op`,
        searched for its share of the module's budget (`_search_limits`)."""
        notes: List[str] = []
        stats, best, derived = None, (), []
        try:
            result = self.search(op.expr, self._limits.get(signature))
            stats = result.stats
            best = tuple((s.depth, roofline_seconds(s.expr, self.peaks), s.rules)
                         for s in result.best_per_depth if s is not None)
            notes += [f"rule error: {e}" for e in stats.rule_errors[:3]]
            derived = self._derived(op, result, notes)
        except Exception as err:  # the search is an optimisation: failing it keeps the op
            notes.append(f"search failed: {type(err).__name__}: {err}")
        return derived, stats, best, notes

    def _decision_key(self, signature) -> Optional[str]:
        """The decision-cache key of an operator's search outcome: the package version (rules
        and kernels change with the code), the target, every setting the outcome depends on,
        and the operator's computation with canonical tensor names; None when a user-given
        rule set or target set makes the outcome unnameable."""
        if self.rules is not None or self.targets is not None:
            return None
        expr, constant = signature
        b = self.budget
        settings = (f"depth {b.max_depth} states {b.max_states} limit {b.time_limit_s:g} "
                    f"budget {self.search_budget_s:g} min {self.min_search_s:g} "
                    f"seed {b.seed} speedup {self.min_speedup:g} inst "
                    f"{self.max_instantiations} providers {self.providers} "
                    f"measure {self.measure} winograd {self.winograd}")
        digest = hashlib.blake2b(repr(expr).encode(), digest_size=16).hexdigest()
        return (f"{machine.code_version()}|{self.target}|derivation search|{settings}|"
                f"{digest}|{''.join('c' if c else 'v' for c in constant)}")

    def choose(self, candidates: Sequence[Program]) -> Program:
        """The cheapest candidate whose estimated speedup over the original (candidates[0])
        exceeds `min_speedup`; the original when there is none (`min_speedup=0` takes the
        cheapest alternative whatever its cost: used to exercise the rewrite path)."""
        original = candidates[0]
        faster = [c for c in candidates[1:] if c.seconds * self.min_speedup < original.seconds]
        return min(faster, key=lambda c: c.seconds) if faster else original

    def merge_pairs(self, sub: Subprogram, ops: List[OpResult]) -> Tuple[OpResult, ...]:
        """Inter-expression merging (EinNet §4.2, Algorithm 1 line 11): two operators that
        compute the same thing on one shared input become one operator on concatenated
        inputs, when that is cheaper than their current choices."""
        from .derivation import RuleNotApplicable
        from .inter_expression import merge_expressions

        merged_away: set = set()
        for i, j in ((i, j) for i in range(len(ops)) for j in range(i + 1, len(ops))):
            if i in merged_away or j in merged_away:
                continue
            a, b = ops[i], ops[j]
            later = {op.var for op in sub.ops[i:]}
            if any(arg in later for arg in b.op.args):
                continue  # b's inputs are not all available where a is computed
            try:
                merged = merge_expressions(a.op.expr, b.op.expr)
            except (RuleNotApplicable, ValueError):
                continue  # not two computations differing in one input
            ops[i] = a = self._with_timed_original(a)  # the merge is held against them
            ops[j] = b = self._with_timed_original(b)
            try:
                emit_a, emit_b = merged_emits(merged, self._providers)
                mod = subprogram_module((a.op, b.op), [emit_a, emit_b])
                kernels = program_kernels(mod, self.target, self.peaks)
            except Exception as err:  # not instantiable (yet): not a candidate
                ops[i] = replace(a, notes=a.notes + (f"merge with {b.op.var.name} not "
                                                     f"instantiated: {type(err).__name__}: {err}",))
                continue
            rules, steps = (merged.rule,), (merged.description,)
            program = Program("merged", kernels, emit_a, rules, steps, merged.proofs)
            partner = Program("merged", (), emit_b)
            original = a.original.seconds + b.original.seconds
            current = a.chosen.seconds + b.chosen.seconds
            take = program.seconds * self.min_speedup < original and \
                (program.seconds < current or self.min_speedup == 0)
            ops[i] = replace(a, candidates=a.candidates + (program,),
                             chosen=program if take else a.chosen)
            if take:
                ops[j] = replace(b, chosen=partner)
                merged_away |= {i, j}
        return tuple(ops)

    @property
    def _providers(self) -> Providers:
        """The target on which instantiated matmuls pick the faster provider, or None."""
        llvm = self.target.kind.name == "llvm"
        return self.target if self.providers and llvm else None

    def search(self, expr: Expr, time_limit_s: Optional[float] = None) -> SearchResult:
        """The distance-guided search from `expr` with the pass's rules, targets and budget
        (its time limit replaced by `time_limit_s` when given), states ranked by their
        roofline estimate."""
        rules = self.rules if self.rules is not None else default_rules()
        targets = self.targets if self.targets is not None else default_targets()
        # The measured peaks are looked up (on a machine's first compile: measured, ~2 s)
        # before the search's clock starts, not inside its first state.
        rank = functools.partial(roofline_seconds, peaks=self.peaks or measured_peaks())
        budget = self.budget if time_limit_s is None else \
            replace(self.budget, time_limit_s=time_limit_s)
        return distance_guided_search(expr, rules, targets, budget, rank=rank, cost=rank)

    def _timed_original(self, op: OpNode, candidates: Sequence[Program]) -> List[Program]:
        """`candidates` with the original (first, costed with `timed=False`) timed, for a
        choice between it and others (`time_call` caches: timing it twice costs nothing)."""
        if self.peaks is not None:
            return list(candidates)
        return [self._program("original", op, candidates[0].emit)] + list(candidates[1:])

    def _with_timed_original(self, o: OpResult) -> OpResult:
        candidates = self._timed_original(o.op, o.candidates)
        return replace(o, candidates=tuple(candidates),
                       chosen=candidates[0] if o.chosen is o.original else o.chosen)

    def _program(self, label: str, op: OpNode, emit: Emit, state: Optional[State] = None,
                 timed: bool = True, module: Optional[tvm.IRModule] = None) -> Program:
        """`emit` of `op` (as `module`, when already built) as a costed candidate: its
        operators timed on the target (`timed` False, or `measure=False`: estimated by the
        roofline at the target's peaks)."""
        peaks = self.peaks if timed or self.peaks is not None else measured_peaks()
        module = module if module is not None else subprogram_module((op,), [emit])
        kernels = program_kernels(module, self.target, peaks)
        if state is None:
            return Program(label, kernels, emit)
        steps = state.derivations
        return Program(label, kernels, emit, state.rules, tuple(str(d) for d in steps),
                       tuple(p for d in steps for p in d.proofs))

    def _winograd(self, op: OpNode) -> List[Program]:
        """The Winograd forms of a stride-1 convolution (`winograd.py`): a batched matmul
        between two transform eOperators, its identity proven exactly; costed, timed and
        checked like every other candidate."""
        if not self.winograd or self.target.kind.name != "llvm":
            return []  # (the transforms are CPU kernels)
        programs = []
        for plan in winograd.plans(op.call, self.target, self.peaks or measured_peaks()):
            program = self._program("winograd", op, winograd_emit(op, plan))
            programs.append(replace(program, rules=("winograd",),
                                    steps=(f"Winograd {plan.alg.name}",),
                                    proofs=(winograd.identity_proof(plan.alg),)))
        return programs

    def _derived(self, op: OpNode, result: SearchResult, notes: List[str]) -> List[Program]:
        """Instantiate the matched states first, then explored ones, up to the cap. Their
        operators, and the original's, are built together and timed in one batch
        (`op_cost.time_calls`: code generation in parallel threads)."""
        ordered = [s for s in [m.state for m in result.matches] + list(result.states)
                   if s.depth > 0]
        instantiated = []
        tried: List[Expr] = []
        for state in ordered:
            if len(tried) >= self.max_instantiations:
                break
            if any(structurally_equal(state.expr, t) for t in tried):
                continue
            tried.append(state.expr)
            try:
                emit = derived_emit(state.expr, self._providers)
                instantiated.append((state, emit, subprogram_module((op,), [emit])))
            except Exception as err:  # not instantiable (yet): not a candidate
                notes.append(self._not_instantiated(state, err))
        if instantiated and self.peaks is None:
            try:
                time_calls([m for _, _, m in instantiated] +
                           [subprogram_module((op,), [original_emit(op)])], self.target)
            except Exception:  # pylint: disable=broad-except  # each is timed alone below
                pass
        out: List[Program] = []
        for state, emit, module in instantiated:
            try:
                out.append(self._program("derived", op, emit, state, module=module))
            except Exception as err:  # not instantiable (yet): not a candidate
                notes.append(self._not_instantiated(state, err))
        return out

    @staticmethod
    def _not_instantiated(state: State, err: Exception) -> str:
        return (f"state {' > '.join(state.rules)} not instantiated: "
                f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")

    def _write_log(self, results: Sequence[SubprogramResult]) -> None:
        if self.log is None and not active_logs():
            return
        write_records([r.to_json(detail=True) for r in results], self.log)


_NO_WINNER = "no derived candidate wins"


def _op_signature(op: OpNode) -> Tuple[Expr, Tuple[bool, ...]]:
    """What an operator's search outcome depends on: its canonical expression with its tensors
    named by argument position (the first position that reads a value names it, so an
    operator reading one value twice keeps that), and which arguments are constants (a
    kernel reading only constants is free: FoldConstant evaluates it at compile time). Two
    operators with equal signatures compute the same function of their arguments, so a
    derived program of one is one of the other with the tensor names translated."""
    first: Dict[str, str] = {}
    for k, name in enumerate(op.names):
        first.setdefault(name, f"in{k}")
    expr = expr_of_call(op.call, [first[n] for n in op.names])
    return expr, tuple(isinstance(a, Constant) for a in op.args)


def _renamed_emit(emit: Emit, names: Sequence[str], new_names: Sequence[str]) -> Emit:
    """`emit` (which reads the values of tensors `names`) reading the values of `new_names`
    instead, position by position."""
    mapping = dict(zip(names, new_names))

    def renamed(bb: relax.BlockBuilder, values: Mapping[str, relax.Expr]) -> relax.Expr:
        return emit(bb, {**values, **{old: values[new] for old, new in mapping.items()}})

    return renamed


def _bound(emit: Emit, sub: Subprogram) -> Callable[[relax.BlockBuilder], relax.Expr]:
    """An emitter for `rebuild_function`: `emit` applied to the subprogram's own values (the
    original variables stay bound, so they are valid where the replacement is emitted)."""
    values = {n: a for op in sub.ops for n, a in zip(op.names, op.args)}
    return lambda bb: emit(bb, values)


__all__ = ["DerivationTransform", "MIN_MEASURED_GAIN"]
