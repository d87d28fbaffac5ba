"""What a CPU target's vector unit offers, read from the target (its -mcpu / -mattr), never
from the machine this runs on: the schedule rules size register blocks and vector loops from it.

Plain "llvm" on x86 means generic x86-64 (SSE2: 128-bit vectors, 16 registers); a target with
`mcpu` or `mattr` gets what LLVM says that CPU has. FMA pipes per core are a micro-architecture
fact LLVM does not expose; two is right for every AVX2/AVX-512 core of the last decade and the
register block only needs enough independent accumulators to cover `fma_units * fma_latency`.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.target import codegen


@dataclass(frozen=True)
class VectorISA:
    """`bits`: vector register width; `registers`: architectural vector registers;
    `fma`: fused multiply-add available; `fma_units` / `fma_latency`: pipes and cycles, used to
    size the number of independent accumulators a micro-kernel needs."""

    bits: int
    registers: int
    fma: bool
    fma_units: int = 2
    fma_latency: int = 4

    def lanes(self, dtype: str) -> int:
        """Elements of `dtype` in one vector register (at least 1)."""
        return max(1, self.bits // tvm.runtime.DataType(dtype).bits)


def _has(feature: str, target: tvm.target.Target) -> bool:
    try:
        return bool(codegen.target_has_features(feature, target))
    except Exception:  # pylint: disable=broad-except  # non-x86 or unknown feature name
        return False


def vector_isa(target: tvm.target.Target | str) -> VectorISA:
    """The vector unit of an llvm `target` (x86: SSE2 / AVX2 / AVX-512; AArch64: NEON)."""
    target = target if isinstance(target, tvm.target.Target) else tvm.target.Target(target)
    if target.kind.name != "llvm":
        raise ValueError(f"vector_isa: not a CPU target: {target}")
    triple = str(target.attrs.get("mtriple", "") or codegen.llvm_get_system_triple())
    if triple.startswith(("aarch64", "arm64")):
        return VectorISA(bits=128, registers=32, fma=True)
    if _has("avx512f", target):
        return VectorISA(bits=512, registers=32, fma=True)
    if _has("avx2", target) or _has("avx", target):
        return VectorISA(bits=256, registers=16, fma=_has("fma", target))
    return VectorISA(bits=128, registers=16, fma=False)
