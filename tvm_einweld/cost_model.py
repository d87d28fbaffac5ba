"""The machine figures compile-time choices are costed with: measured, or nominal.

Every choice the pipeline makes between programs that compute the same thing (a derivation
or the original operator, a fused tile group or separate kernels) weighs estimated times, and
those estimates turn FLOPs and bytes into seconds with two figures: a compute peak and a
memory bandwidth. By default they are this machine's measured figures (`machine.profile()`,
`tir_passes.device.cpu_device()`, measured once and cached on disk), and the close calls are
then timed.

`measure=False` (EinweldOptimize, DerivationTransform, TileGraphFusion) chooses by the cost
model alone with the *nominal* figures of `nominal_peaks` / `nominal_device`: computed from
the target (vector width and FMA pipes from its -mcpu, core count from `num-cores`) and the
cache sizes sysfs reports, with no timing at all. The same model and target then compile to
the same program on every run, with or without a cache, whatever else the machine is doing.
The figures are not this machine's speed (NOMINAL_GHZ and NOMINAL_BYTES_PER_CYCLE below are
round figures of current server cores); only their ratio steers choices, and it is the same
for every compile.

Arithmetic intensity and the memory-bound test are defined here, once, for every caller (the
instantiation of expressions, the eOperator estimate, the search's roofline, the benchmark
report's graph roofline):

    intensity = FLOPs / bytes of compulsory traffic        (FLOPs per byte)
    FLOPs     = 2 per iteration point of a summation (a multiply-add: the summand and the
                accumulation), 1 per point of anything else   (`point_flops`)
    bytes     = every input the kernel reads, read once, plus its output, written once
    memory-bound  <=>  intensity < MEMORY_BOUND_INTENSITY  (1 FLOP/byte: EinNet §5's 4 FLOPs
                                                            per float32 element moved)

The FLOP count is the roofline's usual one (a GEMM's 2*M*N*K), taken per iteration point so
that it can be read off any representation of a kernel: an expression's iterators, a
PrimFunc's blocks, an ONNX node's shapes. Body operations beyond the multiply-add are not
counted: on a memory-bound kernel they overlap with its loads, and they cannot be counted
alike in every representation (counting them is how one kernel came to score differently
in each).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import tvm

# A round clock for current x86 / AArch64 server cores (2.5-3.7 GHz all-core): it scales
# compute and bandwidth alike, so choices depend only on the two per-cycle figures.
NOMINAL_GHZ = 3.0
# Copy bandwidth per core per cycle, read + write, from DRAM (measured 4.1 on this project's
# 2-core VMs: 24.6 GB/s at ~3 GHz) and from each cache level (L2 ~2.5x, L1 ~2.8x DRAM).
NOMINAL_BYTES_PER_CYCLE = {"DRAM": 4.0, "L2": 10.0, "L1": 11.0}


# FLOPs per byte below which a kernel's time is its memory traffic (module docstring).
MEMORY_BOUND_INTENSITY = 1.0


def point_flops(points: int, summation: bool) -> int:
    """FLOPs of `points` iteration points: 2 each in a summation (a multiply-add), else 1."""
    return points * (2 if summation else 1)


def intensity(flops: float, nbytes: float) -> float:
    """Arithmetic intensity: FLOPs per byte of compulsory traffic (module docstring)."""
    return flops / nbytes if nbytes > 0 else math.inf


def memory_bound(flops: float, nbytes: float) -> bool:
    """The memory-bound test: `intensity` below `MEMORY_BOUND_INTENSITY`."""
    return intensity(flops, nbytes) < MEMORY_BOUND_INTENSITY


@dataclass(frozen=True)
class Peaks:
    """Compute peak (FLOP/s, whole device) and copy bandwidth (bytes/s read + write) used to
    turn FLOPs and bytes into seconds."""

    flops: float
    bandwidth: float


def measured_peaks() -> Peaks:
    """This machine's measured figures (FMA peak of every core, large copy; cached by
    `machine.profile`): the analytic kernels run at 80-90 % of that peak, so it, not numpy's
    sgemm, is what a candidate's compute costs against."""
    from . import machine

    prof = machine.profile()
    return Peaks(prof.peak_flops, prof.copy_bandwidth)


def _cores(target: tvm.target.Target) -> int:
    from .machine import physical_cores

    return int(target.attrs.get("num-cores", 0) or 0) or physical_cores()


def nominal_peaks(target) -> Peaks:
    """Figures computed from the target alone: FMA peak = cores x FMA pipes x 2 x lanes x clock
    (fp32), copy bandwidth = cores x NOMINAL_BYTES_PER_CYCLE["DRAM"] x clock. CUDA targets use
    the Welder device sheet of their arch."""
    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    if target.kind.name != "llvm":
        from .tir_passes.device import device_for_target

        device = device_for_target(target)
        return Peaks(flops=float("inf"), bandwidth=device.levels[0].bandwidth)
    from .tir_passes.rules.cpu.isa import vector_isa

    isa = vector_isa(target)
    cores, hz = _cores(target), NOMINAL_GHZ * 1e9
    flops = cores * isa.fma_units * 2 * isa.lanes("float32") * hz
    return Peaks(flops, cores * NOMINAL_BYTES_PER_CYCLE["DRAM"] * hz)


def nominal_device(target):
    """The Welder device model of `target` with nominal bandwidths (see the module docstring):
    cache capacities from sysfs (facts, not measurements), bandwidths from
    NOMINAL_BYTES_PER_CYCLE, nothing timed. CUDA devices are data sheets already."""
    from .tir_passes.device import cpu_device, device_for_target

    target = tvm.target.Target(target) if not isinstance(target, tvm.target.Target) else target
    if target.kind.name != "llvm":
        return device_for_target(target)
    return cpu_device(_cores(target), bandwidth=lambda name, cores: (
        cores * NOMINAL_BYTES_PER_CYCLE[name] * NOMINAL_GHZ * 1e9))


def peaks_for(target, measure: bool) -> Optional[Peaks]:
    """None (the measured figures, looked up when first needed) or the nominal ones."""
    return None if measure else nominal_peaks(target)
