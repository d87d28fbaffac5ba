"""What machine a benchmark ran on: CPU, cores, and its measured compute and memory peaks.

The peaks are measured, not looked up: fp32 GEMM with numpy's BLAS (the best a library
reaches here) and a large array copy (counted as bytes read + bytes written, as STREAM's
"copy" does). They are the roofline every model is measured against. Measuring takes a few
seconds, so the result is cached on disk per (CPU model, CPU count, numpy version).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvm_einweld"


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

    @property
    def measured_under_load(self) -> bool:
        """Other processes were using at least half the CPUs: the peaks read low."""
        return self.load_at_measurement is not None and \
            self.load_at_measurement >= 0.5 * self.logical_cpus

    def describe(self) -> str:
        text = (f"{self.cpu_model}, {self.logical_cpus} logical CPUs, "
                f"{self.memory_gib:.0f} GiB; measured peaks: sgemm {self.sgemm_gflops:.0f} "
                f"GFLOP/s (numpy), copy {self.copy_gbs:.1f} GB/s (read+write)")
        if self.measured_under_load:
            text += f" (measured under load {self.load_at_measurement:.1f}: peaks read low)"
        return text


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, BLAS thread start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_sgemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    out = np.empty((n, n), np.float32)
    return 2.0 * n**3 / _best_seconds(lambda: np.matmul(a, b, out=out), repeats) / 1e9


def measure_copy_gbs(mib: int = 256, repeats: int = 5) -> float:
    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    return 2.0 * src.nbytes / _best_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


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
    )


def describe_machine(cache_dir: Optional[Path] = None, refresh: bool = False) -> MachineInfo:
    """The measured description of this machine, from the disk cache when it matches.

    A measurement taken while the machine was busy is used once but not cached.
    """
    cache = Path(cache_dir or DEFAULT_CACHE) / "machine.json"
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


def load_average() -> Optional[float]:
    """1-minute load average: other processes on a shared machine skew every timing."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
