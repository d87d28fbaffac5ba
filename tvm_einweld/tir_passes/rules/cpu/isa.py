"""What a CPU target's vector unit offers, read from the target (its -mcpu / -mattr), never
from the machine this runs on: the schedule rules size register blocks and vector loops from it.

Plain "llvm" on x86 means generic x86-64 (SSE2: 128-bit vectors, 16 registers); a target with
`mcpu` or `mattr` gets what LLVM says that CPU has. FMA pipes per core are a micro-architecture fact
LLVM does not expose: two as wide as the vector registers with a 4-cycle latency is right for
most AVX2/AVX-512 cores of the last decade; `FMA_PIPES` lists, by -mcpu, the cores that
differ (Zen 1's pipes are half as wide). The register block needs enough independent
accumulators to cover `fma_units * fma_latency`.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.target import codegen


@dataclass(frozen=True)
class VectorISA:
    """`bits`: vector register width; `registers`: architectural vector registers;
    `fma`: fused multiply-add available; `fma_units` / `fma_latency`: full-width FMAs issued
    per cycle and their cycles, used to size the number of independent accumulators a
    micro-kernel needs; `fma_pipe_bits`: the width of one FMA pipe (0: as wide as the
    registers; Zen 1: 128, a 256-bit FMA takes both pipes); `masked`: partial
    vectors load and store under a mask (AVX-512). Without masks LLVM builds a vector of fewer
    lanes than the register (<7 x float> on AVX2) from scalar loads and inserts: a 3x3 conv
    whose 7-column blocks were such vectors ran at 53 % of a Zen core's FMA peak, the same conv
    with full vectors at 80 %."""

    bits: int
    registers: int
    fma: bool
    fma_units: int = 2
    fma_latency: int = 4
    masked: bool = False
    fma_pipe_bits: int = 0

    def lanes(self, dtype: str) -> int:
        """Elements of `dtype` in one vector register (at least 1)."""
        return max(1, self.bits // tvm.runtime.DataType(dtype).bits)

    def narrowed(self, bits: int) -> "VectorISA":
        """The same unit used with `bits`-wide vectors (the low part of each register, e.g.
        SSE's 128-bit ops on an AVX2 core): as many registers; each pipe issues one FMA per
        cycle as wide as it or narrower (so a Zen 1 core issues two 128-bit FMAs per cycle but
        one 256-bit one, an AVX2 core with 256-bit pipes two of either)."""
        pipe = min(self.fma_pipe_bits or self.bits, self.bits)
        pipes = max(1, self.fma_units * self.bits // pipe)
        return VectorISA(bits, self.registers, self.fma, _fma_units(pipes, pipe, bits),
                         self.fma_latency, self.masked, self.fma_pipe_bits)


def _fma_units(pipes: int, pipe_bits: int, bits: int) -> int:
    """FMAs on `bits`-wide vectors issued per cycle by `pipes` pipes `pipe_bits` wide: one per
    pipe when the vector fits a pipe, else the vector takes several pipes."""
    return max(1, pipes * min(pipe_bits, bits) // bits)


def cpu_target(func: tvm.tirx.PrimFunc) -> tvm.target.Target | None:
    """The `target` attribute of `func` where it is a CPU (LLVM) target, else None: what the
    CPU-only TIR passes check before they rewrite a function."""
    target = func.attrs.get("target") if func.attrs is not None else None
    return target if target is not None and target.kind.name == "llvm" else None


def has_feature(feature: str, target: tvm.target.Target) -> bool:
    """Whether LLVM's `target` has the CPU `feature` (False off x86 or for an unknown name)."""
    try:
        return bool(codegen.target_has_features(feature, target))
    except Exception:  # pylint: disable=broad-except  # non-x86 or unknown feature name
        return False


# Bytes of a data-cache line: 64 on every x86 and Arm server core this project targets (the
# caches' own sizes come from sysfs or `gemm.DEFAULT_CACHES`).
CACHE_LINE = 64

# FMA pipes of cores whose datapath differs from the default (2 pipes as wide as the vector
# registers, 4 cycles): -mcpu -> (pipes, bits each pipe computes per cycle, latency). A vector
# wider than a pipe occupies it for several cycles, so fewer FMAs issue per cycle (Zen 1 runs
# a 256-bit FMA as two 128-bit halves: one 256-bit FMA per cycle). Vendors' optimisation
# manuals (AMD family 17h/19h, Intel) give these numbers.
FMA_PIPES = {
    "znver1": (2, 128, 5),
    "znver2": (2, 256, 5),
    "znver3": (2, 256, 4),
    "znver4": (2, 256, 4),
    "haswell": (2, 256, 5),
    "broadwell": (2, 256, 4),
}


def _with_pipes(isa: VectorISA, target: tvm.target.Target) -> VectorISA:
    mcpu = str(target.attrs.get("mcpu", "") or "")
    if mcpu not in FMA_PIPES:
        return isa
    pipes, width, latency = FMA_PIPES[mcpu]
    return VectorISA(isa.bits, isa.registers, isa.fma, _fma_units(pipes, width, isa.bits),
                     latency, isa.masked, width)


def vector_isa(target: tvm.target.Target | str) -> VectorISA:
    """The vector unit of an llvm `target` (x86: SSE2 / AVX2 / AVX-512; AArch64: NEON)."""
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    if target.kind.name != "llvm":
        raise ValueError(f"vector_isa: not a CPU target: {target}")
    triple = str(target.attrs.get("mtriple", "") or codegen.llvm_get_system_triple())
    if triple.startswith(("aarch64", "arm64")):
        return VectorISA(bits=128, registers=32, fma=True)
    if has_feature("avx512f", target):
        return _with_pipes(VectorISA(bits=512, registers=32, fma=True, masked=True), target)
    if has_feature("avx2", target) or has_feature("avx", target):
        return _with_pipes(VectorISA(bits=256, registers=16, fma=has_feature("fma", target)),
                           target)
    return VectorISA(bits=128, registers=16, fma=False)
