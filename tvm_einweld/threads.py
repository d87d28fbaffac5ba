"""TVM's CPU thread pool, set up to use the machine.

As shipped, TVM 0.27 sizes its pool `hardware_concurrency / 2` on x86 (to skip hyper-threads),
which on a VM of 2 cores without SMT is one thread: every kernel runs on half the machine. When
the pool starts it also pins the calling thread to CPU 0, so threads that other libraries create
later in the process (OpenBLAS's, onnxruntime's) inherit a one-CPU mask.

`configure_thread_pool()` gives the pool one thread per physical core (the kernel's CPU
topology, `machine.physical_cores`) and turns the pinning off. TVM reads `TVM_NUM_THREADS` and
`TVM_BIND_THREADS` when the pool is created, so importing `tvm_einweld` sets them (unless the
user already did) and creates the pool; a pool created earlier cannot be resized in 0.27 (its
`runtime.config_threadpool` leaves the count as it was), which gets a warning that says so.
A process that loads an exported library without importing tvm_einweld gets the same by
setting the two variables, or with the one call in the README.

A second pool in the same process is the other hazard. numpy's OpenBLAS keeps its threads
(one per core) busy-waiting for a while after each call, and TVM's workers busy-wait between
kernels too: right after a numpy matmul TVM's kernels wait for a core (measured on a 2-core
Zen 5: BERT 4.3 -> 8.6 ms median, 36 ms at the 90th percentile; MobileNetV2 0.34 -> 0.69 ms;
with OpenBLAS at one thread 4.3 and 0.36). `blas_threads(1)` caps the OpenBLAS pools loaded
in the process for a block and restores them after (what `OPENBLAS_NUM_THREADS=1` does for a
whole process, which OpenBLAS reads only when it loads): the pipeline times its candidates
inside it, and a program that mixes numpy BLAS calls with TVM inference can do the same.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from typing import Iterator, List, Optional, Tuple

from .machine import physical_cores, usable_cpus


def configure_thread_pool(threads: Optional[int] = None) -> int:
    """Use `threads` (default: the physical cores) in TVM's pool, unpinned; returns the
    number of threads the pool runs. A user's own `TVM_NUM_THREADS` / `TVM_BIND_THREADS`
    are kept."""
    count = int(os.environ.get("TVM_NUM_THREADS") or threads or physical_cores())
    os.environ.setdefault("TVM_NUM_THREADS", str(count))
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    import tvm  # pylint: disable=import-outside-toplevel

    running = int(tvm.get_global_func("runtime.NumThreads")())  # creates the pool if needed
    if running != count:
        # A kernel ran before this call and the pool exists with TVM's default size; 0.27's
        # runtime.config_threadpool does not resize it (measured), so say how to fix it.
        warnings.warn(f"TVM's thread pool was created before tvm_einweld configured it and "
                      f"runs {running} thread(s) on {count} physical core(s): import "
                      f"tvm_einweld before running any kernel, or set TVM_NUM_THREADS={count} "
                      f"TVM_BIND_THREADS=0 in the environment", stacklevel=2)
        os.sched_setaffinity(0, usable_cpus())  # at least undo the pool's pin of this thread
    return running


# OpenBLAS's thread-count entry points, by the symbol prefix / suffix of its builds: plain
# OpenBLAS, and scipy-openblas (numpy's and scipy's wheels; 64-bit integers: "64_").
_OPENBLAS_NAMES = (("openblas_get_num_threads", "openblas_set_num_threads"),
                   ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
                   ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
                   ("openblas_get_num_threads64_", "openblas_set_num_threads64_"))


def _openblas_pools() -> List[Tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]]:
    """(get, set) of every OpenBLAS library loaded in this process (Linux's /proc/self/maps;
    elsewhere none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            fields = [line.split(None, 5) for line in maps]
        paths = {f[5].strip() for f in fields
                 if len(f) == 6 and "openblas" in f[5].rsplit("/", 1)[-1]}
    except OSError:
        return []
    pools = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle, nothing re-initialised
        except OSError:
            continue
        for get_name, set_name in _OPENBLAS_NAMES:
            if hasattr(lib, get_name) and hasattr(lib, set_name):
                get, put = getattr(lib, get_name), getattr(lib, set_name)
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                pools.append((get, put))
                break
    return pools


@contextlib.contextmanager
def blas_threads(count: int = 1) -> Iterator[int]:
    """Inside the block, every OpenBLAS pool loaded in the process runs at most `count`
    threads (see the module docstring); their previous counts are restored after it. Yields
    how many pools were capped (0 where none is loaded or the platform has no
    /proc/self/maps)."""
    pools = _openblas_pools()
    before = [get() for get, _ in pools]
    for (_, put), threads in zip(pools, before):
        put(min(count, threads))
    try:
        yield len(pools)
    finally:
        for (_, put), threads in zip(pools, before):
            put(threads)


__all__ = ["blas_threads", "configure_thread_pool"]
