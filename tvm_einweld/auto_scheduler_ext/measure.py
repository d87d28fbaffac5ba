"""Build and run a batch of programs with any MetaSchedule builder/runner (local or RPC).

A failure of the builder or runner as a whole (an exception, not a per-candidate error) is
turned into per-candidate error results, so one bad round never stops a tuning run.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional, Sequence

from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import _worker_func as build_worker
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind
from tvm.s_tir.meta_schedule.runner import RunnerInput, RunnerResult
from tvm.target import Target

from ..machine import fastest
from .build_fn import build_cpu_kernel
from .strategies import args_info

FAILED_SECS = 1e10  # what MetaSchedule records as the run time of a failed candidate


@derived_object
class PooledBuilder(PyBuilder):
    """MetaSchedule's LocalBuilder, but its worker processes live across batches.

    LocalBuilder starts a new process pool for every batch; each worker imports TVM again,
    which costs ~5 s per round on a busy 2-core machine (measured: 10 s for a first batch of 8
    small kernels, 4-5 s for the next ones on a kept pool). Workers build with
    ``build_cpu_kernel`` through LocalBuilder's own worker function; a timed-out worker is
    killed and replaced by the pool.
    """

    def __init__(self, max_workers: Optional[int] = None, timeout_sec: float = 60.0) -> None:
        super().__init__()
        self.timeout_sec = timeout_sec
        self.pool = PopenPoolExecutor(max_workers=max_workers or ms.utils.cpu_count(logical=True),
                                      timeout=timeout_sec)

    def build(self, build_inputs):
        results = []
        jobs = [(build_cpu_kernel, None, b.mod, b.target, None) for b in build_inputs]
        for res in self.pool.map_with_error_catching(lambda job: build_worker(*job), jobs):
            if res.status == StatusKind.COMPLETE:
                results.append(BuilderResult(res.value, None))
            elif res.status == StatusKind.TIMEOUT:
                results.append(BuilderResult(None, f"build timed out after {self.timeout_sec} s"))
            else:
                results.append(BuilderResult(None, f"build failed: {res.value}"))
        return results


def build_and_run(
    programs: Sequence[s_tir.Schedule],
    target: Target,
    builder: ms.builder.Builder,
    runner: ms.runner.Runner,
) -> list[RunnerResult]:
    """One RunnerResult per program, in order; errors are results, never exceptions."""
    if not programs:
        return []
    infos = [args_info(p) for p in programs]
    device_type = {"llvm": "cpu"}.get(target.kind.name, target.kind.name)
    try:
        built = builder.build([BuilderInput(p.mod, target) for p in programs])
    except Exception as err:  # pylint: disable=broad-except
        return [RunnerResult(None, f"builder failed: {err}") for _ in programs]
    results: list[Optional[RunnerResult]] = [None] * len(programs)
    run_inputs, run_index = [], []
    for i, b in enumerate(built):
        if b.error_msg is not None or b.artifact_path is None:
            results[i] = RunnerResult(None, f"build error: {b.error_msg}")
        else:
            run_inputs.append(RunnerInput(b.artifact_path, device_type, infos[i]))
            run_index.append(i)
    try:
        futures = runner.run(run_inputs) if run_inputs else []
        for i, fut in zip(run_index, futures):
            results[i] = fut.result()
    except Exception as err:  # pylint: disable=broad-except
        for i in run_index:
            if results[i] is None:
                results[i] = RunnerResult(None, f"runner failed: {err}")
    finally:
        for b in built:  # each artifact has its own temp dir, as RemoveBuildArtifact assumes
            if b.artifact_path is not None:
                shutil.rmtree(os.path.dirname(b.artifact_path), ignore_errors=True)
    return results  # type: ignore[return-value]


def run_seconds(result: RunnerResult) -> Optional[float]:
    """A candidate's run time: the `machine.fastest` of its measured repeats (the statistic
    of every time the package compares), or None for a failed candidate."""
    if result.error_msg is not None or not result.run_secs:
        return None
    value = fastest(float(s) for s in result.run_secs)
    return None if value >= FAILED_SECS else value
