"""Register-sized `local` buffers on the stack: a TIR pass for CPU code generation.

What it rewrites
----------------
The CPU rules hold a micro-kernel's accumulator (an mr x nr register block of a GEMM or a
direct convolution) in a `cache_write` buffer that LLVM keeps in vector registers over the
reduction loop. TVM's `LowerTVMBuiltin` turns every CPU allocation into a
`TVMBackendAllocWorkspace` / `FreeWorkspace` call pair unless it is in "global" scope and
smaller than `kMaxStackAlloca` (1 KiB), and most AVX-512 register blocks are larger (13 x 2
vectors: 1664 bytes). In workspace memory the block is no longer private to LLVM: it zeroes
the buffer with a `memset` call (and a `vzeroupper`) before every block, stores the registers
back after the reduction loop and reloads them in the write-back. On a 1x1 convolution with
K = 32 (NAFNet's 32 -> 64 at 128x128), 26 FMAs per k step, that was 13 % of the kernel's time.

Here every allocation in "local" scope whose constant size is at most the target's vector
register file (registers x vector bytes: 2 KiB with AVX-512, 512 bytes with AVX2) gets TVM's
`disable_lower_builtin` annotation, which `LowerTVMBuiltin` honours by leaving the allocation
to code generation: an LLVM `alloca` at the entry of the function (or of the parallel task's
closure) that holds it, which LLVM's SROA promotes to registers where its indices are
constant. At most `STACK_BUDGET` bytes per function are moved; the rest stay workspaces.

Why it is correct
-----------------
Only where the buffer lives changes, not what is read or written: a "local" buffer is private
to the code that allocates it (TIR's scope rule), so no other thread or function needs its
address. An `alloca` is made once at function entry, not per loop iteration, and each thread
of TVM's pool runs a parallel task in its own frame, so the stack grows by the buffer's size
once per task; the budget keeps that far below any thread stack (the smallest default,
secondary threads on macOS, is 512 KiB). Allocations of non-constant size, in other scopes or
larger than the register file are left alone.

When: after TVM's TIR lowering (`deinterleave.register_tir_pipeline`), before the host
finalisation (`LowerTVMBuiltin`), on functions whose `target` is a CPU.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm_ffi import structural_mutate

from .localize import buffer_bytes
from .rules.cpu.isa import cpu_target, vector_isa

DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # TVM's transform::kDisableLowerTVMBuiltin
STACK_BUDGET = 16 * 1024  # bytes of buffers moved to the stack per function


def _constant_bytes(buffer: tirx.Buffer) -> int | None:
    """Bytes of `buffer` when its shape is constant, else None."""
    if not all(isinstance(extent, tirx.IntImm) for extent in buffer.shape):
        return None
    return buffer_bytes(buffer)


def stack_local_buffers(func: tirx.PrimFunc, limit: int, budget: int = STACK_BUDGET
                        ) -> tirx.PrimFunc:
    """`func` with its "local" allocations of at most `limit` constant bytes annotated to stay
    on the stack, innermost first, until `budget` bytes are used (module doc)."""
    remaining = [budget]

    def alloc(node, mutator):
        node = mutator.default_mutate(node)
        size = _constant_bytes(node.buffer)
        if node.buffer.scope() != "local" or size is None or size > limit or \
                size > remaining[0] or DISABLE_LOWER_BUILTIN in node.annotations:
            return node
        remaining[0] -= size
        annotations = dict(node.annotations)
        annotations[DISABLE_LOWER_BUILTIN] = tirx.IntImm("bool", 1)
        return tirx.AllocBuffer(node.buffer, annotations, node.span)

    return structural_mutate(func, [(tirx.AllocBuffer, alloc)])


def register_file_bytes(target: tvm.target.Target) -> int:
    """Bytes of the target's architectural vector registers."""
    isa = vector_isa(target)
    return isa.registers * isa.bits // 8


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="StackLocalBuffers")
class StackLocalBuffers:  # pylint: disable=too-few-public-methods
    """Function pass: `stack_local_buffers` on every CPU function (lowered TIR), limited to
    the target's register file."""

    def transform_function(self, func: tirx.PrimFunc, _mod, _ctx=None) -> tirx.PrimFunc:
        target = cpu_target(func)
        if target is None:
            return func
        return stack_local_buffers(func, register_file_bytes(target))
