"""Whole-module checks (issue: a SqueezeNet with uniform weights got a wrong answer).

Root cause, reproduced here: numpy's OpenBLAS, with the kernels it picks on AVX2 / Zen CPUs
(`OPENBLAS_CORETYPE=Haswell`), rounds the rows of a GEMM differently even when every row of
the left operand is the same. With uniform weights every output channel of a conv is the
same number; after the derivation pass turned the convs into numpy GEMMs, the channels
differed by an ulp. Uniform weights also grow SqueezeNet's logits to ~1e10 (ulp 1024), so the
softmax, decided by those ulps, put all its mass on a few classes. Every rewritten subprogram
had been checked alone on inputs in [-1, 1] and agreed to 1e-7; the composed module, with
its own constants, was never run. The fix lives in the verification: the module the pipeline
returns is run whole against the given one (`verify.module_check`), with the model's own
constants and with constant, zero and large inputs; when they disagree every stage's module is
checked whole against its input and the stage at fault falls back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tvm import relax

from tvm_einweld.verify.module_check import (
    LARGE_SCALE, check_module, checked, checked_parts, input_sets,
)

RNG = np.random.default_rng(0)


def _matmul_softmax(weight: np.ndarray, scale: float = 1.0, clip: float | None = None):
    """main(x) = softmax(clip(scale * x) @ weight)."""
    x = relax.Var("x", relax.TensorType((3, weight.shape[0]), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.multiply(x, relax.const(scale, "float32")))
            if clip is not None:
                h = bb.emit(relax.op.clip(h, -clip, clip))
            y = bb.emit(relax.op.matmul(h, relax.const(weight)))
            out = bb.emit_output(relax.op.nn.softmax(y, axis=-1))
        bb.emit_func_output(out)
    return bb.get()


def test_input_sets_cover_random_constant_zero_and_large_inputs():
    sets = input_sets([((2, 3), "float32"), ((4,), "int64")], seed=1)
    names = [s.name for s in sets]
    assert names == ["random 0", "random 1", "ones", "zeros", "large"]
    by_name = {s.name: s.arrays for s in sets}
    assert np.all(by_name["ones"][0] == 1) and np.all(by_name["zeros"][1] == 0)
    assert by_name["ones"][1].dtype == np.int64 and by_name["large"][0].dtype == np.float32
    assert np.abs(by_name["large"][0]).max() > 1.5  # far outside [-1, 1]
    assert np.abs(by_name["large"][0]).max() <= LARGE_SCALE
    assert set(np.unique(by_name["large"][1])) <= {0, 1}  # integers: indices, not scaled
    assert not np.array_equal(by_name["random 0"][0], by_name["random 1"][0])


def test_integer_inputs_stay_valid_indices_of_the_axis_they_gather():
    """Gather indices are drawn within the indexed axis (an index out of range reads out of
    bounds in TVM's take) and constant sets clamp to it."""
    from tvm_einweld.verify.module_check import index_bounds

    ids = relax.Var("ids", relax.TensorType((4, 6), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [ids]):
        with bb.dataflow():
            table = relax.const(RNG.uniform(-1, 1, (5, 3)).astype("float32"))
            out = bb.emit_output(relax.op.take(table, ids, axis=0))
        bb.emit_func_output(out)
    mod = bb.get()
    bounds = index_bounds(mod)
    assert bounds == [5]
    sets = input_sets([((4, 6), "int64")], seed=0, index_bounds=bounds)
    values = np.concatenate([s.arrays[0].ravel() for s in sets])
    assert values.min() >= 0 and values.max() <= 4 and values.max() > 1
    assert check_module("identity", mod, relax.transform.LegalizeOps()(mod), "llvm").equal


def test_an_equal_module_passes_and_reports_its_cost():
    mod = _matmul_softmax(RNG.uniform(-1, 1, (8, 5)).astype("float32"))
    legalized = relax.transform.LegalizeOps()(mod)
    result = check_module("LegalizeOps", mod, legalized, "llvm")
    assert result.equal and result.ran and result.seconds > 0, result


def test_a_stage_wrong_only_at_large_magnitudes_is_caught_and_dropped():
    """Planted fault: the stage clips activations to [-2, 2], invisible on [-1, 1] inputs."""
    weight = RNG.uniform(-1, 1, (8, 5)).astype("float32")
    given, wrong = _matmul_softmax(weight), _matmul_softmax(weight, clip=2.0)
    checks: list = []
    with pytest.warns(UserWarning, match="planted stage.*disagrees"):
        kept = checked("planted stage", given, wrong, "llvm", checks)
    assert kept is given
    assert not checks[0].equal and "large" in checks[0].evidence


def _stage_of_parts(weight: np.ndarray, faulty: set, everywhere: bool = False):
    """`make(skip)` of a planted stage of six parts "p0".."p5": its module adds 0.5 to the
    activations per part of `faulty` not skipped (and once more always when `everywhere`),
    so it equals the given module exactly when every faulty part is left out."""
    def make(skip):
        shift = 0.5 * (len(faulty - skip) + everywhere)
        return _matmul_softmax(weight) if shift == 0 else _shifted(weight, shift)

    return make, [f"p{i}" for i in range(6)]


def _shifted(weight: np.ndarray, shift: float):
    x = relax.Var("x", relax.TensorType((3, weight.shape[0]), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.add(x, relax.const(shift, "float32")))
            y = bb.emit(relax.op.matmul(h, relax.const(weight)))
            out = bb.emit_output(relax.op.nn.softmax(y, axis=-1))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("faulty", [{"p1"}, {"p1", "p4"}, {"p0", "p5"}])
def test_only_the_parts_at_fault_are_left_out(faulty):
    """Planted faults in one or two of a stage's six parts: bisection finds exactly those,
    and the module returned (every other part applied) agrees with the given one."""
    weight = RNG.uniform(-1, 1, (8, 5)).astype("float32")
    make, parts = _stage_of_parts(weight, faulty)
    checks: list = []
    with pytest.warns(UserWarning, match="left out the parts at fault"):
        module, skipped = checked_parts("planted", _matmul_softmax(weight), make, parts,
                                        "llvm", checks)
    assert set(skipped) == faulty
    assert checks[-1].equal and checks[-1].stage.startswith("planted (without")
    assert check_module("result", _matmul_softmax(weight), module, "llvm").equal


@pytest.mark.parametrize("everywhere,max_faults", [(True, 3), (False, 1)],
                         ids=["not-in-a-part", "too-many"])
def test_a_fault_no_part_explains_drops_the_whole_stage(everywhere, max_faults):
    """A fault outside the parts (the stage disagrees even with every part left out), or
    more parts at fault than allowed: the given module is returned."""
    weight = RNG.uniform(-1, 1, (8, 5)).astype("float32")
    given = _matmul_softmax(weight)
    make, parts = _stage_of_parts(weight, {"p2", "p3"}, everywhere)
    with pytest.warns(UserWarning, match="falling back to the module it was given"):
        module, skipped = checked_parts("planted", given, make, parts, "llvm",
                                        max_faults=max_faults)
    assert module is given and set(skipped) == set(parts)


def test_modules_compiled_together_compute_what_each_compiles_to_alone():
    """`parallel_build.compile_modules` (code generation in threads) against `tvm.compile`
    of each module in turn: the same outputs, bit for bit, whatever order the threads end."""
    import tvm

    from tvm_einweld.parallel_build import compile_modules

    mods = [_matmul_softmax(RNG.uniform(-1, 1, (k, 5)).astype("float32")) for k in (7, 8, 9)]
    target = tvm.target.Target("llvm")
    together = compile_modules(mods, target)
    for mod, built in zip(mods, together):
        x = RNG.uniform(-1, 1, tuple(int(d) for d in mod["main"].params[0].ty.shape))
        x = tvm.runtime.tensor(x.astype("float32"))
        got = built["main"](x).numpy()
        alone = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())["main"](x).numpy()
        np.testing.assert_array_equal(got, alone)


def test_an_unchanged_module_is_not_checked():
    mod = _matmul_softmax(RNG.uniform(-1, 1, (8, 5)).astype("float32"))
    checks: list = []
    assert checked("noop", mod, mod, "llvm", checks) is mod and checks == []


def test_a_module_that_cannot_be_run_is_a_failed_check():
    """A stage whose module changed its parameters is not used."""
    given = _matmul_softmax(RNG.uniform(-1, 1, (8, 5)).astype("float32"))
    other = _matmul_softmax(RNG.uniform(-1, 1, (9, 5)).astype("float32"))
    result = check_module("planted", given, other, "llvm")
    assert not result.equal and "parameters differ" in result.evidence


def test_subprogram_check_sees_a_permutation_of_uniform_weights():
    """Planted fault in a rewrite: it permutes the rows of the weight. With the model's own
    (uniform) weight that is invisible; the subprogram check also draws the weights at
    random, so it is rejected."""
    from dataclasses import replace

    from tvm_einweld.relay_passes.derivation_transform import DerivationTransform
    from tvm_einweld.relay_passes.subprograms import split_module

    weight = np.full((8, 5), 0.25, "float32")
    mod = _matmul_softmax(weight)
    dt = DerivationTransform(max_depth=1, max_states=5, time_limit_s=1.0,
                             confirm_by_measurement=False)
    sub = next(s for split in split_module(mod).values() for s in split.subprograms
               if any(op.kind == "relax.matmul" for op in s.ops))
    ops = [dt.optimise_op(op) for op in sub.ops]
    k = next(i for i, op in enumerate(sub.ops) if op.kind == "relax.matmul")
    a_name, w_name = sub.ops[k].names

    def permuted(bb, values):
        w = values[w_name]
        flipped = bb.emit(relax.op.flip(w, axis=0))  # rows reversed: same values if uniform
        return relax.op.matmul(values[a_name], flipped)

    wrong = replace(ops[k].original, label="derived", emit=permuted)
    ops[k] = replace(ops[k], chosen=wrong)
    test = dt._check_rewrite(sub, tuple(ops))  # pylint: disable=protected-access
    assert not test.equal, test


_MECHANISM = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np, tvm
    from tvm import relax
    import tvm_einweld
    from tvm_einweld.relay_passes import numpy_gemm
    from tvm_einweld.verify.module_check import checked

    # numpy's BLAS with the AVX2 kernels: rows of a GEMM with identical rows still differ.
    a = np.full((288, 32), 0.5, np.float32)
    b = (np.random.default_rng(0).uniform(0, 1, (32, 100)) * 1e4).astype(np.float32)
    rows_differ = bool((np.matmul(a, b) != np.matmul(a, b)[:1]).any())

    # A classifier head as SqueezeNet's (a 1x1 conv as a GEMM, softmax over the channels
    # at every pixel): uniform weights, activations grown large by the layers before it.
    def head(use_provider):
        x = relax.Var("x", relax.TensorType((32, 100), "float32"))
        w = relax.const(np.full((288, 32), 0.02, np.float32))
        bb = relax.BlockBuilder()
        with bb.function("main", [x]):
            with bb.dataflow():
                h = bb.emit(relax.op.multiply(x, relax.const(1e9, "float32")))
                y = numpy_gemm.matmul_call(w, h) if use_provider else relax.op.matmul(w, h)
                out = bb.emit_output(relax.op.nn.softmax(bb.emit(y), axis=0))
            bb.emit_func_output(out)
        return bb.get()

    given, rewritten = head(False), head(True)
    x = np.random.default_rng(1).uniform(0, 1, (32, 100)).astype("float32")
    run = lambda m: relax.VirtualMachine(tvm.compile(m, "llvm"), tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy()
    wrong = float(np.abs(run(rewritten) - run(given)).max())
    checks = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = checked("DerivationTransform", given, rewritten, "llvm", checks)
    print(json.dumps({"core": numpy_gemm_core(), "rows_differ": rows_differ, "wrong": wrong,
                      "fell_back": kept is given, "evidence": checks[0].evidence}))
""")

_CORE = textwrap.dedent("""
    def numpy_gemm_core():
        import ctypes, glob, os
        import numpy
        libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), "..", "numpy.libs",
                                      "*openblas*"))
        for lib in libs:
            for name in ("scipy_openblas_get_corename64_", "openblas_get_corename"):
                fn = getattr(ctypes.CDLL(lib), name, None)
                if fn is not None:
                    fn.restype = ctypes.c_char_p
                    return fn().decode()
        return "unknown"
""")


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_avx2(), reason="OpenBLAS's Haswell kernels need AVX2")
def test_root_cause_blas_rows_round_differently_and_the_module_check_falls_back():
    """The mechanism, in a process whose numpy BLAS uses its Haswell kernels (what it picks
    on AMD Zen): the provider's GEMM makes uniform channels unequal, the softmax over large
    logits turns that into a wrong answer, and the whole-module check catches it."""
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell")
    proc = subprocess.run([sys.executable, "-c", _CORE + _MECHANISM], env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["core"] == "Haswell", got
    assert got["rows_differ"], got
    # the provider's module alone is wrong: every entry should be 1/288
    assert got["wrong"] > 0.5 / 288, got
    assert got["fell_back"] and "exceeds" in got["evidence"], got
