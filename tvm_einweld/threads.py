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
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

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


__all__ = ["configure_thread_pool"]
