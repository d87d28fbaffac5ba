"""What the tests share: building a Relax module and running it on the VM, and the fixtures
for the host target and a seeded generator.

A test that compares a rewritten module with the given one must run both the same way; one
helper does it, so a difference between two results is a difference between the modules and
never between two hand-written ways of calling `relax.VirtualMachine`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_einweld.bench import timing

# Benchmarks run by the tests do not wait for the VM's fast phase (the cores placed together):
# the tests assert no timings, and a host that keeps a slow placement for minutes made each
# timed row of them wait two minutes.
timing.FAST_PHASE_WAIT_SECONDS = 0.0


def _numpy(result):
    """The VM's result as NumPy: one array, or a tuple of arrays for a tuple result."""
    if hasattr(result, "numpy"):
        return result.numpy()
    return tuple(_numpy(r) for r in result)


def compile_vm(built, target="llvm", relax_pipeline=None,
               func: str = "main") -> Callable[..., np.ndarray | tuple]:
    """`built` (an IRModule, compiled here for `target` by `relax_pipeline` where given, or an
    executable `tvm.compile` made) as a function from NumPy arrays to NumPy results."""
    if not isinstance(built, tvm.runtime.Executable):
        if relax_pipeline is None:
            built = tvm.compile(built, target)
        else:
            built = tvm.compile(built, target, relax_pipeline=relax_pipeline)
    run = relax.VirtualMachine(built, tvm.cpu())[func]
    return lambda *arrays: _numpy(run(*[tvm.runtime.tensor(a) for a in arrays]))


def run_vm(built, *arrays: np.ndarray, target="llvm", relax_pipeline=None,
           func: str = "main") -> np.ndarray | tuple:
    """`compile_vm(built, ...)` called once on `arrays`."""
    return compile_vm(built, target, relax_pipeline, func)(*arrays)


@pytest.fixture(scope="session")
def host_target() -> tvm.target.Target:
    """The target the einweld CPU rules build for on this machine."""
    from tvm_einweld.tir_passes.device import host_target as probe

    return probe()


@pytest.fixture
def rng() -> np.random.Generator:
    """A generator seeded with 0, fresh for every test."""
    return np.random.default_rng(0)


@pytest.fixture
def fresh_decisions(tmp_path, monkeypatch):
    """An empty decision cache (disk and memory) for one test, as on a fresh machine: a test
    that asserts a search ran must not find the decision already taken by an earlier compile
    (this machine's cache, or another test of the same session)."""
    from tvm_einweld import machine

    monkeypatch.setenv("TVM_EINWELD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(machine.DECISIONS_VAR, raising=False)
    monkeypatch.setattr(machine, "_TIMES", {})
    return tmp_path / "cache"


@pytest.fixture
def no_retiming(monkeypatch):
    """Rounds are not timed again when the host has the vCPUs apart or the machine is loaded
    (`bench.timing.time_in_fast_phase`, tested on its own in test_bench_timing.py): for the
    tests that count a runner's calls, whose counts would otherwise depend on the machine."""
    from tvm_einweld.bench import harness, timing
    monkeypatch.setattr(harness, "time_in_fast_phase", lambda once, log=print: (
        timing.time_in_fast_phase(once, log, slow=lambda *trips: False)))
