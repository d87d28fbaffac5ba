"""End-to-end check of a whole module against the module it replaces.

Every rewrite is checked alone where it is made (`random_testing.compare_relax` on its
subprogram), but a module is more than its parts: rewrites compose, memory planning places
their buffers, providers run inside the real module, and the module's own constants (uniform,
zero, repeated or pruned weights occur in real models) drive activations to magnitudes that
random inputs in [-1, 1] never reach. A SqueezeNet whose weights are all 0.02 has logits near
1e10, where one float32 ulp is 1024: the softmax over them is decided by rounding, so any
change of summation order between output channels changes the answer, while every rewritten
part was "equal to 1e-7". Only running the module that is returned, with its constants as
given, sees that.

`check_module(stage, before, after, target)` compiles both modules the way they will run
(`tvm.compile` for the full target: same legalisation, memory planning and providers; on a
CPU the kernels nobody scheduled get `reference_schedule`'s loops, which compute bit for bit
what the default build computes, 16x faster on BERT's layer), runs
`main` on a family of inputs — i.i.d. uniform draws, all ones, all zeros, large magnitudes
(`input_sets`) — and compares every output with the dtype's tolerance. A stage whose output
disagrees is not used: callers fall back to the module they were given and say which stage.
Compiled modules and their outputs are memoised by structural hash, so checking a chain of
stages compiles each distinct module once.
"""
from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from ..parallel_build import compile_modules
from .inputs import random_array
from .reference_schedule import reference_build_pipeline
from .random_testing import TestResult, compare_arrays, tolerance_for

Signature = Sequence[Tuple[Tuple[int, ...], str]]

# Magnitude of the "large" input set: far outside [-1, 1] (overflow, cancellation and
# approximations of transcendental functions show there) but not so far that every float32
# model overflows.
LARGE_SCALE = 100.0


@dataclass(frozen=True)
class InputSet:
    """One named set of arguments for a function (one array per parameter)."""

    name: str
    arrays: Tuple[np.ndarray, ...]


def input_sets(signature: Signature, seed: int = 0, random_draws: int = 2,
               index_bounds: Optional[Sequence[Optional[int]]] = None) -> Tuple[InputSet, ...]:
    """The inputs a module check runs: `random_draws` uniform [-1, 1] draws, then all ones,
    all zeros and uniform draws scaled by `LARGE_SCALE`. Integer parameters are indices in
    real models: they are drawn in [0, bound) (`index_bounds[k]`, default 2) and never
    scaled, since an out-of-range index reads out of bounds in TVM's `take`."""
    bounds = list(index_bounds or [None] * len(signature))

    def draw(rng, k: int, scale: float) -> np.ndarray:
        shape, dtype = signature[k]
        if np.dtype(_np(dtype)).kind in "iub":
            high = max(1, bounds[k] or 2)
            return rng.integers(0, high, size=tuple(shape)).astype(_np(dtype))
        arr = random_array(rng, shape, dtype)
        return arr * np.asarray(scale, arr.dtype)

    def constant(k: int, value: int) -> np.ndarray:
        shape, dtype = signature[k]
        if np.dtype(_np(dtype)).kind in "iub":
            value = min(value, max(0, (bounds[k] or 2) - 1))
        return np.full(shape, value, _np(dtype))

    sets = []
    for k in range(random_draws):
        rng = np.random.default_rng(seed + k)
        sets.append(InputSet(f"random {k}", tuple(draw(rng, i, 1.0)
                                                  for i in range(len(signature)))))
    sets.append(InputSet("ones", tuple(constant(i, 1) for i in range(len(signature)))))
    sets.append(InputSet("zeros", tuple(constant(i, 0) for i in range(len(signature)))))
    rng = np.random.default_rng(seed + random_draws)
    sets.append(InputSet("large", tuple(draw(rng, i, LARGE_SCALE)
                                        for i in range(len(signature)))))
    return tuple(sets)


def index_bounds(mod, func_name: str = "main") -> List[Optional[int]]:
    """For each parameter of `mod[func_name]`, the size of the axis it indexes when the
    function uses it as the indices of `relax.take` (Gather), else None."""
    from tvm import relax

    func = mod[func_name]
    params = list(func.params)
    bounds: List[Optional[int]] = [None] * len(params)
    for block in getattr(func.body, "blocks", []):
        for binding in block.bindings:
            call = binding.value
            if not (isinstance(call, relax.Call) and getattr(call.op, "name", "") ==
                    "relax.take"):
                continue
            data, indices = call.args[0], call.args[1]
            if indices in params and isinstance(getattr(data, "ty", None), relax.TensorType):
                axis = int(call.attrs.axis) if call.attrs.axis is not None else 0
                try:
                    size = int(data.ty.shape.values[axis])
                except (TypeError, ValueError, IndexError, AttributeError):
                    continue
                k = params.index(indices)
                bounds[k] = size if bounds[k] is None else min(bounds[k], size)
    return bounds


def _np(dtype: str) -> np.dtype:
    return np.dtype("float32") if dtype == "bfloat16" else np.dtype(dtype)


def signature(mod, func_name: str = "main") -> List[Tuple[Tuple[int, ...], str]]:
    """(shape, dtype) of every parameter of `mod[func_name]`; NotImplementedError for a
    parameter that is not a tensor of static shape."""
    from tvm import relax

    if func_name not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ValueError(f"module has no function {func_name!r}")
    sig = []
    for param in mod[func_name].params:
        ty = param.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise NotImplementedError(f"parameter {param.name} has type {ty}; only tensors of "
                                      f"static shape can be checked")
        try:
            shape = tuple(int(v) for v in ty.shape.values)
        except (TypeError, AttributeError) as err:
            raise NotImplementedError(
                f"parameter {param.name} has a symbolic shape {ty.shape}") from err
        sig.append((shape, str(ty.dtype)))
    return sig


class CompiledModule:
    """`mod` built for `target` (`build_modules`) and loaded in `vm`; `outputs(inputs)` runs
    `func_name` (every output, tuples flattened) and remembers the result per input set."""

    def __init__(self, mod, target, vm, func_name: str = "main") -> None:
        import tvm

        self.func_name = func_name
        self.signature = signature(mod, func_name)
        self.device = tvm.device(_as_target(target).get_target_device_type(), 0)
        self.vm = vm
        self._outputs: dict = {}

    def outputs(self, inputs: InputSet) -> List[np.ndarray]:
        if inputs.name not in self._outputs:
            import tvm

            args = [tvm.runtime.tensor(a, self.device) for a in inputs.arrays]
            self._outputs[inputs.name] = _flatten(self.vm[self.func_name](*args))
        return self._outputs[inputs.name]


def _flatten(value) -> List[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [arr for item in value for arr in _flatten(item)]


def _as_target(target):
    import tvm

    return target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)


def _kind(target) -> str:
    return str(_as_target(target).kind.name)


def _has_device(target) -> bool:
    import tvm

    return bool(tvm.device(_as_target(target).get_target_device_type(), 0).exist)


_CACHE: "OrderedDict[tuple, CompiledModule]" = OrderedDict()
# The einweld pipeline checks five distinct modules (the user's, derived, prepared, fused,
# scheduled), and its final check holds the last against the first: with room for all of them
# that check reuses both builds and their outputs instead of compiling and running the
# user's (untuned, often the slowest) module again.
_CACHE_SIZE = 6


def _check_pipeline(target):
    # On a CPU the unscheduled kernels get loops that compute bit for bit what the default
    # build computes, only faster (`reference_schedule`): most checks run an unscheduled
    # module, and its scalar single-thread matmuls dominated compile time.
    return reference_build_pipeline() if target.kind.name == "llvm" else "default"


def compiled(mod, target, func_name: str = "main") -> CompiledModule:
    """The `CompiledModule` of `mod` for `target`, shared by every check in this process
    (keyed by structural hash; the few most recent are kept)."""
    return compile_all([mod], target, func_name)[0]


def build_modules(mods, target, func_name: str = "main") -> List[CompiledModule]:
    """Each module built for `target` the way checks build them (see `_check_pipeline`),
    all together: their code generation in parallel (`parallel_build`: a check's two builds
    in the time of one). Not cached (`compile_all` is)."""
    target = _as_target(target)
    vms = compile_modules(list(mods), target, _check_pipeline(target))
    return [CompiledModule(mod, target, vm, func_name) for mod, vm in zip(mods, vms)]


def compile_all(mods, target, func_name: str = "main") -> List[CompiledModule]:
    """`compiled` of each module; those not built yet are built together (`build_modules`)."""
    from tvm_ffi import structural_hash

    keys = [(structural_hash(mod), str(target), func_name) for mod in mods]
    missing = {key: mod for key, mod in zip(keys, mods) if key not in _CACHE}
    if missing:
        for key, module in zip(missing, build_modules(missing.values(), target, func_name)):
            _CACHE[key] = module
    out = []
    for key in keys:
        _CACHE.move_to_end(key)
        out.append(_CACHE[key])
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return out


def compare_compiled(got: CompiledModule, ref: CompiledModule, sets: Sequence[InputSet],
                     what: str, rtol: Optional[float] = None, atol: Optional[float] = None
                     ) -> TestResult:
    """Run both modules on every input set and compare each output with the tolerance of
    its dtype (outputs of several dtypes are held to the loosest)."""
    pairs, dtypes = [], set()
    for inputs in sets:
        outs_got, outs_ref = got.outputs(inputs), ref.outputs(inputs)
        if len(outs_got) != len(outs_ref):
            return TestResult(False, f"{len(outs_got)} outputs vs {len(outs_ref)} ({what})", 0,
                              float("inf"), float("inf"), 0.0)
        for k, (a, b) in enumerate(zip(outs_got, outs_ref)):
            if a.dtype != b.dtype:
                return TestResult(False, f"output {k} dtypes differ: {a.dtype} vs {b.dtype} "
                                  f"({what})", 0, float("inf"), float("inf"), 0.0)
            pairs.append((f"{inputs.name}: output {k}", a, b))
            dtypes.add(str(b.dtype))
    loosest = max(dtypes, key=lambda d: tolerance_for(d)[0], default="float64")
    return compare_arrays(pairs, loosest, what, len(sets), rtol, atol)


@dataclass(frozen=True)
class ModuleCheck:
    """The outcome of checking what `stage` returned against what it was given."""

    stage: str
    equal: bool
    evidence: str
    seconds: float  # wall time of the check (compiles included)
    ran: bool = True  # False: the target has no device here; `after` kept unchecked

    def __str__(self) -> str:
        verdict = ("not checked" if not self.ran else "equal" if self.equal else "NOT equal")
        return f"{self.stage}: {verdict} ({self.evidence}; check took {self.seconds:.1f} s)"


def check_module(stage: str, before, after, target, func_name: str = "main", seed: int = 0,
                 rtol: Optional[float] = None, atol: Optional[float] = None) -> ModuleCheck:
    """Compare `after` (what `stage` returned) with `before` (what it was given) on every
    input set of `input_sets`, both compiled for `target`. A check that cannot run (a symbolic
    shape, a build error) is a failed check: its evidence says why."""
    start = time.perf_counter()
    try:
        ref, got = compile_all([before, after], target, func_name)
        if ref.signature != got.signature:
            return ModuleCheck(stage, False, f"parameters differ: {ref.signature} vs "
                               f"{got.signature}", time.perf_counter() - start)
        sets = input_sets(ref.signature, seed, index_bounds=index_bounds(before, func_name))
        result = compare_compiled(got, ref, sets, "every output on every input set", rtol,
                                  atol)
        evidence = (f"{result.what}; max abs err {result.max_abs_error:.3g}, "
                    f"rel {result.max_rel_error:.3g}")
        return ModuleCheck(stage, result.equal, evidence, time.perf_counter() - start)
    except Exception as err:  # pylint: disable=broad-except  # unverifiable means unused
        return ModuleCheck(stage, False, f"check could not run: {type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}",
                           time.perf_counter() - start)


def check_if_runnable(stage: str, before, after, target, **options) -> ModuleCheck:
    """`check_module`, or on a target with no device here (cross-compilation, e.g. cuda on a
    machine without a GPU) a check marked not run, with a warning: nothing can run here, the
    stages' own checks ran on the CPU."""
    if not _has_device(target):
        warnings.warn(f"{stage}: whole-module check skipped (no {_kind(target)} device on this "
                      f"machine; the stages' own checks ran on the CPU)", stacklevel=3)
        return ModuleCheck(stage, True, f"no {_kind(target)} device here: the module was not "
                           f"run", 0.0, ran=False)
    return check_module(stage, before, after, target, **options)


def checked(stage: str, before, after, target, checks: Optional[list] = None, **options):
    """`after` when it agrees with `before` (see `check_module`), else `before` with a warning
    naming the stage: never a wrong answer. The check is appended to `checks` when given;
    an unchanged module (`after is before`) needs no check."""
    if after is before:
        return after
    result = check_if_runnable(stage, before, after, target, **options)
    if checks is not None:
        checks.append(result)
    if result.equal:
        return after
    warnings.warn(f"{stage}: the module it returned disagrees with the module it was given "
                  f"({result.evidence}); falling back to the module it was given",
                  stacklevel=2)
    return before


def checked_parts(stage: str, before, make: Callable[[FrozenSet[str]], Any],
                  parts: Sequence[str], target, checks: Optional[list] = None,
                  max_faults: int = 3) -> Tuple[Any, Tuple[str, ...]]:
    """(module, parts left out) for a stage made of independent parts (one schedule per
    kernel, say): `make(skip)` is the stage's module with the parts in `skip` left out, and
    `make(frozenset())` is used when it agrees with `before`. Otherwise the parts at fault are
    found and only they are left out, instead of the whole stage:

    1. `make(all parts)` is checked first: if even it disagrees, the fault is not in a part
       and the stage is dropped (`before` is returned);
    2. else a part at fault is found by bisection over the parts in order: the shortest prefix
       whose parts, applied together with those already known good, make the module disagree
       ends in a part at fault (the prefix before it agreed). It is left out, the parts before
       it are known good, and the module with every other part is checked again; repeated up
       to `max_faults` times (each costs about log2(len(parts)) + 1 checks), then the stage is
       dropped.

    The module returned has passed `check_if_runnable` against `before` (or is `before`), so a
    part is never used unchecked: each part's fault need not be its own (errors of several
    parts add up), but the result's agreement is checked, not inferred. Checks are appended
    to `checks`; the kernels of the variants are built once each (`parallel_build` keeps
    them), so a check after the first mostly links and runs."""
    parts = list(parts)

    def check(skip, label):
        after = make(frozenset(skip))
        result = check_if_runnable(label, before, after, target)
        if checks is not None:
            checks.append(result)
        return after, result

    after, result = check((), stage)
    if result.equal:
        return after, ()
    _, alone = check(parts, f"{stage} (without any of its {len(parts)} parts)")
    faults: List[str] = []
    if alone.equal:
        rest = parts  # the parts before `rest` not in `faults` are known good together
        while not result.equal and rest and len(faults) < max_faults:
            lo, hi = 0, len(rest) - 1  # the first part at fault is rest[lo..hi]
            while lo < hi:
                mid = (lo + hi) // 2
                if check(faults + rest[mid + 1:], f"{stage} (bisecting)")[1].equal:
                    lo = mid + 1
                else:
                    hi = mid
            faults.append(rest[lo])
            rest = rest[lo + 1:]
            after, result = check(faults, f"{stage} (without {', '.join(faults)})")
        if result.equal:
            warnings.warn(f"{stage}: the module it returned disagrees with the module it was "
                          f"given; left out the parts at fault ({', '.join(faults)}), kept "
                          f"the other {len(parts) - len(faults)}", stacklevel=2)
            return after, tuple(faults)
    warnings.warn(f"{stage}: the module it returned disagrees with the module it was given "
                  f"({result.evidence}); "
                  + ("it disagrees without any of its parts too" if not alone.equal else
                     f"no {max_faults} of its parts left out make it agree")
                  + "; falling back to the module it was given", stacklevel=2)
    return before, tuple(parts)


__all__ = ["InputSet", "input_sets", "index_bounds", "signature", "CompiledModule", "compiled",
           "compile_all", "build_modules", "ModuleCheck",
           "compare_compiled", "check_module", "checked", "checked_parts", "LARGE_SCALE"]
