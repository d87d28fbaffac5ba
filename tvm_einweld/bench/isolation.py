"""Every runner in its own worker process, with the machine's cores given to it explicitly.

Why: onnxruntime's, OpenBLAS's and OpenVINO's thread pools keep spinning after a call, and
TVM pins the thread that starts its pool to CPU 0 (threads created later inherit the pin).
Timed in one process, each runtime slows the next (a numpy GEMM went 4.9 -> 9-11 ms right
after an onnxruntime call), so published onnxruntime numbers were up to 6x too slow. And TVM
0.27 sizes its pool to hardware_concurrency / 2 on x86, i.e. one thread on a 2-core VM,
unless TVM_NUM_THREADS is set before the runtime starts.

So a runner is prepared (compiled, tuned) once in a fresh worker process whose environment
sets every thread count to the physical cores and whose affinity covers every CPU; the
parent then asks it for rounds of timed calls over a pipe (`timing.alternate_rounds`
alternates the rounds across workers). After each round the parent waits until the worker's
threads stop using the CPU, so a pool still spinning never overlaps the next runner's round.
Inputs, outputs and requests cross as pickles; timing happens inside the worker.

`LocalRunner` holds one prepared runner and answers the requests; `WorkerProcess` is the
parent's handle on a worker serving one, and `InProcessRunner` the same interface without
a process (for callers that need the prepared objects, or to show what isolation changes).
"""
from __future__ import annotations

import json
import os
import pickle
import select
import struct
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ..machine import physical_cores, usable_cpus
from ..runtime_io import aligned
from .timing import calls_per_sample, local_sampler

# Thread-count variables every worker gets (each runtime reads its own). The runtime options
# (onnxruntime's intra_op_num_threads, OpenVINO's INFERENCE_NUM_THREADS, torch's
# set_num_threads) are given from `bench_threads()`, which reads THREADS_VAR.
THREAD_VARS = ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
THREADS_VAR = "EINWELD_BENCH_THREADS"
_CPUS_VAR = "EINWELD_BENCH_CPUS"
_PATH_VAR = "EINWELD_WORKER_PATH"

# The worker's first statements: widen its affinity before anything starts a thread (the
# parent may carry TVM's pin to CPU 0); keep stdout for the protocol and send whatever else
# is printed there (imports, TVM, MetaSchedule) to the log; then import with the parent's
# sys.path (so a worktree, a test module or a script's own runners resolve as there).
_BOOT = """\
import json, os, sys
cpus = os.environ.get("EINWELD_BENCH_CPUS")
if cpus and hasattr(os, "sched_setaffinity"):
    try:
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    except OSError:
        pass
replies = os.dup(1)
os.dup2(2, 1)
sys.path[:0] = json.loads(os.environ["EINWELD_WORKER_PATH"])
from tvm_einweld.bench.isolation import serve
serve(replies)
"""


# ---- threads ------------------------------------------------------------------------------
def bench_threads() -> int:
    """Threads a runtime should use: what the harness gave this worker, else the physical
    cores (a runner prepared outside the harness)."""
    value = os.environ.get(THREADS_VAR)
    return int(value) if value else physical_cores()


def thread_environment(threads: int) -> dict[str, str]:
    """The environment variables a worker gets so that every runtime uses `threads`."""
    return {**{var: str(threads) for var in THREAD_VARS}, THREADS_VAR: str(threads)}


def process_settings() -> dict[str, str]:
    """What this process runs with: the thread variables and the CPUs it may use."""
    settings = {var: os.environ.get(var, "unset") for var in THREAD_VARS}
    if hasattr(os, "sched_getaffinity"):
        settings["cpus"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return settings


def cpu_seconds(pid: int) -> Optional[float]:
    """CPU time used so far by every thread of `pid` (Linux schedstat, nanosecond counts)."""
    try:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
        return total / 1e9
    except OSError:
        return None


def wait_until_quiet(pid: int, window: float = 0.01, busy_fraction: float = 0.05,
                     max_wait: float = 2.0) -> float:
    """Wait until the threads of `pid` use under `busy_fraction` of a CPU over `window`
    (spinning pools go to sleep), at most `max_wait` seconds. Returns the seconds waited."""
    start = time.monotonic()
    before = cpu_seconds(pid)
    if before is None:  # no /proc: give spinning pools a fixed pause instead
        time.sleep(0.05)
        return 0.05
    while time.monotonic() - start < max_wait:
        time.sleep(window)
        after = cpu_seconds(pid)
        if after is None or after - before < busy_fraction * window:
            break
        before = after
    return time.monotonic() - start


# ---- one prepared runner (what a worker serves) ---------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    """A runner after preparing: where it runs, how long preparing took, its first outputs
    (for the check against the reference) and the settings it runs with."""

    pid: int
    prepare_seconds: float
    call_seconds: float  # the first call, outputs included
    outputs: tuple[np.ndarray, ...]
    settings: tuple[tuple[str, str], ...]


def error_line(err: BaseException) -> str:
    """`Type: first line of the message`, the detail a report shows for a failure."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


class LocalRunner:
    """One runner prepared in this process; answers the requests a worker answers."""

    def __init__(self, prepare_fn: Callable) -> None:
        self._prepare_fn = prepare_fn
        self._call: Optional[Callable[[], list]] = None

    def prepare(self, model_bytes: bytes, trials: int, work_dir: str,
                inputs: dict[str, np.ndarray]) -> Prepared:
        import onnx

        model = onnx.load_from_string(model_bytes)
        inputs = {name: aligned(array) for name, array in inputs.items()}
        start = time.perf_counter()
        run = self._prepare_fn(model, trials, Path(work_dir))
        prepare_seconds = time.perf_counter() - start
        start = time.perf_counter()
        outputs = run(inputs)
        call_seconds = time.perf_counter() - start
        self._call = lambda: run(inputs)
        # Runtime options the runner reads back after preparing (e.g. OpenVINO's precision).
        settings = {**process_settings(), **getattr(run, "settings", {})}
        return Prepared(os.getpid(), prepare_seconds, call_seconds,
                        tuple(np.asarray(o) for o in outputs),
                        tuple((k, str(v)) for k, v in settings.items()))

    def _prepared_call(self) -> Callable[[], list]:
        if self._call is None:
            raise RuntimeError("the runner was not prepared")
        return self._call

    def calibrate(self, target_seconds: float) -> int:
        return calls_per_sample(self._prepared_call(), target_seconds)

    def sample(self, calls: int) -> list[float]:
        return list(local_sampler(self._prepared_call())(calls))

    def outputs(self) -> tuple[np.ndarray, ...]:
        return tuple(np.asarray(o) for o in self._prepared_call()())


class InProcessRunner:
    """The handle interface without a process: the runner runs in the caller's process
    (and with its thread settings)."""

    def __init__(self, prepare_fn: Callable) -> None:
        self._local = LocalRunner(prepare_fn)
        self.pid = os.getpid()

    def prepare(self, model_bytes: bytes, trials: int, work_dir: Path, inputs,
                timeout: Optional[float] = None) -> Prepared:
        return self._local.prepare(model_bytes, trials, str(work_dir), dict(inputs))

    def calibrate(self, target_seconds: float) -> int:
        return self._local.calibrate(target_seconds)

    def sample(self, calls: int) -> list[float]:
        return self._local.sample(calls)

    def outputs(self) -> tuple[np.ndarray, ...]:
        return self._local.outputs()

    def close(self) -> None:
        pass


# ---- the pipe protocol ----------------------------------------------------------------------------
_HEADER = struct.Struct("<Q")


def _write_frame(stream, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_exact(fd: int, size: int, deadline: Optional[float]) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 22))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: Optional[float] = None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


def serve(reply_fd: int) -> None:
    """The worker's loop: answer (operation, args) requests on stdin with ("ok", result) or
    ("error", detail) on `reply_fd` until "quit" or the parent goes away. The "prepare"
    request carries the runner's pickled prepare function."""
    replies = os.fdopen(reply_fd, "wb")
    _write_frame(replies, ("ready", os.getpid()))  # imports done: requests are timed from here
    runner: Optional[LocalRunner] = None
    while True:
        try:
            operation, args = _read_frame(0)
        except EOFError:
            return
        if operation == "quit":
            _write_frame(replies, ("ok", None))
            return
        try:
            if operation == "prepare":
                prepare_fn, *rest = args
                runner = LocalRunner(pickle.loads(prepare_fn))
                args = rest
            if runner is None:
                raise RuntimeError(f"{operation} before prepare")
            reply = ("ok", getattr(runner, operation)(*args))
        except Exception as err:  # reported to the parent as the runner's failure
            traceback.print_exc()
            reply = ("error", error_line(err))
        _write_frame(replies, reply)


class WorkerError(RuntimeError):
    """A worker's runner raised, or the worker died or timed out; the message is the
    one-line detail for the report."""


class WorkerProcess:
    """The parent's handle on one runner in its own process (see the module docstring)."""

    # Seconds a fresh worker may take to import its packages (slow on a busy machine).
    STARTUP_SECONDS = 300.0

    def __init__(self, prepare_fn: Callable, threads: int, log_path: Path,
                 cpus: Optional[Sequence[int]] = None, timeout: float = 600.0,
                 environment: Optional[Mapping[str, str]] = None, name: str = "") -> None:
        import cloudpickle  # by value where needed: a closure, a test's or a script's runner

        self._prepare_fn = cloudpickle.dumps(prepare_fn)
        self.timeout = timeout  # seconds for any request but prepare, at least
        self.call_seconds = 0.0
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        env = {**os.environ, **thread_environment(threads), **(environment or {}),
               _CPUS_VAR: ",".join(map(str, cpus if cpus is not None else usable_cpus())),
               _PATH_VAR: json.dumps([os.path.abspath(p) if p else os.getcwd()
                                      for p in sys.path])}
        boot = f"# tvm_einweld bench worker {name}\n{_BOOT}"  # what `ps` shows
        self._proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=env)
        self.pid = self._proc.pid
        self._started = False

    def _wait_until_started(self) -> None:
        """The worker's "ready" frame: its imports are done (they may overlap other work)."""
        if self._started:
            return
        try:
            _read_frame(self._proc.stdout.fileno(), time.monotonic() + self.STARTUP_SECONDS)
        except TimeoutError:
            self.close(kill=True)
            raise WorkerError(f"worker did not start within {self.STARTUP_SECONDS:.0f} s")
        except (EOFError, OSError):
            raise WorkerError(f"worker exited with code {self._proc.wait()} while starting"
                              + self._log_tail())
        self._started = True

    def _log_tail(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines()
                     if line.strip()]
        except OSError:
            return ""
        return f"; log: {lines[-1].strip()[:200]}" if lines else ""

    def _request(self, operation: str, *args, timeout: Optional[float]) -> Any:
        self._wait_until_started()
        deadline = time.monotonic() + timeout if timeout is not None else None
        try:
            _write_frame(self._proc.stdin, (operation, args))
            reply = _read_frame(self._proc.stdout.fileno(), deadline)
        except TimeoutError:
            self.close(kill=True)
            raise WorkerError(f"worker timed out after {timeout:.0f} s during {operation}")
        except (EOFError, BrokenPipeError, OSError):
            code = self._proc.wait()
            raise WorkerError(f"worker exited with code {code} during {operation}"
                              + self._log_tail())
        if reply[0] == "error":
            raise WorkerError(reply[1])
        return reply[1]

    def _bounded(self, expected_seconds: float) -> float:
        return max(self.timeout, 20 * expected_seconds)

    def prepare(self, model_bytes: bytes, trials: int, work_dir: Path, inputs,
                timeout: Optional[float] = None) -> Prepared:
        prepared = self._request("prepare", self._prepare_fn, model_bytes, trials,
                                 str(work_dir), dict(inputs), timeout=timeout)
        self.call_seconds = prepared.call_seconds
        wait_until_quiet(self.pid)
        return prepared

    def calibrate(self, target_seconds: float) -> int:
        calls = self._request("calibrate", target_seconds,
                              timeout=self._bounded(self.call_seconds))
        wait_until_quiet(self.pid)
        return calls

    def sample(self, calls: int) -> list[float]:
        seconds = self._request("sample", calls,
                                timeout=self._bounded(calls * self.call_seconds))
        wait_until_quiet(self.pid)  # its pools stop spinning before the next runner's round
        return seconds

    def outputs(self) -> tuple[np.ndarray, ...]:
        outputs = self._request("outputs", timeout=self._bounded(self.call_seconds))
        wait_until_quiet(self.pid)
        return outputs

    def close(self, kill: bool = False) -> None:
        if self._proc.poll() is None and not kill:
            try:
                self._request("quit", timeout=10.0)
                self._proc.wait(timeout=10.0)
            except (WorkerError, subprocess.TimeoutExpired):
                pass
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout, self._log):
            try:
                stream.close()
            except OSError:
                pass

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
