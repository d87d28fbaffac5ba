"""TVM's pool on every physical core, unpinned, and OpenBLAS's pool capped inside a block
(tvm_einweld/threads.py), and the
core-to-core round trip every fork/join pays (machine.measure_round_trip_ns)."""
import os

import numpy as np
import tvm

import tvm_einweld  # noqa: F401  (configures the pool on import)
from tvm_einweld import machine
from tvm_einweld.machine import physical_cores, usable_cpus
from tvm_einweld.threads import _openblas_pools, blas_threads


def test_pool_uses_every_physical_core_and_leaves_threads_unpinned():
    expected = int(os.environ.get("TVM_NUM_THREADS") or physical_cores())
    assert tvm.get_global_func("runtime.NumThreads")() == expected
    # Threads that other libraries create later inherit this mask: all usable CPUs.
    assert sorted(os.sched_getaffinity(0)) == sorted(usable_cpus())


def test_blas_threads_caps_numpys_openblas_and_restores_it():
    np.ones((64, 64), np.float32) @ np.ones((64, 64), np.float32)  # OpenBLAS loaded and used
    uses_openblas = "openblas" in str(
        np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]).lower()
    before = [get() for get, _ in _openblas_pools()]
    with blas_threads(1) as capped:
        inside = [get() for get, _ in _openblas_pools()]
        a = np.random.default_rng(0).standard_normal((96, 80)).astype(np.float32)
        np.testing.assert_allclose(a @ a.T, (a.astype(np.float64) @ a.T.astype(np.float64)),
                                   rtol=1e-4, atol=1e-4)
    assert capped == len(before) and (capped >= 1 or not uses_openblas)
    assert inside == [1] * capped
    assert [get() for get, _ in _openblas_pools()] == before


def test_round_trip_probe_and_slow_rows():
    """The core-to-core round trip the benchmarks record: a positive number of nanoseconds
    on a machine of two or more CPUs with gcc (None otherwise, never an error), and the rows
    flagged as slow are those over twice the fastest (None: not measured)."""
    trip = machine.measure_round_trip_ns(seconds=0.005, repeats=3)
    if len(machine.usable_cpus()) < 2:
        assert trip is None
    elif trip is not None:
        assert 0 < trip < 1e7
    assert machine.slow_round_trips([50.0, 61.0, None, 400.0, 99.0]) == [3]
    assert machine.slow_round_trips([None, None]) == []
    assert machine.row_round_trips([(50.0, 400.0), (None, 61.0), (None, None)]) == \
        [400.0, 61.0, None]


def test_handoff_probe():
    """The hand-off the affinity rule is about (`machine.measure_handoff`): two positive
    read bandwidths for a buffer one thread wrote, on two or more CPUs with gcc (None
    otherwise, never an error), the size reported as asked."""
    handoff = machine.measure_handoff(256, repeats=5)
    if len(machine.usable_cpus()) < 2:
        assert handoff is None
    elif handoff is not None:
        assert handoff.kib == 256 and handoff.own_gbs > 0 and handoff.other_gbs > 0
