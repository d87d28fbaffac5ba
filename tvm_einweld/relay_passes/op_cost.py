"""Cost of candidate programs (EinNet §6.1, "delayed code generation").

* A predefined operator (any Relax call: conv2d, matmul, a `call_dps_packed` provider, ...) is
  timed on the target: compiled once alone in a function as the pipeline builds kernels, run
  in a few rounds, the fastest kept (`machine.fastest`); with `measure=False` it is
  estimated by the roofline at nominal peaks instead (`estimate_call`). Times are cached on
  disk under `machine.cache_dir()`, keyed by operator, argument shapes/dtypes, attributes and
  target, so each distinct call is measured once per machine. A predefined operator that is
  memory-bound by its legalised kernels (a reshape, an add, a transpose) is costed like an
  eOperator, from its bytes, not timed: one model for every memory-bound kernel of a
  candidate, so a derived program's eOperators and its layout operators are held to the
  same measure (timing them cost a build each, ~0.13 s, for kernels of a few microseconds:
  43 of GCN's 132 derivation measurements).
* An eOperator is estimated, not compiled: bytes moved / the copy bandwidth (this machine's
  measured one, `cost_model.measured_peaks`, or the nominal one of `measure=False`).
  eOperators are memory-bound by construction (EinNet only makes expressions of arithmetic
  intensity below 4 into eOperators, `EOP_MAX_INTENSITY`), so traffic is what their time is
  made of. Unlike the published EinNet, which counts them as free, they are charged here.
* A program's cost is the sum of its kernels' times, eOperators included
  (`program_kernels` lists the kernels of a candidate's module with their times).

Memory-bound: arithmetic intensity and the memory-bound test are defined once, in
`cost_model` (FLOPs per byte of compulsory traffic; 2 FLOPs per point of a summation, 1 per
point otherwise; below 1 FLOP/byte, EinNet §5's 4 FLOPs per float32 element, is memory-bound).
Below it, time is traffic: that is why an eOperator may be costed from bytes moved, and why
only compute-bound expressions are worth matching to a predefined operator. This module only
reads the FLOPs and bytes off what is in hand, so that one kernel scores the same whichever
form it is seen in:

* `arithmetic_intensity` / `is_memory_bound`, of an expression (a level of `levels`, for the
  roofline and the search's distance; nested scopes are written and read back once);
* `kernel_intensity`, of an expression about to be instantiated as one kernel
  (`instantiate.Instantiator`): its top level, scopes read as the tensors they materialise;
* `call_tir_intensity` / `is_memory_bound_call`, of an instantiated eOperator (a PrimFunc
  called by `call_tir`, FLOPs counted over its blocks, `kernel_flops`); an eOperator that is
  not memory-bound by it has no bandwidth estimate (`program_kernels` refuses it: EinNet maps
  compute-bound expressions to predefined operators or not at all).
"""
from __future__ import annotations

import math
import re
from functools import lru_cache
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import machine
from ..cost_model import (MEMORY_BOUND_INTENSITY, Peaks, intensity, measured_peaks,
                          memory_bound, point_flops)
from ..machine import best_seconds
from ..expr import index as ix
from ..expr.expression import (
    Access, Expr, Scope, Tensor, input_tensors, map_accesses, scopes,
)

EOP_MAX_INTENSITY = MEMORY_BOUND_INTENSITY  # instantiation's default threshold, FLOPs per byte


@dataclass(frozen=True)
class Kernel:
    """One kernel of a candidate program and its (measured or estimated) time.

    `name` is the Relax operator ("relax.nn.conv2d"), the packed provider
    ("tvm_einweld.numpy_gemm") or "eop:<Name>" for an eOperator; `measured` says whether
    `seconds` was timed (predefined operators) or estimated from traffic (eOperators).
    """

    name: str
    seconds: float
    measured: bool

    @property
    def is_eop(self) -> bool:
        return self.name.startswith("eop:")


def program_seconds(kernels: Sequence[Kernel]) -> float:
    """Total estimated time of a program: the sum over its kernels, eOperators included."""
    return float(sum(k.seconds for k in kernels))


# --- eOperators --------------------------------------------------------------------------

def _nbytes(shape: Sequence[int], dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def bytes_moved(expr: Expr) -> int:
    """Bytes an eOperator reads and writes: every input tensor once, the output once, and
    every nested scope written and read back once (lowering materialises scopes)."""
    total = sum(_nbytes(t.shape, t.dtype) for t in input_tensors(expr).values())
    total += _nbytes(expr.shape, expr.dtype)
    total += sum(2 * _nbytes(s.shape, s.dtype) for s in set(scopes(expr)))
    return total


def flops(expr: Expr) -> int:
    """FLOPs of an expression by `cost_model.point_flops` (2 per point of a summation, 1 per
    point otherwise), summed over it and its scopes."""
    def level(e: Expr) -> int:
        return point_flops(math.prod(it.extent for it in e.iterators), bool(e.sums))

    return level(expr) + sum(level(s.expr) for s in set(scopes(expr)))


@lru_cache(maxsize=65536)
def arithmetic_intensity(expr: Expr) -> float:
    """`cost_model.intensity` of an expression: `flops` per byte of `bytes_moved`."""
    return intensity(flops(expr), bytes_moved(expr))


def is_memory_bound(expr: Expr) -> bool:
    """`cost_model.memory_bound` of an expression (`flops`, `bytes_moved`)."""
    return memory_bound(flops(expr), bytes_moved(expr))


def kernel_intensity(expr: Expr) -> float:
    """The intensity of `expr` instantiated as one kernel, what instantiation decides on: that
    of its top level, which reads the scopes as the tensors they materialise (`levels`)."""
    return arithmetic_intensity(levels(expr)[-1])


def eop_seconds(expr: Expr, peaks: Optional[Peaks] = None) -> float:
    """Estimated time of `expr` as an eOperator: bytes moved / copy bandwidth."""
    return eop_seconds_from_bytes(bytes_moved(expr), peaks)


def eop_seconds_from_bytes(nbytes: int, peaks: Optional[Peaks] = None) -> float:
    """Estimated time of a memory-bound kernel that reads and writes `nbytes` in all, at the
    copy bandwidth of `peaks` (None: this machine's measured one)."""
    return nbytes / (peaks or measured_peaks()).bandwidth


@lru_cache(maxsize=65536)
def levels(expr: Expr) -> Tuple[Expr, ...]:
    """The expression levels instantiation turns into kernels: every distinct scope (innermost
    first) and the top level, each reading the scopes it contains as plain tensors (a scope's
    value stored from position 0, so reads are shifted by its origin; its padding kept)."""
    placed: Dict[Scope, Tensor] = {}
    out: List[Expr] = []

    def flatten(e: Expr) -> Expr:
        def read(a: Access) -> Access:
            src = a.source
            if not isinstance(src, Scope):
                return a
            if src not in placed:
                out.append(flatten(src.expr))
                placed[src] = Tensor(f"scope{len(placed)}", src.shape, src.pad, src.dtype)
            idx = tuple(ix.sub(i, o) for i, o in zip(a.indices, src.origin))
            return Access(placed[src], idx)

        return Expr(e.traversals, e.sums, map_accesses(e.body, read), e.dtype)

    out.append(flatten(expr))
    return tuple(out)


@lru_cache(maxsize=65536)
def roofline_seconds(expr: Expr, peaks: Optional[Peaks] = None) -> float:
    """A compile-free estimate of an expression's instantiated cost, for guiding the search:
    per level, compute-bound ones at the compute peak, memory-bound ones at the copy
    bandwidth (the eOperator estimate); `peaks` None: this machine's measured figures."""
    peaks = peaks or measured_peaks()
    total = 0.0
    for level in levels(expr):
        if is_memory_bound(level):
            total += bytes_moved(level) / peaks.bandwidth
        else:
            total += flops(level) / peaks.flops
    return total


# --- predefined operators ------------------------------------------------------------------

def _describe_arg(arg) -> str:
    from tvm import relax
    from tvm.ir.expr import Constant

    if isinstance(arg, relax.ExternFunc):
        return f"extern:{arg.global_symbol}"
    if isinstance(arg, relax.Tuple):
        return "(" + ",".join(_describe_arg(f) for f in arg.fields) + ")"
    ty = getattr(arg, "ty", None)
    if isinstance(ty, relax.TensorType):
        # A constant is timed as one (its layout transform folded at compile time), a
        # variable as a run-time input: two different kernels, two keys.
        kind = "const " if isinstance(arg, Constant) else ""
        return f"{kind}{ty.dtype}{list(static_shape(ty))}"
    return str(arg)


def static_shape(ty) -> Tuple[int, ...]:
    """The shape of a Relax tensor type with static dimensions."""
    return tuple(int(v) for v in ty.shape.values)


def tensor_nbytes(ty) -> int:
    """Bytes of a Relax tensor type with static dimensions."""
    return _nbytes(static_shape(ty), str(ty.dtype))


def call_key(call, target: str) -> str:
    """Cache key: package version (its kernels change between versions), target, operator,
    argument shapes/dtypes, attributes, output type."""
    op = getattr(call.op, "name", str(call.op))
    args = ",".join(_describe_arg(a) for a in call.args)
    attrs = " ".join(str(call.attrs).split()) if call.attrs is not None else ""
    out = " ".join(str(list(call.ty_args)).split()) if len(call.ty_args) else ""
    return f"{machine.code_version()}|{target}|{op}|{args}|{attrs}|{out}"


def single_call_module(call):
    """An IRModule whose `main` computes only `call`; the variables it reads (directly or in
    a tuple, as `call_dps_packed` passes them) become parameters, constants stay constants."""
    from tvm import relax

    params: Dict[object, object] = {}

    def rebuild(arg):
        if isinstance(arg, relax.Var):
            if arg not in params:
                ty = arg.ty
                if not isinstance(ty, relax.TensorType):
                    raise NotImplementedError(f"timing a call that reads {arg.name}: {ty}")
                params[arg] = relax.Var(f"arg{len(params)}", relax.TensorType(static_shape(ty),
                                                                               ty.dtype))
            return params[arg]
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([rebuild(f) for f in arg.fields])
        return arg

    new_call = relax.Call(call.op, [rebuild(a) for a in call.args], call.attrs,
                          list(call.ty_args))
    bb = relax.BlockBuilder()
    with bb.function("main", list(params.values())):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(new_call))
        bb.emit_func_output(out)
    return bb.get()


def kernel_flops(func) -> int:
    """FLOPs of a PrimFunc by `cost_model.point_flops`: over its blocks, 2 per iteration point
    of a block with a reduction axis, 1 per point of any other; a block that reads nothing (a
    reduction's initialisation, a fill) does no arithmetic."""
    from tvm import s_tir
    from tvm_ffi import structural_walk

    total = [0]

    def visit(block) -> None:
        if len(block.iter_vars) and len(block.reads):
            points = math.prod(int(iv.dom.extent) for iv in block.iter_vars)
            total[0] += point_flops(points, any(int(iv.iter_type) != 0
                                                for iv in block.iter_vars))

    structural_walk(func, [(s_tir.SBlock, visit)])
    return total[0]


def call_bytes(inputs: Sequence, output_ty) -> int:
    """Bytes a kernel call moves: its tensor `inputs` read once, its output written once."""
    return sum(tensor_nbytes(t.ty) for t in inputs) + tensor_nbytes(output_ty)


def call_tir_intensity(func, inputs: Sequence, output_ty) -> float:
    """`cost_model.intensity` of a `call_tir` of PrimFunc `func` on `inputs` (Relax tensors)
    into a tensor of type `output_ty`: `kernel_flops` per byte of `call_bytes`."""
    return intensity(kernel_flops(func), call_bytes(inputs, output_ty))


def is_memory_bound_call(func, inputs: Sequence, output_ty) -> bool:
    """`cost_model.memory_bound` of a `call_tir` (`kernel_flops`, `call_bytes`)."""
    return memory_bound(kernel_flops(func), call_bytes(inputs, output_ty))


_CALL_WORK: Dict[str, Tuple[Optional[int], int]] = {}


def call_work(call) -> Tuple[Optional[int], int]:
    """(FLOPs, bytes in and out) of a predefined operator: its legalised PrimFuncs'
    `kernel_flops` (None when LegalizeOps makes no PrimFunc of it) and `call_bytes`. Kept
    per process by operator, shapes and attributes (`call_key`): legalising takes ~8 ms, and
    every candidate program of a compile asks again for the operators it shares."""
    import tvm
    from tvm import relax

    key = call_key(call, "")
    if key not in _CALL_WORK:
        mod = relax.transform.LegalizeOps()(single_call_module(call))
        funcs = [f for _, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
        work = sum(kernel_flops(f) for f in funcs) if funcs else None
        _CALL_WORK[key] = (work, call_bytes(_tensor_inputs(call), call.ty))
    return _CALL_WORK[key]


def estimate_call(call, peaks: Peaks) -> float:
    """A predefined operator's time by the roofline alone, nothing compiled or run: its
    FLOPs at `peaks.flops`, or its bytes in and out at `peaks.bandwidth`, whichever is
    longer (`call_work`)."""
    work, moved = call_work(call)
    return max((work or 0) / peaks.flops, moved / peaks.bandwidth)


def measure_call(call, target: str = "llvm", repeats: int = 5) -> float:
    """Seconds of `call` compiled alone for `target` and run on random inputs (its best round:
    `measure_modules`)."""
    return measure_module(single_call_module(call), target, repeats)


def measure_module(mod, target: str = "llvm", repeats: int = 5) -> float:
    """Seconds of `mod["main"]` built as the einweld pipeline builds kernels
    (`tir_passes.fusion.analytic_pipeline`) for the full `target`, on random inputs."""
    return measure_modules([mod], target, repeats)[0]


def measure_modules(mods: Sequence, target: str = "llvm", repeats: int = 5) -> List[float]:
    """`tir_passes.measure.measure_modules` (the one home of module timing)."""
    from ..tir_passes.measure import measure_modules as measure

    return measure(mods, target, repeats)


def measured_comparison(before, after, target: str = "llvm", min_ratio: float = 1.05,
                        shapes: Optional[Tuple[object, object]] = None):
    """`tir_passes.measure.compare_modules` of two modules, cached on disk by the modules'
    structural hashes, target, ratio and package version: a decision made once is made the
    same way when the same model is compiled again, whatever the machine's load then.
    `shapes`, when given, are the same two modules with their constants as parameters and key
    the verdict instead: layers equal but for their weights' values (ResNet's four 64-channel
    3x3 convolutions) share one timing, as a kernel's time does not depend on those values."""
    from tvm_ffi import structural_hash

    from ..tir_passes.measure import Comparison, compare_modules

    keyed = shapes or (before, after)
    key = (f"{machine.code_version()}|{target}|compare {min_ratio:g}|"
           f"{'shapes ' if shapes else ''}{structural_hash(keyed[0])}|{structural_hash(keyed[1])}")
    fields = machine.cached(key, lambda: list(vars(compare_modules(before, after, target,
                                                                    min_ratio)).values()))
    return Comparison(*fields)


def time_call(call, target: str = "llvm") -> float:
    """Measured seconds of one Relax call on `target`, cached in memory and on disk. A time is
    kept whatever the machine's load when it was taken: the same model must compile to the
    same program next time (on 2 cores the 1-minute load is rarely below 1).

    `call`'s tensor arguments must have static shapes (variables of a normalised function,
    or constants).
    """
    return float(machine.cached(call_key(call, target), lambda: measure_call(call, target)))


# --- programs ----------------------------------------------------------------------------

_EOP_SUFFIX = re.compile(r"[_\d]+$")


def program_kernels(mod, target, peaks: Optional[Peaks] = None) -> Tuple[Kernel, ...]:
    """The kernels of `mod["main"]` with their times: operators and providers timed (with
    `peaks`, the nominal figures of `measure=False`: estimated by the roofline instead),
    eOperators (`call_tir`) estimated from bytes moved, and kernels whose inputs are all
    constants free (FoldConstant evaluates them at compile time)."""
    kernels: List[Kernel] = []
    for name, call, cost in _costed_calls(mod, peaks):
        if cost is None:
            kernels.append(Kernel(name, time_call(call, target), True))
        else:
            kernels.append(Kernel(name, cost, False))
    return tuple(kernels)


def time_calls(mods: Sequence, target) -> None:
    """Time, all at once, every call that `program_kernels` of these modules would time and
    that is not cached yet: their builds together (code generation in parallel threads,
    `parallel_build`), their timings in alternating rounds; each time is then cached as
    `time_call` caches it, so the `program_kernels` that follow find them. A module whose
    kernels cannot be costed is skipped here (`program_kernels` says why)."""
    calls: Dict[str, object] = {}
    for mod in mods:
        try:
            timed = [call for _, call, cost in _costed_calls(mod, None) if cost is None]
        except NotImplementedError:
            continue
        calls.update((call_key(call, target), call) for call in timed)
    machine.cached_all(calls, lambda pending: measure_modules(
        [single_call_module(c) for c in pending], target))


def _costed_calls(mod, peaks: Optional[Peaks]):
    """(kernel name, call, seconds) of each operator call of `mod["main"]`, seconds None
    where the call is to be timed (see `program_kernels`); raises NotImplementedError for a
    compute-bound eOperator (no predefined operator matched it)."""
    import tvm
    from tvm import relax
    from tvm.ir.expr import Constant

    constant: set = set()
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
                continue
            tensors = _tensor_inputs(call)
            folded = all(isinstance(t, Constant) or t in constant for t in tensors)
            if folded:
                constant.add(binding.var)
            name = call.op.name
            if name == "relax.call_tir":
                label = "eop:" + _EOP_SUFFIX.sub("", call.args[0].name_hint)
                func, moved = mod[call.args[0]], call_bytes(tensors, binding.var.ty)
                eop_memory_bound = is_memory_bound_call(func, tensors, binding.var.ty)
                if not eop_memory_bound and not folded:
                    # The bandwidth estimate only holds for memory-bound kernels; EinNet maps
                    # compute-bound expressions to predefined operators or not at all.
                    score = call_tir_intensity(func, tensors, binding.var.ty)
                    raise NotImplementedError(
                        f"{label} is compute-bound ({score:.2f} FLOPs/byte); no "
                        f"predefined operator matched it")
                yield label, call, 0.0 if folded else eop_seconds_from_bytes(moved, peaks)
                continue
            if name == "relax.call_dps_packed":
                name = str(call.args[0].global_symbol)
            if folded:
                yield name, call, 0.0
            elif peaks is not None:
                yield name, call, estimate_call(call, peaks)
            else:
                work, moved = call_work(call) if name.startswith("relax.") else (None, 0)
                if work is not None and memory_bound(work, moved):
                    # Costed like an eOperator (see the module docstring), not timed.
                    yield name, call, eop_seconds_from_bytes(moved)
                else:
                    yield name, _fold_constant_args(call, constant), None


def _fold_constant_args(call, constant: set):
    """`call` with every argument in `constant` (a variable computed from constants only,
    which FoldConstant evaluates at compile time) replaced by a constant of its type, so that
    the call is timed as the pipeline will build it: with that operand's layout transform
    folded at compile time too (the GEMM and conv rules pack constant weights then). Timed
    with the variable as a run-time input instead, a Winograd form's batched matmul packed
    its 16.8 MB of transformed weights on every call: 3.4 ms where the kernel the pipeline
    emits takes 1.7 ms, so CSRNet's 512-channel convolutions kept the direct form."""
    from tvm import relax

    def fold(arg):
        if isinstance(arg, relax.Var) and arg in constant:
            return _timing_constant(static_shape(arg.ty), str(arg.ty.dtype))
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([fold(f) for f in arg.fields])
        return arg

    args = [fold(a) for a in call.args]
    if all(new.same_as(old) for new, old in zip(args, call.args)):
        return call
    return relax.Call(call.op, args, call.attrs, list(call.ty_args))


@lru_cache(maxsize=4)
def _timing_constant(shape: Tuple[int, ...], dtype: str):
    """A constant of random values standing in for a folded operand while timing (values do
    not change a kernel's time); the last few are kept for the derivation's repeated costing
    of one operator's candidates (a Winograd form's weights reach 38 MB)."""
    from tvm import relax

    from ..verify.inputs import random_array

    return relax.const(random_array(np.random.default_rng(0), shape, dtype), dtype)


def _tensor_inputs(call) -> list:
    """The tensors a Relax call reads, directly or in a tuple (as `call_dps_packed` passes
    them)."""
    from tvm import relax

    out = []
    for arg in call.args:
        if isinstance(arg, relax.Tuple):
            out += [f for f in arg.fields if isinstance(getattr(f, "ty", None), relax.TensorType)]
        elif isinstance(getattr(arg, "ty", None), relax.TensorType):
            out.append(arg)
    return out


__all__ = ["Kernel", "program_seconds", "bytes_moved", "flops", "arithmetic_intensity",
           "is_memory_bound", "eop_seconds", "eop_seconds_from_bytes",
           "measure_module", "measure_modules", "measured_comparison", "best_seconds", "call_key",
           "time_call", "time_calls", "measure_call", "static_shape", "tensor_nbytes", "single_call_module",
           "EOP_MAX_INTENSITY", "levels", "roofline_seconds", "kernel_flops", "estimate_call",
           "kernel_intensity", "call_bytes", "call_tir_intensity", "is_memory_bound_call",
           "program_kernels", "call_work"]
