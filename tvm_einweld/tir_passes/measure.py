"""Building, timing and checking kernels of a tile-graph on the target ("d.Profile" of Fig. 7).

`time_kernel` builds one PrimFunc and reports its run time; `check_group` runs a fused
kernel and the group's original PrimFuncs (TVM's own unscheduled build) on the same random inputs
and compares the outputs, so a fused kernel is only kept when it computes what the graph did. The
inputs and the comparison are verify's (`verify.inputs`, `verify.random_testing`), the ones every
other check of the package uses, so "equal" means one thing everywhere.

Every time measured here for the pipeline to compare (`time_kernel`, `time_alone`,
`measure_modules`) is the fastest of its samples (`machine.fastest`, where the choice is
argued), so a tile kernel and the analytic kernel it competes with are held to one statistic;
`compare_modules` answers a different question (is one module reliably faster than another?)
with medians of paired rounds and a sign test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import tvm
from tvm import tirx

from ..runtime_io import BUFFER_ALIGNMENT, place_aligned
from ..verify.inputs import random_array
from ..verify.random_testing import compare_arrays
from .tile_graph import SubGraph, TileGraph
from .rules import mark_scheduled


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    max_abs_err: float
    message: str


def build(func: tirx.PrimFunc, target) -> tvm.runtime.Module:
    """Compile one PrimFunc as a standalone library whose entry is `main`."""
    func = func.with_attr("global_symbol", "main")
    return tvm.compile(tvm.IRModule({"main": func}), target=target)


def _device(target) -> tvm.runtime.Device:
    kind = tvm.target.Target(target).kind.name
    return tvm.cpu() if kind == "llvm" else tvm.device(kind, 0)


def group_arrays(graph: TileGraph, sub: SubGraph, seed: int = 0) -> list[np.ndarray]:
    """One random array per input of `sub` (`verify.inputs.random_array`), the same per seed."""
    rng = np.random.default_rng(seed)
    return [random_array(rng, graph.tensors[t].shape, graph.tensors[t].dtype) for t in sub.inputs]


def time_kernel(func: tirx.PrimFunc, graph: TileGraph, sub: SubGraph, target,
                min_repeat_ms: int = 5, repeat: int = 3) -> float:
    """Seconds of one call of `func` (params: sub.inputs, then sub.output): the fastest of
    `repeat` samples, each the mean of calls looped for at least `min_repeat_ms` (TVM's
    time_evaluator). Measured once per (kernel, target, package version) and cached on disk
    (`machine.cached`), so a model compiled again makes the same tile choices."""
    from tvm_ffi import structural_hash

    from ..machine import cached, code_version, fastest

    def measure() -> float:
        lib = build(func, target)
        dev = _device(target)
        out = graph.tensors[sub.output]
        args = [tvm.runtime.tensor(a, dev) for a in group_arrays(graph, sub)]
        args.append(tvm.runtime.empty(out.shape, out.dtype, dev))
        timer = lib.mod.time_evaluator("main", dev, number=1, repeat=repeat,
                                       min_repeat_ms=int(min_repeat_ms))
        return float(fastest(timer(*args).results))

    key = f"{code_version()}|{tvm.target.Target(target)}|kernel|{structural_hash(func)}"
    return float(cached(key, measure))


def call_module(func: tirx.PrimFunc, params: list, args: list, out_ty):
    """A Relax module whose `main(*params)` is one `call_tir` of `func` on `args` (Relax
    vars among `params`, or constants) returning `out_ty` (a type or a list of them): how a
    standalone kernel is timed as the pipeline runs it."""
    from tvm import relax

    bb = relax.BlockBuilder()
    kernel = bb.add_func(func, "kernel")
    with bb.function("main", params):
        with bb.dataflow():
            result = bb.emit_output(relax.call_tir(kernel, args, out_ty))
        bb.emit_func_output(result)
    return bb.get()


def kernel_module(func: tirx.PrimFunc, constants: Sequence[int] = (), outputs: int = 1):
    """`call_module` of the standalone kernel `func`, marked scheduled as it is: the params
    numbered in `constants` bound to random constants (weights: their packing, a
    `meta_schedule.layout_rewrite_preproc` block, is then folded at compile time, not run per
    call), the others `main`'s inputs, the last `outputs` params the results."""
    from tvm import relax

    params, args = [], []
    rng = np.random.default_rng(0)
    inputs = list(func.params)[:len(func.params) - outputs]
    for k, buf in enumerate(inputs):
        shape, dtype = [int(v) for v in buf.shape], str(buf.dtype)
        if k in constants:
            args.append(relax.const(random_array(rng, shape, dtype), dtype))
        else:
            var = relax.Var(f"x{k}", relax.TensorType(shape, dtype))
            params.append(var)
            args.append(var)
    outs = [relax.TensorType([int(v) for v in b.shape], str(b.dtype))
            for b in list(func.params)[len(inputs):]]
    func = mark_scheduled(func.without_attr("global_symbol"))
    return call_module(func, params, args, outs[0] if len(outs) == 1 else outs)


def time_func(func: tirx.PrimFunc, target, constants: Sequence[int] = (), outputs: int = 1,
              repeats: int = 3) -> float:
    """Seconds of one standalone kernel (`kernel_module`, `measure_modules`): not charged for
    the packing of its constant weights."""
    return measure_modules([kernel_module(func, constants, outputs)], target, repeats)[0]


def module_rounds(mods, target, rounds: int = 5, pipeline=None, more=None,
                  max_rounds: int = 0) -> list[list[float]]:
    """Per round, the seconds of each Relax module's `main`, built as the einweld pipeline
    builds kernels (`fusion.analytic_pipeline`: analytic schedules, constant weights packed at
    compile time; a module whose kernels are already chosen, e.g. a tuned one, passes
    `relax.pipeline.default_build_pipeline()`: re-legalising and re-fusing it would re-schedule
    kernels the analytic way) and run on the same random inputs. Rounds alternate the modules (a b, b a,
    a b, ...) so that a drift of the machine's load, or the cache state one leaves behind,
    hits all alike; each sample is `machine.best_seconds` of one looped call (>= 10 ms).
    `more(samples)` True asks for another `rounds` rounds, up to `max_rounds` in all
    (`alternate`)."""
    from ..machine import best_seconds
    from ..parallel_build import compile_modules
    from .fusion import analytic_pipeline

    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    dev = tvm.device(target.get_target_device_type(), 0)
    calls = []
    vms = compile_modules(mods, target, pipeline or analytic_pipeline(target))
    for mod, vm in zip(mods, vms):
        fn = vm["main"]
        rng = np.random.default_rng(0)
        args = [tvm.runtime.tensor(random_array(rng, tuple(int(v) for v in p.ty.shape.values),
                                                str(p.ty.dtype)), dev)
                for p in mod["main"].params]
        calls.append(lambda fn=fn, args=args: fn(*args))
    return alternate(calls, rounds, lambda call: best_seconds(call, repeats=1), more,
                     max_rounds)


def alternate(calls, rounds: int, time_call, more=None, max_rounds: int = 0
              ) -> list[list[float]]:
    """`rounds` rounds of `time_call(call)` for every call, the order reversed every other
    round; then, while `more(samples so far)` is True and `max_rounds` allows, `rounds`
    more (the rounds of a paired comparison that could not decide yet)."""
    out: list[list[float]] = []
    while True:
        for _ in range(rounds):
            order = range(len(calls)) if len(out) % 2 == 0 else reversed(range(len(calls)))
            sample = [0.0] * len(calls)
            for k in order:
                sample[k] = time_call(calls[k])
            out.append(sample)
        if more is None or len(out) + rounds > max_rounds or not more(out):
            return out


def measure_modules(mods, target, repeats: int = 5) -> list[float]:
    """Seconds of each module (see `module_rounds`): the `machine.fastest` of its rounds."""
    from ..machine import fastest

    rounds = module_rounds(mods, target, repeats)
    return [fastest(r[k] for r in rounds) for k in range(len(mods))]


@dataclass(frozen=True)
class Comparison:
    """A paired timing of two modules, `before` and `after`: the medians of their rounds and
    in how many rounds `after` beat `before` by `min_ratio`. `faster` needs both: the medians
    apart by the ratio and a sign test on the rounds (were there no difference, each round a
    coin flip) at most `SIGN_TEST_ALPHA` likely by chance: 6 wins of 7 rounds, 11 of 14, 15 of
    21. So a difference within the timing noise of a busy machine keeps what was there.
    `undecided`: the medians say faster but the rounds do not (yet): at least half won."""

    before: float
    after: float
    rounds: int
    wins: int
    min_ratio: float

    @property
    def faster(self) -> bool:
        return (sign_test(self.wins, self.rounds) <= SIGN_TEST_ALPHA
                and self.after * self.min_ratio < self.before)

    @property
    def undecided(self) -> bool:
        return (not self.faster and self.after * self.min_ratio < self.before
                and 2 * self.wins >= self.rounds)

    def describe(self) -> str:
        return (f"measured {self.after:.3g} s vs {self.before:.3g} s (medians of {self.rounds} "
                f"alternating rounds), {self.wins}/{self.rounds} rounds faster by "
                f"{self.min_ratio:g}x")


def sign_test(wins: int, rounds: int) -> float:
    """The chance of at least `wins` heads in `rounds` fair coin flips (one-sided)."""
    return sum(math.comb(rounds, k) for k in range(wins, rounds + 1)) / 2 ** rounds


# A paired comparison reads "faster" at this sign-test level: 6 of 7 rounds (8/128).
SIGN_TEST_ALPHA = 8 / 128
# An undecided comparison takes more rounds, up to this many in all (7 at a time).
MAX_ROUNDS = 21


def paired(samples, min_ratio: float) -> Comparison:
    """The Comparison of (before, after) round samples."""
    wins = sum(1 for b, a in samples if a * min_ratio < b)
    return Comparison(float(np.median([b for b, _ in samples])),
                      float(np.median([a for _, a in samples])), len(samples), wins,
                      min_ratio)


def compare_modules(before, after, target, min_ratio: float, rounds: int = 7,
                    pipeline=None, max_rounds: int = MAX_ROUNDS) -> Comparison:
    """Time `before` and `after` in alternating rounds (`module_rounds`, built with `pipeline`
    when given) and compare them; while undecided (the medians say faster, the rounds not
    yet), `rounds` more, up to `max_rounds`: a real gain on a noisy machine is then kept,
    where 7 rounds alone would have thrown it away (FSRCNN tuned: 13 % faster by the medians,
    5 of 7 rounds)."""
    samples = module_rounds([before, after], target, rounds, pipeline=pipeline,
                            more=lambda s: paired(s, min_ratio).undecided,
                            max_rounds=max_rounds)
    return paired(samples, min_ratio)


def time_alone(graph: TileGraph, sub: SubGraph, target, func: tirx.PrimFunc | None = None
               ) -> float:
    """Seconds of a kernel as the pipeline builds it outside any tile group: a single node's
    PrimFunc, or `func` (a group's merged, unscheduled PrimFunc, params `sub.inputs` then the
    output), called from Relax with the graph's real constants and scheduled by the analytic
    rules with those constants packed at compile time (timing the bare scheduled PrimFunc
    would charge the packing of constant weights to every call). Cached like `time_kernel`,
    keyed by the kernel and its arguments' types and constness but not the constants' values
    (a kernel's time does not depend on its weights), so equal layers are timed once."""
    from ..machine import cached

    mod, key = _alone_module(graph, sub, target, func)
    return float(cached(key, lambda: measure_modules([mod], target, repeats=3)[0]))


def time_alone_all(graph: TileGraph, items, target) -> None:
    """`time_alone` of every (sub-graph, func) in `items` not cached yet, built together
    (code generation in parallel threads, `parallel_build`) and timed in alternating rounds;
    the times are cached, so the `time_alone` calls that follow find them."""
    from ..machine import cached_all

    modules = {}
    for sub, func in items:
        mod, key = _alone_module(graph, sub, target, func)
        modules[key] = mod
    cached_all(modules, lambda pending: measure_modules(pending, target, repeats=3))


def _alone_module(graph: TileGraph, sub: SubGraph, target, func: tirx.PrimFunc | None):
    """(module, cache key) of `time_alone`."""
    from tvm import relax
    from tvm_ffi import structural_hash

    from ..machine import code_version

    node = sub.nodes[0]
    inputs = node.inputs if func is None else sub.inputs
    params, args = [], []
    for name in inputs:
        expr = graph.exprs[name]
        if isinstance(expr, relax.Var):
            tensor = graph.tensors[name]
            var = relax.Var(name, relax.TensorType(tensor.shape, tensor.dtype))
            params.append(var)
            args.append(var)
        else:
            args.append(expr)
    out = graph.tensors[sub.output]
    mod = call_module(node.func if func is None else func, params, args,
                      relax.TensorType(out.shape, out.dtype))
    kinds = ",".join(("const" if not isinstance(graph.exprs[n], relax.Var) else "var") +
                     f"{graph.tensors[n].dtype}{list(graph.tensors[n].shape)}" for n in inputs)
    key = (f"{code_version()}|{tvm.target.Target(target)}|alone|"
           f"{structural_hash(mod['kernel'])}|{kinds}|{out.dtype}{list(out.shape)}")
    return mod, key


def run_reference(graph: TileGraph, sub: SubGraph, arrays, target="llvm") -> np.ndarray:
    """The group's output computed node by node with TVM's own build of the original funcs
    (on a CPU with `verify.reference_schedule`'s loops: bit for bit that build, faster)."""
    from ..verify.reference_schedule import schedule_reference_func

    values = dict(zip(sub.inputs, arrays))
    dev = _device(target)
    cpu = tvm.target.Target(target).kind.name == "llvm"
    for node in sub.nodes:
        lib = build(schedule_reference_func(node.func) if cpu else node.func, target)
        out = graph.tensors[node.output]
        args = [tvm.runtime.tensor(values[t], dev) for t in node.inputs]
        result = tvm.runtime.empty(out.shape, out.dtype, dev)
        lib["main"](*args, result)
        values[node.output] = result.numpy()
    return values[sub.output]


def check_group(func: tirx.PrimFunc, graph: TileGraph, sub: SubGraph, target="llvm",
                rtol: float = 1e-4, atol: float = 1e-4, seed: int = 0) -> CheckResult:
    """Run `func` and the original nodes on random inputs; compare outputs as every check of
    the package does (`verify.random_testing.compare_arrays`: normwise, non-finite values at
    the same places), floats within `rtol`/`atol`, integers exactly."""
    arrays = group_arrays(graph, sub, seed)
    try:
        expected = run_reference(graph, sub, arrays, target)
        lib = build(func, target)
        dev = _device(target)
        out = graph.tensors[sub.output]
        result = tvm.runtime.empty(out.shape, out.dtype, dev)
        lib["main"](*[tvm.runtime.tensor(a, dev) for a in arrays], result)
        got = result.numpy()
    except Exception as err:  # pylint: disable=broad-except  # any failure means "do not use"
        return CheckResult(False, float("inf"), f"check could not run: {err}")
    return _compared(got, expected, rtol, atol)


def check_parts(parts, graph: TileGraph, sub: SubGraph, rtol: float = 1e-4,
                atol: float = 1e-4, seed: int = 0) -> CheckResult:
    """`check_group` of a kernel split into `parts` (PrimFuncs that each compute some of its
    output's elements, e.g. `codegen.serial_threads` of some of a CUDA kernel's blocks), run
    on this CPU one after another, each on a fresh output filled with a byte pattern and every
    buffer between guard zones (`_guarded`).

    The kernel is equal to the graph when every output element is written by exactly one part
    and the elements so assembled equal the reference (as `check_group` compares). An element
    two parts wrote is a block writing into another's tile (only across parts: a block
    writing into the tile of another block of its own part goes unseen), which a single
    serial run hides (the owner, running later, overwrites it) and a GPU runs as a race; an
    element no part wrote is left unset; a changed guard zone is a write outside a buffer. (An output element
    that equals the pattern byte for byte counts as unwritten: a false alarm, never a pass.)
    """
    arrays = group_arrays(graph, sub, seed)
    out = graph.tensors[sub.output]
    try:
        expected = run_reference(graph, sub, arrays, "llvm")
        got = np.zeros(out.shape, out.dtype)
        written = np.zeros(out.shape, np.int64)
        for part in parts:
            lib = build(part, "llvm")
            unset = np.empty(out.shape, out.dtype)
            unset.view(np.uint8)[...] = _GUARD_BYTE
            views = [_guarded(a) for a in (*arrays, unset)]
            lib["main"](*[tvm.runtime.from_dlpack(view) for view, _ in views])
            if not all(intact() for _, intact in views):
                return CheckResult(False, float("inf"), "the kernel wrote outside its buffers")
            result = views[-1][0]
            mask = _changed(result, unset)
            got[mask] = result[mask]
            written += mask
    except Exception as err:  # pylint: disable=broad-except  # any failure means "do not use"
        return CheckResult(False, float("inf"), f"check could not run: {err}")
    if np.any(written > 1):
        return CheckResult(False, float("inf"), f"{int(np.sum(written > 1))} output elements "
                           "written by more than one part: a block writes into another's tile")
    if np.any(written == 0):
        return CheckResult(False, float("inf"),
                           f"{int(np.sum(written == 0))} output elements never written")
    return _compared(got, expected, rtol, atol)


def _compared(got: np.ndarray, expected: np.ndarray, rtol: float, atol: float) -> CheckResult:
    """A fused kernel's output against the graph's, as every check of the package compares
    (`verify.random_testing.compare_arrays`): floats within `rtol`/`atol`, integers exactly."""
    exact = got.dtype.kind != "f"
    result = compare_arrays([("output", got, expected)], str(got.dtype), "fused kernel vs graph",
                            rtol=0.0 if exact else rtol, atol=0.0 if exact else atol)
    return CheckResult(result.equal, result.max_abs_error, "ok" if result.equal else result.what)


def _changed(result: np.ndarray, unset: np.ndarray) -> np.ndarray:
    """Elements of `result` whose bytes differ from the same element of `unset`."""
    width = result.dtype.itemsize
    a = np.ascontiguousarray(result).view(np.uint8).reshape(-1, width)
    b = unset.view(np.uint8).reshape(-1, width)
    return np.any(a != b, axis=1).reshape(result.shape)


_GUARD_BYTE = 0xA5


def _guarded(array: np.ndarray):
    """(a copy of `array` inside a larger allocation, aligned as TVM's buffers are
    (`runtime_io.place_aligned`), with a guard zone of at least its own size before and after
    it; a function saying whether both guards still hold their pattern)."""
    size = max(array.nbytes, 1)
    pad = -(-size // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
    raw = np.full(2 * pad + size + BUFFER_ALIGNMENT, _GUARD_BYTE, dtype=np.uint8)
    view = place_aligned(raw, pad, array)
    start = view.ctypes.data - raw.ctypes.data
    before, after = raw[:start], raw[start + array.nbytes:]
    return view, lambda: bool(np.all(before == _GUARD_BYTE) and np.all(after == _GUARD_BYTE))


def generated_source(executable, kind: str = "cuda") -> str:
    """The source text of every `kind` module an executable of tvm.compile carries."""
    sources = []

    def walk(module):
        if module.kind == kind:
            sources.append(module.inspect_source())
        for sub in module.imports:
            walk(sub)

    walk(executable.mod)
    return "\n".join(sources)
