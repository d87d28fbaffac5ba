"""Partial vector loads and stores as whole-register ones: a TIR pass for CPU code generation.

What it rewrites
----------------
A vector of fewer lanes than a register that is not a power of two (`A[Ramp(base, 1, 14)]`:
a 14-column convolution row on a 16-lane AVX-512 register) reaches LLVM as a `<14 x float>`
access, which x86 code generation splits into power-of-two pieces (8 + 4 + 2 lanes) and, for
a load, inserts back into one register: three loads and two shuffles for one. (LLVM uses no
masked access: it cannot know that the two missing lanes may be read.) Here, with P the next
power of two (at most a register):
- a load whose P-lane read provably stays inside its buffer becomes
      Shuffle([A[Ramp(base, 1, P)]], [0, 1, ..., L - 1])
  one load of which the first L lanes are kept (LLVM emits one load and no shuffle: the kept
  lanes are the register's low lanes);
- on targets with masked vector memory operations (AVX-512: `isa.masked`), any other such
  load becomes the same shuffle of `masked_load(A, Ramp(base, 1, P), lane < L)`, and a store
  `A[Ramp(base, 1, L)] = v` becomes `masked_store(A, [v, 0...], Ramp(base, 1, P), lane < L)`:
  one instruction each.
A depthwise 3x3 conv with 14-column rows (MobileNetV2's 192 channels at 28x28) ran its nine
loads per output vector as 27 loads and 18 inserts.

Why it is correct
-----------------
- Values: lane k of the shuffle is element base + k of A, what lane k of the load read; the
  lanes L..P-1 are read and dropped, or (masked) not read. A masked store writes lanes
  0..L-1 with the value's lanes and leaves the others unwritten, what the store did.
- Memory: the new plain load reads [base, base + P), the old one [base, base + L). It is made
  only where TVM's analyzer proves base + P <= the buffer's extent for every value the loop
  variables and bound variables around the load can take (their ranges; conditions around
  the load are not used, so the proof holds whether or not the load is guarded): the extra
  lanes lie inside the same allocation (a flattened buffer is one contiguous allocation, its
  extent the declared shape; in a function that declares a buffer with strides, a view into
  a larger array whose flattened extent may run past that array, no load is widened this
  way). A racing write to a dropped lane does not matter: its value is never used. Masked
  lanes are not accessed at all (the hardware suppresses their faults).
  Only flattened (1-D) accesses with stride 1, constant lanes and scalar elements of at least
  a byte are rewritten; a load under `address_of` names an address and is left alone.

When: after TVM's whole TIR lowering, `deinterleave` and `interleave_stores`
(`deinterleave.register_tir_pipeline`), on functions whose `target` is a CPU (the register
width and masks come from it, `rules.cpu.isa`).
"""
from __future__ import annotations

import tvm
from tvm import ir, tirx
from tvm.sym import Analyzer
from tvm_ffi import structural_map, structural_mutate

from .deinterleave import flat_vector_ramp, skip_address_of


def _pow2_at_least(value: int) -> int:
    return 1 << (value - 1).bit_length()


def widened_lanes(lanes: int, register_lanes: int) -> int | None:
    """Lanes to load instead of `lanes` (the next power of two), or None where the load is
    already whole (a power of two) or longer than a register (LLVM then splits it into whole
    registers plus a remainder)."""
    if lanes < 2 or lanes >= register_lanes or lanes & (lanes - 1) == 0:
        return None
    return _pow2_at_least(lanes)


def _partial_ramp(indices, ty, register_bits: int) -> tuple[tirx.Ramp, int, int] | None:
    """(ramp, lanes, widened lanes) of a flattened, stride-1 access of scalar elements of at
    least a byte (`deinterleave.flat_vector_ramp`) that `widened_lanes` widens; None for any
    other access."""
    access = flat_vector_ramp(indices, ty)
    if access is None or access[1] != 1:
        return None
    ramp, _, lanes = access
    bits = tvm.runtime.DataType(str(ty)).bits
    wide = widened_lanes(lanes, register_bits // bits)
    return None if wide is None else (ramp, lanes, wide)


def _lane_mask(lanes: int, wide: int) -> tirx.Expr:
    """Lanes 0..lanes-1 of `wide` on."""
    index = tirx.Ramp(tirx.IntImm("int32", 0), 1, wide)
    return index < tirx.Broadcast(tirx.IntImm("int32", lanes), wide)


def _vector_type(element, lanes: int) -> str:
    return f"{tvm.runtime.DataType(str(element)).with_lanes(1)}x{lanes}"


def _declares_strides(func: tirx.PrimFunc) -> bool:
    """Whether `func` declares a buffer with explicit strides (a view into a larger array)."""
    found = []
    structural_map(func, [(tirx.DeclBuffer, lambda node: found.append(True)
                           if len(node.buffer.strides) else None)])
    return bool(found)


def widen_function(func: tirx.PrimFunc, register_bits: int, masked: bool = False
                   ) -> tirx.PrimFunc:
    """`func` with its partial vector loads widened where provably in bounds, and, with
    `masked` (the target has masked vector loads and stores), the other partial loads and
    every partial store done under a lane mask (module doc)."""
    analyzer = Analyzer()

    def loop(node, mutator):
        analyzer.bind(node.loop_var, ir.Range.from_min_extent(node.min, node.extent),
                      allow_override=True)
        return mutator.default_mutate(node)

    def bind(node, mutator):  # Bind (a LetStmt) and Let: the variable's value
        if str(node.var.ty).startswith(("int", "uint")):  # indices: not handles or floats
            analyzer.bind(node.var, node.value, allow_override=True)
        return mutator.default_mutate(node)

    # A strided view's flattened extent spans its last row's padding, which may lie past the
    # memory it views (a column slice); TIR ties the flattened buffer to the view only through
    # expressions, so a function with any strided buffer gets no unmasked widening at all.
    compact = not _declares_strides(func)

    def load(node, mutator):
        node = mutator.default_mutate(node)  # its indices first (a load may index by a load)
        partial = _partial_ramp(node.indices, node.ty, register_bits)
        if partial is None or len(node.source.shape) != 1:
            return node
        ramp, lanes, wide = partial
        indices = [tirx.Ramp(ramp.base, 1, wide)]
        if compact and analyzer.can_prove(ramp.base + wide <= node.source.shape[0]):
            whole = tirx.BufferLoad(node.source, indices)
        elif masked:
            whole = tirx.call_intrin(_vector_type(node.ty, wide), "tirx.masked_load",
                                     node.source, *indices, _lane_mask(lanes, wide))
        else:
            return node
        return tirx.Shuffle([whole], [tirx.IntImm("int32", k) for k in range(lanes)])

    def store(node, mutator):
        node = mutator.default_mutate(node)
        partial = _partial_ramp(node.indices, node.value.ty, register_bits) if masked else None
        if partial is None or len(node.buffer.shape) != 1:
            return node
        ramp, lanes, wide = partial
        # the value's lanes, then zeros in the lanes the mask leaves unwritten
        element = tvm.runtime.DataType(str(node.value.ty)).with_lanes(1)
        zero = tirx.const(0, str(element))
        zeros = tirx.Broadcast(zero, wide - lanes) if wide - lanes > 1 else zero
        value = tirx.Shuffle([node.value, zeros], [tirx.IntImm("int32", k) for k in range(wide)])
        return tirx.Evaluate(tirx.call_intrin("void", "tirx.masked_store", node.buffer, value,
                                              tirx.Ramp(ramp.base, 1, wide),
                                              _lane_mask(lanes, wide)))

    return structural_mutate(func, [(tirx.For, loop), (tirx.Bind, bind), (tirx.Let, bind),
                                    (ir.Call, skip_address_of), (ir.TensorLoad, load),
                                    (tirx.BufferStore, store)])


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="WidenPartialLoads")
class WidenPartialLoads:  # pylint: disable=too-few-public-methods
    """Function pass: `widen_function` on every CPU function (lowered TIR)."""

    def transform_function(self, func: tirx.PrimFunc, _mod, _ctx=None) -> tirx.PrimFunc:
        # pylint: disable-next=import-outside-toplevel
        from .rules.cpu.isa import cpu_target, has_feature, vector_isa

        target = cpu_target(func)
        if target is None:
            return func
        isa = vector_isa(target)
        # masks on vectors narrower than a register need AVX512VL, on 8/16-bit lanes AVX512BW:
        # without them LLVM branches lane by lane
        masked = isa.masked and has_feature("avx512vl", target) and \
            has_feature("avx512bw", target)
        return widen_function(func, isa.bits, masked)
