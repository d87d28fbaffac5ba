"""CPU (llvm target) schedule rules: register-blocked GEMM class, memory-bound kernels."""
from .isa import VectorISA, vector_isa

__all__ = ["VectorISA", "vector_isa"]
