"""Abstract accelerator of the Welder paper (§3.3, Table 1): a stack of memory levels.

Level 0 is the slowest, largest memory (DRAM / GPU global memory); higher indices are faster and
smaller (CPU L2 and L1, GPU shared memory and registers). The scheduler only needs, per level,
its capacity (what one tile-graph may keep live there), its transaction width (the granularity at
which traffic is counted) and its bandwidth (to turn traffic into an estimated time).

`cpu_device()` builds this machine's hierarchy from the facts `tvm_einweld.machine` probes: the
cache sizes in sysfs, and the bandwidths of numpy copies sized to each level, measured once and
cached on disk (for L1 the per-call overhead of numpy dominates, so that figure is a lower bound;
the scheduler ranks tiles by DRAM traffic and uses the upper levels' figures only to break ties,
see scheduler.py). The CUDA descriptions are
static data sheets, so they can be built on a machine without a GPU.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from .. import machine


@dataclass(frozen=True)
class MemoryLevel:
    """One level of the memory hierarchy.

    `capacity` is in bytes and is what one parallel unit may use (per core for CPU caches, per
    thread block for GPU shared memory); `bandwidth` is in bytes/s for the whole device.
    """

    name: str
    capacity: int
    transaction: int
    bandwidth: float


@dataclass(frozen=True)
class Device:
    """A memory hierarchy plus the number of units that run tiles in parallel.

    `kind` is "cpu" or "cuda"; `fuse_level` is the level at which connected intermediates are kept
    by the code generator (CPU: the per-core cache a tile's scratch buffer lives in; CUDA: shared
    memory); the levels above it get per-operator sub-tiles (CPU L1, CUDA per-thread registers).
    `threads` is the CUDA thread-block size used by the code generator (1 on CPU); a register
    sub-tile is chosen so that tile / sub-tile gives exactly this many threads.
    """

    name: str
    kind: str
    levels: tuple[MemoryLevel, ...]
    parallel_units: int
    fuse_level: int
    threads: int = 1

    def level(self, index: int) -> MemoryLevel:
        return self.levels[index]


# ---------------------------------------------------------------------------------------- CPU
def cpu_device(num_cores: int | None = None, bandwidth=None) -> Device:
    """This machine's CPU: DRAM / L2 / L1 with capacities from sysfs and measured bandwidths
    (both probed by `tvm_einweld.machine`), or the bandwidths `bandwidth(level name, cores)`
    gives (bytes/s; no measuring: the nominal device model of `cost_model.nominal_device`)."""
    cores = num_cores or os.cpu_count() or 1
    caches = {level: (cache.per_core, cache.line) for level, cache in machine.cpu_caches().items()}
    l1, line = caches.get(1, (32 * 1024, 64))
    l2, _ = caches.get(2, (512 * 1024, line))
    last = max(caches.values())[0] if caches else l2
    probe = {"L1": 2 * l1, "L2": 2 * l2, "DRAM": 16 * max(last, l2)}
    key = f"{l1}-{l2}-{last}-{cores}"
    if bandwidth is None:
        measured = machine.level_copy_bandwidths(probe, key)
        bandwidth = lambda name, _cores: measured[name]  # noqa: E731
    levels = (
        MemoryLevel("DRAM", machine.memory_bytes(), line, bandwidth("DRAM", cores)),
        MemoryLevel("L2", l2, line, bandwidth("L2", cores)),
        MemoryLevel("L1", l1, line, bandwidth("L1", cores)),
    )
    return Device("cpu", "cpu", levels, parallel_units=cores, fuse_level=1)


# --------------------------------------------------------------------------------------- CUDA
# Static shared memory per block: a kernel's `__shared__` arrays, which is how TVM's CUDA code
# generator emits every buffer of scope "shared" (the scope the tile kernels' intermediates get),
# may hold at most 48 KiB on every NVIDIA architecture (ptxas: "uses too much shared data
# (... bytes, 0xc000 max)"). The larger per-block maxima of the data sheets (`shared_optin`) are
# for dynamic shared memory only (scope "shared.dyn"), and only once the launch raises the
# kernel's cudaFuncAttributeMaxDynamicSharedMemorySize; budgeting them for static arrays gave
# kernels that do not load (benchmarks/cuda_device_check.md, H100).
CUDA_STATIC_SHARED_BYTES = 48 * 1024


@dataclass(frozen=True)
class _GpuSheet:
    global_bytes: int
    global_bw: float
    sms: int
    shared_optin: int  # dynamic shared memory per block, opt-in maximum (not used: see above)
    registers_per_sm: int


_GPU_SHEETS = {
    # Data sheet figures: memory size and bandwidth, SM count, max shared memory per block
    # (opt-in, dynamic), 64K 32-bit registers per SM.
    "v100": _GpuSheet(16 << 30, 900e9, 80, 96 * 1024, 65536 * 4),
    "a100": _GpuSheet(40 << 30, 1555e9, 108, 163 * 1024, 65536 * 4),
    "h100": _GpuSheet(80 << 30, 3350e9, 132, 227 * 1024, 65536 * 4),
}


def cuda_device(name: str = "a100", threads: int = 128) -> Device:
    """A static description of an NVIDIA GPU (global / shared / registers); no GPU needed.

    The shared level's capacity is what one block of the tile code generator may use: the
    48 KiB of static shared memory (`CUDA_STATIC_SHARED_BYTES`), on every GPU of the table."""
    sheet = _GPU_SHEETS.get(name.lower())
    if sheet is None:
        raise ValueError(f"unknown GPU {name!r}; known: {sorted(_GPU_SHEETS)}")
    # On-chip bandwidths: 32 banks x 4 B per cycle per SM at ~1.4 GHz for shared memory, and
    # registers several times that; only their ratio to global memory matters to the model.
    shared_bw = sheet.sms * 128 * 1.4e9
    levels = (
        MemoryLevel("global", sheet.global_bytes, 32, sheet.global_bw),
        MemoryLevel("shared", min(sheet.shared_optin, CUDA_STATIC_SHARED_BYTES), 128,
                    shared_bw),
        MemoryLevel("registers", sheet.registers_per_sm, 4, 4 * shared_bw),
    )
    # Four warp schedulers per SM: 4 * 32 threads keep an SM busy (§4.1), one block per SM here.
    return Device(name.lower(), "cuda", levels, parallel_units=sheet.sms, fuse_level=1,
                  threads=threads)


def shared_limits(device: Device) -> tuple[int, int]:
    """(static, total): the bytes of shared memory one CUDA kernel may allocate in scope
    "shared" (static `__shared__` arrays: at most `CUDA_STATIC_SHARED_BYTES`, whatever the
    device model budgets) and in "shared" plus "shared.dyn" together (the model's budget, the
    capacity of its fuse level). A kernel over either limit does not load, or does not keep
    to the plan it was scheduled for."""
    budget = device.level(device.fuse_level).capacity
    return min(budget, CUDA_STATIC_SHARED_BYTES), budget


def device_for_target(target) -> Device:
    """The device description matching a TVM target (kind llvm -> this CPU, cuda -> a GPU sheet).

    For CUDA the GPU is taken from the target's `arch` (sm_70 V100, sm_80 A100, sm_90 H100),
    defaulting to A100.
    """
    import tvm  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    if target.kind.name == "llvm":
        cores = int(target.attrs.get("num-cores", 0) or 0) or None
        return cpu_device(cores)
    if target.kind.name == "cuda":
        arch = str(target.attrs.get("arch", "sm_80"))
        name = {"sm_70": "v100", "sm_80": "a100", "sm_90": "h100"}.get(arch[:5], "a100")
        return cuda_device(name)
    raise NotImplementedError(f"tile-graph scheduling has no device model for target {target}")


def describe(device: Device) -> dict:
    """A JSON-friendly view (used by the benchmark to print the machine)."""
    return asdict(device)


def host_target(num_cores: int | None = None):
    """An llvm target for this CPU (its -mcpu, so LLVM may use AVX2/AVX-512) and core count."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.target import codegen  # pylint: disable=import-outside-toplevel

    return tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(),
                              "num-cores": num_cores or os.cpu_count() or 1})
