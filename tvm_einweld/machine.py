"""What this machine can do: measured copy bandwidth and sgemm peak, cache sizes.

Several parts need the same numbers (the eOperator cost estimate, the CPU memory hierarchy of
the tile-graph scheduler, the benchmarks' roofline), so they are measured once here and cached
on disk under `$TVM_EINWELD_CACHE` (default `~/.cache/tvm_einweld`), keyed by the CPU model
and core count, so a different machine measures again.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np


def cache_dir() -> Path:
    path = Path(os.environ.get("TVM_EINWELD_CACHE", Path.home() / ".cache" / "tvm_einweld"))
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
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cache_sizes() -> Dict[str, int]:
    """Data/unified cache sizes in bytes by level name ("L1", "L2", "L3") from sysfs."""
    sizes: Dict[str, int] = {}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for entry in sorted(root.glob("index*")) if root.exists() else []:
        try:
            kind = (entry / "type").read_text().strip()
            if kind == "Instruction":
                continue
            level = (entry / "level").read_text().strip()
            text = (entry / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
        sizes[f"L{level}"] = int(text.rstrip("KM")) * unit
    return sizes


def median_seconds(fn: Callable[[], object], repeats: int = 7, min_time: float = 0.02) -> float:
    """Median wall time of `fn`, each sample looping until it lasts at least `min_time`."""
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        loops, start = 0, time.perf_counter()
        while True:
            fn()
            loops += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / loops)
    return float(np.median(samples))


def measure_copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes moved per second (read + write) by a large float32 copy."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = median_seconds(lambda: np.copyto(dst, src), repeats=5)
    return 2 * src.nbytes / seconds


def measure_sgemm_flops(n: int = 1024) -> float:
    """FLOP/s of numpy's float32 matmul (its BLAS) on n×n matrices."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), dtype=np.float32)
    seconds = median_seconds(lambda: np.matmul(a, b, out=c), repeats=5)
    return 2.0 * n**3 / seconds


@dataclass(frozen=True)
class MachineProfile:
    cpu: str
    cores: int
    copy_bandwidth: float  # bytes/s, read + write
    sgemm_flops: float  # FLOP/s
    caches: Dict[str, int]

    def describe(self) -> str:
        caches = ", ".join(f"{k} {v // 1024} KiB" for k, v in sorted(self.caches.items()))
        return (f"{self.cpu}, {self.cores} cores; copy bandwidth {self.copy_bandwidth / 1e9:.1f} "
                f"GB/s, numpy sgemm {self.sgemm_flops / 1e9:.0f} GFLOP/s; caches: {caches}")


_PROFILE: Optional[MachineProfile] = None


def profile(refresh: bool = False) -> MachineProfile:
    """The machine's profile, measured on first use and cached on disk."""
    global _PROFILE
    if _PROFILE is not None and not refresh:
        return _PROFILE
    key = f"{cpu_model()}|{cpu_cores()}"
    path = cache_dir() / "machine.json"
    stored = {}
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
    if key in stored and not refresh:
        _PROFILE = MachineProfile(**stored[key])
        return _PROFILE
    _PROFILE = MachineProfile(cpu_model(), cpu_cores(), measure_copy_bandwidth(),
                              measure_sgemm_flops(), cache_sizes())
    stored[key] = asdict(_PROFILE)
    path.write_text(json.dumps(stored, indent=1))
    return _PROFILE
