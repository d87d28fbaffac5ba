"""What this machine can do: CPU, cores, memory, caches, and its measured compute and memory
peaks (numpy fp32 GEMM, and a large copy counted as bytes read + written, as STREAM's "copy").

One module serves everything that needs these numbers: the eOperator cost estimate, the
benchmarks' roofline and machine line. Measuring takes a few seconds, so the result is cached
on disk under `cache_dir()` per (CPU model, CPU count, numpy version); a measurement taken
while the machine was busy is used once but not cached, since its peaks read low.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import numpy as np


def cache_dir() -> Path:
    """`$TVM_EINWELD_CACHE`, else `$XDG_CACHE_HOME/tvm_einweld`, else `~/.cache/tvm_einweld`."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvm_einweld"
    path = Path(os.environ.get("TVM_EINWELD_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """How many CPUs this process may run on (`usable_cpus()`, SMT siblings included)."""
    return len(usable_cpus())


def usable_cpus() -> List[int]:
    """The CPUs this process may be scheduled on: the online CPUs within the cgroup's cpuset
    (all online CPUs where there is no cpuset). Not the calling thread's affinity mask, which
    TVM's thread pool narrows to one CPU when it starts. The one definition: the threads
    module, the benchmark harness and the pipeline's target all read it."""
    try:
        cpus = _parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text())
    except (OSError, ValueError):
        cpus = list(range(os.cpu_count() or 1))
    try:
        allowed = set(_parse_cpu_list(Path("/sys/fs/cgroup/cpuset.cpus.effective").read_text()))
        cpus = [c for c in cpus if c in allowed] or cpus
    except (OSError, ValueError):
        pass
    return cpus


def _parse_cpu_list(text: str) -> List[int]:
    """The kernel's CPU list format: "0-3,6,8-9" (a trailing newline or empty part is fine)."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    if not cpus:
        raise ValueError("empty CPU list")
    return cpus


def physical_cores(cpus: Optional[Sequence[int]] = None) -> int:
    """Physical cores among `cpus` (default `usable_cpus()`): distinct (package, core) pairs
    of the kernel's CPU topology, so SMT siblings count once; a CPU whose topology is not
    readable counts as a core of its own. At least 1."""
    cores = set()
    for cpu in usable_cpus() if cpus is None else cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def memory_bytes() -> int:
    """Physical memory in bytes (the kernel's total RAM, as /proc/meminfo's MemTotal)."""
    import psutil  # pylint: disable=import-outside-toplevel

    return psutil.virtual_memory().total


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


@dataclass(frozen=True)
class CacheLevel:
    """One data or unified cache of a CPU, as sysfs describes it."""

    level: int
    size: int  # bytes, the whole cache
    line: int  # coherency line size, bytes
    sharers: int  # CPUs that share it
    ways: int = 0  # associativity (0: sysfs does not say)

    @property
    def per_core(self) -> int:
        """What one core may count on: the whole cache for L1 and L2 (SMT siblings share a
        core's private caches, and they are still one core's), a share of a last-level cache
        the cores divide."""
        return self.size // max(1, self.sharers) if self.level >= 3 else self.size


def cpu_caches(cpu: int = 0) -> Dict[int, CacheLevel]:
    """{level: CacheLevel} for the data/unified caches of `cpu`, from sysfs; entries sysfs
    does not describe completely are left out (none at all off Linux)."""
    caches: Dict[int, CacheLevel] = {}
    root = Path(f"/sys/devices/system/cpu/cpu{cpu}/cache")
    for entry in sorted(root.glob("index*")) if root.exists() else []:
        try:
            if (entry / "type").read_text().strip() == "Instruction":
                continue
            level = int((entry / "level").read_text())
            text = (entry / "size").read_text().strip().upper()
            line = int((entry / "coherency_line_size").read_text())
        except (OSError, ValueError):
            continue
        unit = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
        try:
            sharers = len(_parse_cpu_list((entry / "shared_cpu_list").read_text()))
        except (OSError, ValueError):
            sharers = 1
        try:
            ways = int((entry / "ways_of_associativity").read_text())
        except (OSError, ValueError):
            ways = 0
        caches[level] = CacheLevel(level, int(text.rstrip("KM")) * unit, line, sharers, ways)
    return caches


def cache_sizes() -> Dict[str, int]:
    """Data/unified cache sizes in bytes by level name ("L1", "L2", "L3") from sysfs."""
    return {f"L{level}": cache.size for level, cache in cpu_caches().items()}


def load_average() -> Optional[float]:
    """1-minute load average: other processes on a shared machine skew every timing."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def is_busy(load: Optional[float], logical_cpus: Optional[int] = None) -> bool:
    """Other processes were using at least half the CPUs: timings taken now read slow, so
    they are not worth caching."""
    cpus = logical_cpus if logical_cpus is not None else (os.cpu_count() or 1)
    return load is not None and load >= 0.5 * cpus


def fastest(samples: Iterable[float]) -> float:
    """The statistic of every time the package compares or caches (a kernel's cost in the
    pipeline, a tuning candidate's run time, a machine peak): the fastest sample.

    The minimum, not the median: other processes on a shared machine only ever add time, so
    the fastest sample is the closest to the kernel's own time, and a cached time must not
    keep one unlucky sample. (Paired comparisons add a sign test over alternating rounds,
    `tir_passes.measure.compare_modules`; benchmarks report medians, `bench.timing`, since
    they report what a user sees rather than choose.)"""
    return min(samples)


def best_seconds(fn: Callable[[], object], repeats: int = 5, min_time: float = 0.01,
                 budget: float = 2.0) -> float:
    """Seconds per call of `fn`: the `fastest` of `repeats` samples (each the mean of
    back-to-back calls looped for at least `min_time`), with fewer samples once they have
    taken `budget` seconds in all. The budget matters for untuned kernels that take seconds
    per call, where one sample is already precise."""
    fn()  # warm up: page faults, BLAS thread start
    samples, spent = [], 0.0
    for _ in range(repeats):
        loops, start = 0, time.perf_counter()
        while True:
            fn()
            loops += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / loops)
        spent += elapsed
        if spent >= budget:
            break
    return fastest(samples)


# --- measured decisions, kept on disk ------------------------------------------------------

TIMES_FILE = "op_times.json"
DECISIONS_VAR = "TVM_EINWELD_DECISIONS"
DECISIONS_FILE = "decisions.json"  # in a benchmark's work dir (`own_decisions`)


def decisions_file() -> Path:
    """Where `cached` keeps measured decisions: `$TVM_EINWELD_DECISIONS`, else TIMES_FILE in
    `cache_dir()` (beside the measured machine facts, which it does not replace)."""
    path = os.environ.get(DECISIONS_VAR)
    return Path(path) if path else cache_dir() / TIMES_FILE


@contextlib.contextmanager
def own_decisions(work_dir: Path) -> Iterator[Path]:
    """Within the block, this process and the processes it starts keep measured decisions in
    `work_dir` (a benchmark's; file DECISIONS_FILE), unless `$TVM_EINWELD_DECISIONS` names a
    file already: a benchmark then compiles with decisions made in its own runs, not ones
    stored by earlier processes of the same code version under other conditions (a heavy
    load, or an experiment that swapped a schedule rule); a resumed run finds its own again.
    Yields the file used; the environment is restored after the block."""
    before = os.environ.get(DECISIONS_VAR)
    if not before:
        work_dir.mkdir(parents=True, exist_ok=True)
        os.environ[DECISIONS_VAR] = str(work_dir / DECISIONS_FILE)
        _TIMES.clear()
    try:
        yield decisions_file()
    finally:
        if not before:
            os.environ.pop(DECISIONS_VAR, None)
            _TIMES.clear()


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The package version and a digest of its source: measured decisions depend on the
    kernels the code generates, which change with the code, also between releases of an
    editable install. Every key of `cached` starts with it."""
    import hashlib  # pylint: disable=import-outside-toplevel

    from . import __version__  # pylint: disable=import-outside-toplevel

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


_TIMES: Dict[str, object] = {}


def cached(key: str, measure: Callable[[], object]) -> object:
    """`measure()`'s result (JSON-able: seconds, or a list of them) for `key`, measured once
    and kept in memory and on disk under `cache_dir()`. A time is kept whatever the machine's
    load when it was taken, so the same model compiles to the same program next time (on 2
    cores the load is rarely below 1, and a dropped time would be measured again, differently).
    Keys name what was timed, the target and the package version (callers build them)."""
    if key not in _TIMES:
        # One read brings in every stored decision, so later keys are found in memory (the
        # file holds thousands of entries; reading it per key cost ~25 ms each). A key still
        # missing is looked up on disk again first: another process may have stored it since.
        for stored_key, value in _load_times().items():
            _TIMES.setdefault(stored_key, value)
        if key not in _TIMES:
            _TIMES[key] = measure()
            _store_time(key, _TIMES[key])
    return _TIMES[key]


def cached_all(items: Dict[str, object], measure_all: Callable[[list], list]) -> None:
    """`cached` for several keys at once: `measure_all(things)` measures, in one go, the
    things (`items[key]`) whose keys hold nothing yet, and each result is kept under its key
    (e.g. kernels built together and timed in alternating rounds)."""
    if any(key not in _TIMES for key in items):
        for stored_key, value in _load_times().items():
            _TIMES.setdefault(stored_key, value)
    missing = {key: thing for key, thing in items.items() if key not in _TIMES}
    if missing:
        for key, value in zip(missing, measure_all(list(missing.values()))):
            cached(key, lambda value=value: value)


def cached_value(key: str) -> Optional[object]:
    """The value `cached` holds for `key` (in memory or on disk), or None: nothing measured."""
    if key not in _TIMES:
        for stored_key, value in _load_times().items():
            _TIMES.setdefault(stored_key, value)
    return _TIMES.get(key)


def _load_times() -> Dict[str, object]:
    try:
        return json.loads(decisions_file().read_text())
    except (OSError, ValueError):
        return {}


def _store_time(key: str, value: object) -> None:
    import tempfile  # pylint: disable=import-outside-toplevel

    stored = _load_times()  # re-read: other processes may have added entries
    stored[key] = value
    path = decisions_file()
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(stored, fh, indent=0, sort_keys=True)
    os.replace(tmp, path)


def measure_sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    out = np.empty((n, n), np.float32)
    return 2.0 * n**3 / best_seconds(lambda: np.matmul(a, b, out=out), repeats) / 1e9


def measure_copy_gbs(mib: int = 256, repeats: int = 5) -> float:
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    return 2.0 * src.nbytes / best_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


def measure_numpy_copy_bandwidth(nbytes: int, min_seconds: float = 0.05) -> float:
    """Bytes/s (read + written) of np.copyto between two buffers of `nbytes` each: the best of
    runs of 8 copies, repeated for at least `min_seconds` and 3 runs. At cache sizes numpy's
    per-call overhead dominates, so there the figure is a lower bound."""
    src = np.ones(max(1, nbytes // 4), dtype="float32")
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while time.perf_counter() - start < min_seconds or reps < 3:
        t0 = time.perf_counter()
        for _ in range(8):
            np.copyto(dst, src)
        best = min(best, (time.perf_counter() - t0) / 8)
        reps += 1
    return 2 * src.nbytes / best


BANDWIDTH_FILE = "cpu_bandwidth.json"


def level_copy_bandwidths(working_sets: Dict[str, int], key: str) -> Dict[str, float]:
    """{name: bytes/s} of a numpy copy whose working set is `working_sets[name]` bytes (two
    buffers of a quarter of it each), measured once per machine: the figures are kept under
    `cache_dir()` in BANDWIDTH_FILE with `key` (the caller names the cache sizes and cores it
    probed), and a different key measures again."""
    path = cache_dir() / BANDWIDTH_FILE
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored["bandwidth"]
    except (OSError, ValueError, KeyError):
        pass
    bandwidth = {name: measure_numpy_copy_bandwidth(max(4096, size // 4))
                 for name, size in working_sets.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "bandwidth": bandwidth}, indent=1))
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return bandwidth


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str
    logical_cpus: int
    memory_gib: float
    sgemm_gflops: float  # numpy fp32 matmul, best of several
    copy_gbs: float  # large copy, (read + write) bytes per second, best of several
    numpy_version: str
    measured_at: str  # UTC ISO time of the measurement
    load_at_measurement: Optional[float] = None  # 1-min load average just before measuring
    caches: Dict[str, int] = field(default_factory=dict)  # bytes by level name
    # fp32 FMA peak of every physical core (the C probe, `measure_fma_peak`); None where
    # gcc with OpenMP is missing
    fma_gflops: Optional[float] = None

    @property
    def copy_bandwidth(self) -> float:
        """Bytes per second (read + write) of a large copy."""
        return self.copy_gbs * 1e9

    @property
    def sgemm_flops(self) -> float:
        return self.sgemm_gflops * 1e9

    @property
    def peak_gflops(self) -> float:
        """The compute ceiling: the FMA peak where the probe ran, else numpy's sgemm (which
        reads 45 % of the FMA peak on a Zen 5 with its bundled OpenBLAS: no ceiling for
        kernels that reach 90 % of it)."""
        return self.fma_gflops or self.sgemm_gflops

    @property
    def peak_flops(self) -> float:
        return self.peak_gflops * 1e9

    @property
    def measured_under_load(self) -> bool:
        """Other processes were using at least half the CPUs: the peaks read low."""
        return is_busy(self.load_at_measurement, self.logical_cpus)

    def describe(self) -> str:
        fma = f"FMA {self.fma_gflops:.0f} GFLOP/s (fp32, every core), " \
            if self.fma_gflops else "FMA not measured (no gcc with OpenMP), "
        text = (f"{self.cpu_model}, {self.logical_cpus} logical CPUs, "
                f"{self.memory_gib:.0f} GiB; measured peaks: {fma}sgemm "
                f"{self.sgemm_gflops:.0f} GFLOP/s (numpy), copy {self.copy_gbs:.1f} GB/s "
                "(read+write)")
        if self.measured_under_load:
            text += f" (measured under load {self.load_at_measurement:.1f}: peaks read low)"
        return text


def measure_machine() -> MachineInfo:
    load = load_average()
    return MachineInfo(
        cpu_model=cpu_model(),
        logical_cpus=os.cpu_count() or 1,
        memory_gib=memory_gib(),
        sgemm_gflops=measure_sgemm_gflops(),
        copy_gbs=measure_copy_gbs(),
        numpy_version=np.__version__,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        load_at_measurement=load,
        caches=cache_sizes(),
        fma_gflops=getattr(measure_fma_peak(physical_cores()), "gflops", None),
    )


def describe_machine(cache_dir_: Optional[Path] = None, refresh: bool = False) -> MachineInfo:
    """The measured description of this machine, from the disk cache when it matches.

    A measurement taken while the machine was busy is cached too (it says so in `describe`,
    and `refresh=True` measures again): a figure that moved from one process to the next would
    move the choices made with it.
    """
    cache = Path(cache_dir_ or cache_dir()) / "machine.json"
    key = {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count() or 1,
           "numpy_version": np.__version__}
    if not refresh and cache.exists():
        try:
            data = json.loads(cache.read_text())
            # A description from before the FMA probe lacks the ceiling: measure again.
            if all(data.get(k) == v for k, v in key.items()) and "fma_gflops" in data:
                return MachineInfo(**data)
        except (ValueError, TypeError):
            pass  # unreadable or from an older layout: measure again
    info = measure_machine()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(dataclasses.asdict(info), indent=1))
    return info


_PROFILE: Optional[MachineInfo] = None


def profile(refresh: bool = False) -> MachineInfo:
    """This machine's description, measured once per process (and cached on disk)."""
    global _PROFILE
    if _PROFILE is None or refresh:
        _PROFILE = describe_machine(refresh=refresh)
    return _PROFILE


# ---- native probes: the FMA peak and a multi-threaded copy -------------------------------------
# fma: independent chains of vector FMAs per thread, enough in flight to cover the FMA latency
# times the FMA ports (4 cycles x 2 ports on recent Intel and AMD cores needs 8), none dependent
# on another, so the loop runs at the FMA throughput. gcc -O2 -march=native picks AVX-512 where
# the CPU has it (16 lanes), else AVX2 + FMA (8 lanes).
# copy: every thread memcpy's its own source into its own destination (both first touched by
# that thread) over and over; bytes read + written per second, as STREAM's "copy".
_PROBE_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define ISA "avx512"
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
static float hsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vec;
#define LANES 8
#define ISA "avx2"
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
static float hsum(vec v) { float t[8]; _mm256_storeu_ps(t, v); float s = 0;
                           for (int i = 0; i < 8; i++) s += t[i]; return s; }
#endif
#define CHAINS 12
#define STEP(i) acc##i = FMA(acc##i, a, b);

static double fma_run(int threads, long iters, float *sink) {
  double start = omp_get_wtime();
  float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const vec a = SET1(0.999999f), b = SET1(1e-6f);
    float seed = (float)omp_get_thread_num();
    vec acc0 = SET1(seed), acc1 = SET1(seed + 1), acc2 = SET1(seed + 2), acc3 = SET1(seed + 3),
        acc4 = SET1(seed + 4), acc5 = SET1(seed + 5), acc6 = SET1(seed + 6),
        acc7 = SET1(seed + 7), acc8 = SET1(seed + 8), acc9 = SET1(seed + 9),
        acc10 = SET1(seed + 10), acc11 = SET1(seed + 11);
    for (long n = 0; n < iters; n++) {
      STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
      STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)
    }
    total += hsum(acc0) + hsum(acc1) + hsum(acc2) + hsum(acc3) + hsum(acc4) + hsum(acc5)
           + hsum(acc6) + hsum(acc7) + hsum(acc8) + hsum(acc9) + hsum(acc10) + hsum(acc11);
  }
  *sink += total;
  return omp_get_wtime() - start;
}

/* Seconds for `loops` copies of `bytes` per thread (buffers made and touched outside the
   timed part, by the thread that copies them). */
static double copy_run(int threads, size_t bytes, long loops, float *sink) {
  double seconds = 0.0;
#pragma omp parallel num_threads(threads)
  {
    char *src = aligned_alloc(64, bytes), *dst = aligned_alloc(64, bytes);
    memset(src, 1, bytes);
    memset(dst, 0, bytes);
    memcpy(dst, src, bytes);
#pragma omp barrier
    double start = omp_get_wtime();
    for (long n = 0; n < loops; n++) {
      memcpy(dst, src, bytes);
      __asm__ volatile("" : : "r"(dst) : "memory");
    }
#pragma omp barrier
#pragma omp master
    { seconds = omp_get_wtime() - start; *sink += dst[bytes - 1]; }
    free(src);
    free(dst);
  }
  return seconds;
}

/* Nanoseconds per round trip of one cache line between two threads (thread 0 writes an odd
   value and waits for the next even one, thread 1 answers): the latency every fork/join of a
   thread pool pays, which depends on where the two threads' cores sit. */
static void wait_for(volatile long *word, long value) {
  /* Spin, then yield: two threads sharing one CPU (a CPU quota) take turns instead of
     burning whole time slices. */
  for (long spins = 0; __atomic_load_n(word, __ATOMIC_ACQUIRE) != value; spins++) {
    if (spins < 4096) _mm_pause(); else sched_yield();
  }
}

static double round_trip_run(long trips) {
  static volatile long line[16] __attribute__((aligned(64)));
  line[0] = 0;
  double seconds = 0.0;
#pragma omp parallel num_threads(2)
  {
    int me = omp_get_thread_num();
#pragma omp barrier
    double start = omp_get_wtime();
    for (long n = 0; n < trips; n++) {
      if (me == 0) {
        __atomic_store_n(&line[0], 2 * n + 1, __ATOMIC_RELEASE);
        wait_for(&line[0], 2 * n + 2);
      } else {
        wait_for(&line[0], 2 * n + 1);
        __atomic_store_n(&line[0], 2 * n + 2, __ATOMIC_RELEASE);
      }
    }
#pragma omp master
    seconds = omp_get_wtime() - start;
  }
  return seconds / (double)trips * 1e9;
}

/* Seconds to read `bytes` that thread 0 has just written, read by thread `reader` (0: the
   writer itself; 1: the other thread): the hand-off between two kernels whose parallel loops
   split the same tensor differently. The best of `loops` hand-offs. */
static double handoff_run(size_t bytes, int reader, long loops, float *sink) {
  float *buf = aligned_alloc(64, bytes);
  size_t n = bytes / sizeof(float);
  memset(buf, 0, bytes);
  double best = 1e30;
#pragma omp parallel num_threads(2)
  {
    int me = omp_get_thread_num();
    for (long l = 0; l < loops; l++) {
      if (me == 0)
        for (size_t i = 0; i < n; i += LANES) *(vec *)(buf + i) = SET1((float)l);
#pragma omp barrier
      if (me == reader) {
        double start = omp_get_wtime();
        const vec one = SET1(1.0f);  /* four independent sums: the adds keep up with loads */
        vec a0 = SET1(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i + 4 * LANES <= n; i += 4 * LANES) {
          a0 = FMA(*(vec *)(buf + i), one, a0);
          a1 = FMA(*(vec *)(buf + i + LANES), one, a1);
          a2 = FMA(*(vec *)(buf + i + 2 * LANES), one, a2);
          a3 = FMA(*(vec *)(buf + i + 3 * LANES), one, a3);
        }
        double t = omp_get_wtime() - start;
        *sink += hsum(a0) + hsum(a1) + hsum(a2) + hsum(a3);
        if (t < best) best = t;
      }
#pragma omp barrier
    }
  }
  free(buf);
  return best;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  int threads = atoi(argv[2]), repeats = atoi(argv[4]);
  double seconds = atof(argv[3]), best = 0.0;
  float sink = 0.0f;
  if (argv[1][0] == 'r') {  /* round trips: the median of `repeats` runs (a state, not a peak) */
    double runs[64];
    long trips = 100;
    if (repeats > 64) repeats = 64;
    while (round_trip_run(trips) * trips * 1e-9 < 0.2 * seconds) trips *= 2;
    for (int r = 0; r < repeats; r++) runs[r] = round_trip_run(trips);
    qsort(runs, repeats, sizeof(double), cmp_double);
    best = runs[repeats / 2];
  } else if (argv[1][0] == 'h') {  /* hand-off: GB/s read by the writer, by the other */
    size_t step = 4 * LANES * sizeof(float);  /* the read loop's four vectors */
    size_t bytes = ((size_t)atoll(argv[5]) + step - 1) / step * step;
    double own = handoff_run(bytes, 0, repeats, &sink);
    double other = handoff_run(bytes, 1, repeats, &sink);
    printf("%f %f %s %g\n", bytes / own / 1e9, bytes / other / 1e9, ISA, (double)sink);
    return 0;
  } else if (argv[1][0] == 'f') {
    long iters = 1L << 16;
    while (fma_run(threads, iters, &sink) < 0.2 * seconds) iters *= 2;  /* calibrate */
    for (int r = 0; r < repeats; r++) {
      double t = fma_run(threads, iters, &sink);
      double gflops = 2.0 * LANES * CHAINS * (double)iters * threads / t / 1e9;
      if (gflops > best) best = gflops;
    }
  } else {
    size_t bytes = (size_t)atoll(argv[5]) / 2 / threads;  /* per thread and buffer */
    bytes = (bytes + 63) / 64 * 64;
    long loops = 1;
    while (copy_run(threads, bytes, loops, &sink) < 0.2 * seconds) loops *= 2;
    for (int r = 0; r < repeats; r++) {
      double t = copy_run(threads, bytes, loops, &sink);
      double gbs = 2.0 * bytes * threads * (double)loops / t / 1e9;
      if (gbs > best) best = gbs;
    }
  }
  printf("%f %s %g\n", best, ISA, (double)sink);
  return 0;
}
"""

_PROBE_BINARY: Optional[Path] = None


def _native_probe(*args: object) -> Optional[List[str]]:
    """Run the C probe (compiled with gcc on first use); None where gcc or OpenMP is missing."""
    import subprocess
    import tempfile

    global _PROBE_BINARY
    if _PROBE_BINARY is None or not _PROBE_BINARY.exists():
        folder = Path(tempfile.mkdtemp(prefix="einweld_probe_"))
        source, binary = folder / "probe.c", folder / "probe"
        source.write_text(_PROBE_C)
        for flags in (["-march=native"], ["-mavx2", "-mfma"]):
            try:
                subprocess.run(["gcc", "-O2", *flags, "-fopenmp", str(source), "-o", str(binary)],
                               check=True, capture_output=True, timeout=120)
                break
            except (OSError, subprocess.SubprocessError):
                continue
        else:
            return None
        _PROBE_BINARY = binary
    threads = int(args[1])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "false"}
    try:
        return subprocess.run([str(_PROBE_BINARY), *map(str, args)], check=True,
                              capture_output=True, text=True, env=env, timeout=600
                              ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass(frozen=True)
class FmaPeak:
    gflops: float  # fp32 GFLOP/s (an FMA counts 2), the best of several runs
    threads: int
    isa: str  # "avx512" or "avx2"


def measure_fma_peak(threads: int = 1, seconds: float = 0.2, repeats: int = 5
                     ) -> Optional[FmaPeak]:
    """The fp32 FMA throughput of `threads` cores: a C loop of independent vector FMAs per
    thread (OpenMP). Unlike `measure_sgemm_gflops` (numpy's BLAS, well under the peak on some
    machines) this is the ceiling every GEMM-class kernel is held against. Best of `repeats`
    runs of about `seconds` each; like every peak, it reads low on a busy machine. None where
    gcc or OpenMP is missing."""
    out = _native_probe("fma", threads, seconds, repeats)
    return FmaPeak(float(out[0]), threads, out[1]) if out else None


def measure_round_trip_ns(seconds: float = 0.02, repeats: int = 5) -> Optional[float]:
    """Nanoseconds for one cache line to go from one thread to another and back (two OpenMP
    threads, unpinned as TVM's pool runs them; the median of `repeats` runs of about
    `seconds`). Every fork/join of a thread pool pays it, so it bounds how fast a model of
    many short parallel kernels can run; on a VM it changes with where the host places the
    virtual CPUs (measured on the 2-vCPU Zen 5: ~50 ns in one state, ~400 ns in another, for
    minutes, while an FMA loop and numpy's sgemm ran at full speed), which is why the
    benchmarks record it beside each row. None without gcc/OpenMP or on a machine with one
    usable CPU; a process confined to one CPU reads the time the two threads take turns."""
    if len(usable_cpus()) < 2:
        return None
    out = _native_probe("round-trip", 2, seconds, repeats)
    if not out:
        return None
    _ROUND_TRIPS.append(float(out[0]))
    return float(out[0])


_ROUND_TRIPS: List[float] = []  # every round trip this process measured


@dataclass(frozen=True)
class Handoff:
    """GB/s of a read of `kib` KiB that one thread has just written: by the writer itself,
    and by another thread (`measure_handoff`)."""

    kib: int
    own_gbs: float
    other_gbs: float


def measure_handoff(kib: int, repeats: int = 50) -> Optional[Handoff]:
    """How fast a buffer one thread has just written is read by that thread and by another
    (two OpenMP threads, unpinned as TVM's pool runs them; the best of `repeats` hand-offs
    each). Two kernels in a row whose parallel loops give a tensor's parts to different
    cores pay the second figure where the first could have been had
    (`tir_passes.rules.cpu.affinity`). None without gcc/OpenMP or with one usable CPU."""
    if len(usable_cpus()) < 2:
        return None
    out = _native_probe("handoff", 2, 0.0, repeats, kib * 1024)
    if not out:
        return None
    return Handoff(kib, float(out[0]), float(out[1]))


def fastest_round_trip_ns() -> Optional[float]:
    """The fastest round trip (`measure_round_trip_ns`) this process has measured: the
    machine's fast phase, as far as this process knows it."""
    return min(_ROUND_TRIPS, default=None)


def in_slow_phase(*trips: Optional[float], factor: float = 2.0) -> bool:
    """Whether any of `trips` is over `factor` times the fastest this process has measured
    (the cores sat apart while it was taken; `slow_round_trips` applies the same test to a
    finished run's rows)."""
    floor = fastest_round_trip_ns()
    return floor is not None and any(_apart(t, floor, factor) for t in trips)


def _apart(trip: Optional[float], floor: float, factor: float) -> bool:
    """A round trip over `factor` times the fastest: taken with the cores sat apart."""
    return trip is not None and trip > factor * floor


def await_fast_phase(timeout: float = 120.0, poll: float = 3.0, factor: float = 2.0
                     ) -> Optional[float]:
    """Measure the round trip every `poll` seconds until one is within `factor` times the
    fastest this process has measured; that round trip, or None after `timeout` seconds (the
    VM host keeps a placement for minutes, so a benchmark waits a while, then goes on; a
    wait that runs out is recorded, so that `bench.timing.time_in_fast_phase` does not wait
    again until the fast phase shows, `fast_phase_gone`)."""
    deadline = time.monotonic() + timeout
    while True:
        trip = measure_round_trip_ns()
        if trip is None or not in_slow_phase(trip, factor=factor):
            return trip
        if time.monotonic() + poll > deadline:
            _WAITED_IN_VAIN.append(len(_ROUND_TRIPS))
            return None
        time.sleep(poll)


_WAITED_IN_VAIN: List[int] = []  # len(_ROUND_TRIPS) when an `await_fast_phase` ran out


def fast_phase_gone(factor: float = 2.0) -> bool:
    """Whether the last `await_fast_phase` ran out and no round trip measured since came
    within `factor` times the fastest. A benchmark then times its rows without waiting
    (flagged) until the fast phase shows again: one fast reading early in a run had set a
    floor the VM did not return to, and every later row waited its two minutes in vain
    (a kernels run stalled at row 70 of 97)."""
    if not _WAITED_IN_VAIN:
        return False
    floor = fastest_round_trip_ns()
    return floor is not None and all(_apart(t, floor, factor)
                                     for t in _ROUND_TRIPS[_WAITED_IN_VAIN[-1]:])


def row_round_trips(rows: Iterable[Iterable[Optional[float]]]) -> List[Optional[float]]:
    """Each row's slowest round trip among those measured around it (before and after its
    rounds; None where none was measured): the figure a report shows and flags."""
    return [max((t for t in row if t is not None), default=None) for row in rows]


def slow_round_trips(values: Sequence[Optional[float]], factor: float = 2.0) -> List[int]:
    """Indices of the round trips (`measure_round_trip_ns`, None: not measured) more than
    `factor` times the fastest among them: rows timed while the machine's cores were far
    apart, which a report flags (`in_slow_phase`: the same test while a run goes on)."""
    known = [v for v in values if v is not None]
    if not known:
        return []
    floor = min(known)
    return [i for i, v in enumerate(values) if _apart(v, floor, factor)]


def measure_native_copy_gbs(nbytes: int, threads: int = 1, seconds: float = 0.05,
                            repeats: int = 5) -> Optional[float]:
    """GB/s (read + written) of `threads` threads each memcpy'ing its share of a working set
    of `nbytes` (half source, half destination) in C: the bandwidth of the memory level such a
    working set lives in (L2 where it fits the cores' L2). `measure_copy_gbs` is one thread
    of numpy on 256 MiB; at cache sizes numpy's per-call overhead dominates and one thread
    cannot show what several cores' caches deliver. Best of `repeats`; None without gcc."""
    out = _native_probe("copy", threads, seconds, repeats, int(nbytes))
    return float(out[0]) if out else None
