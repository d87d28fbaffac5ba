"""What this machine can do: CPU, cores, memory, caches, and its measured compute and memory
peaks (numpy fp32 GEMM, and a large copy counted as bytes read + written, as STREAM's "copy").

One module serves everything that needs these numbers: the eOperator cost estimate, the
benchmarks' roofline and machine line. Measuring takes a few seconds, so the result is cached
on disk under `cache_dir()` per (CPU model, CPU count, numpy version); a measurement taken
while the machine was busy is used once but not cached, since its peaks read low.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

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
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def usable_cpus() -> List[int]:
    """The CPUs this process may be scheduled on: the cgroup's cpuset where there is one,
    else the online CPUs. Not the calling thread's affinity mask, which TVM's thread pool
    narrows to one CPU when it starts."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            return _parse_cpu_list(Path(path).read_text())
        except (OSError, ValueError):
            continue
    return list(range(os.cpu_count() or 1))


def _parse_cpu_list(text: str) -> List[int]:
    cpus: List[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    if not cpus:
        raise ValueError("empty CPU list")
    return cpus


def physical_cores() -> int:
    """Physical cores among `usable_cpus()` (SMT siblings counted once), from the kernel's
    CPU topology; the usable CPU count where topology is not readable."""
    allowed = usable_cpus()
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(),
                       (topo / "core_id").read_text().strip()))
        except OSError:
            return len(allowed)
    return max(1, len(cores))


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def cache_sizes() -> Dict[str, int]:
    """Data/unified cache sizes in bytes by level name ("L1", "L2", "L3") from sysfs."""
    sizes: Dict[str, int] = {}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for entry in sorted(root.glob("index*")) if root.exists() else []:
        try:
            if (entry / "type").read_text().strip() == "Instruction":
                continue
            level = (entry / "level").read_text().strip()
            text = (entry / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
        sizes[f"L{level}"] = int(text.rstrip("KM")) * unit
    return sizes


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


def best_seconds(fn: Callable[[], object], repeats: int = 5, min_time: float = 0.01,
                 budget: float = 2.0) -> float:
    """The fastest of `repeats` samples of `fn` (each looped for at least `min_time`), with
    fewer samples once they have taken `budget` seconds in all.

    The minimum, not the median: other processes on a shared machine only ever add time, and
    a peak or a cached kernel time must not keep one unlucky sample. The budget matters for
    untuned kernels that take seconds per call, where one sample is already precise.
    """
    fn()  # warm up: page faults, BLAS thread start
    best, spent = float("inf"), 0.0
    for _ in range(repeats):
        loops, start = 0, time.perf_counter()
        while True:
            fn()
            loops += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        best = min(best, elapsed / loops)
        spent += elapsed
        if spent >= budget:
            break
    return best


# --- measured decisions, kept on disk ------------------------------------------------------

TIMES_FILE = "op_times.json"


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
        stored = _load_times()
        if key in stored:
            _TIMES[key] = stored[key]
        else:
            _TIMES[key] = measure()
            _store_time(key, _TIMES[key])
    return _TIMES[key]


def _load_times() -> Dict[str, object]:
    try:
        return json.loads((cache_dir() / TIMES_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _store_time(key: str, value: object) -> None:
    import tempfile  # pylint: disable=import-outside-toplevel

    stored = _load_times()  # re-read: other processes may have added entries
    stored[key] = value
    path = cache_dir() / TIMES_FILE
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

    @property
    def copy_bandwidth(self) -> float:
        """Bytes per second (read + write) of a large copy."""
        return self.copy_gbs * 1e9

    @property
    def sgemm_flops(self) -> float:
        return self.sgemm_gflops * 1e9

    @property
    def measured_under_load(self) -> bool:
        """Other processes were using at least half the CPUs: the peaks read low."""
        return is_busy(self.load_at_measurement, self.logical_cpus)

    def describe(self) -> str:
        text = (f"{self.cpu_model}, {self.logical_cpus} logical CPUs, "
                f"{self.memory_gib:.0f} GiB; measured peaks: sgemm {self.sgemm_gflops:.0f} "
                f"GFLOP/s (numpy), copy {self.copy_gbs:.1f} GB/s (read+write)")
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
    )


def describe_machine(cache_dir_: Optional[Path] = None, refresh: bool = False) -> MachineInfo:
    """The measured description of this machine, from the disk cache when it matches.

    A measurement taken while the machine was busy is used once but not cached.
    """
    cache = Path(cache_dir_ or cache_dir()) / "machine.json"
    key = {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count() or 1,
           "numpy_version": np.__version__}
    if not refresh and cache.exists():
        try:
            data = json.loads(cache.read_text())
            if all(data.get(k) == v for k, v in key.items()):
                return MachineInfo(**data)
        except (ValueError, TypeError):
            pass  # unreadable or from an older layout: measure again
    info = measure_machine()
    if not info.measured_under_load:
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
