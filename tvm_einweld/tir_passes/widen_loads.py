"""Partial vector loads as whole-register loads plus a shuffle: a TIR pass for CPU code generation.

What it rewrites
----------------
A vector of fewer lanes than a register that is not a power of two (`A[Ramp(base, 1, 14)]`:
a 14-column convolution row on a 16-lane AVX-512 register) reaches LLVM as a `<14 x float>`
load, which x86 code generation splits into power-of-two pieces (8 + 4 + 2 lanes) and inserts
them back into one register: three loads and two shuffles for one. (It uses no masked load:
it cannot know that reading the two missing lanes is allowed.) Where reading further is
provably allowed, the load becomes

    Shuffle([A[Ramp(base, 1, P)]], [0, 1, ..., L - 1])

one load of P lanes (the next power of two, at most a register) of which the first L are
kept: LLVM emits one load and no shuffle (the kept lanes are the register's low lanes). A
depthwise 3x3 conv with 14-column rows (MobileNetV2's 192 channels at 28x28) ran its nine
loads per output vector as 27 loads and 18 inserts.

Why it is correct
-----------------
- Values: lane k of the shuffle is element base + k of A, what lane k of the load read; the
  lanes L..P-1 are read and dropped. Nothing is stored.
- Memory: the new load reads [base, base + P), the old one [base, base + L). The rewrite is
  made only where TVM's analyzer proves base + P <= the buffer's extent for every value the
  loop variables and bound variables around the load can take (their ranges; conditions
  around the load are not used, so the proof holds whether or not the load is guarded): the
  extra lanes lie inside the same allocation (a flattened buffer is one contiguous
  allocation, its extent the declared shape). A racing write to a dropped lane does not
  matter: its value is never used. Only flattened (1-D) loads with stride 1, constant lanes
  and scalar elements of at least a byte are rewritten; a load under `address_of` names an
  address and is left alone.

When: after TVM's whole TIR lowering, with `deinterleave` (`register_tir_pipeline`), on
functions whose `target` is a CPU (the register width comes from it, `rules.cpu.isa`).
"""
from __future__ import annotations

import tvm
from tvm import ir, tirx
from tvm.sym import Analyzer
from tvm_ffi import structural_mutate


def _pow2_at_least(value: int) -> int:
    return 1 << (value - 1).bit_length()


def widened_lanes(lanes: int, register_lanes: int) -> int | None:
    """Lanes to load instead of `lanes` (the next power of two), or None where the load is
    already whole (a power of two) or longer than a register (LLVM then splits it into whole
    registers plus a remainder)."""
    if lanes < 2 or lanes >= register_lanes or lanes & (lanes - 1) == 0:
        return None
    return _pow2_at_least(lanes)


def widen_function(func: tirx.PrimFunc, register_bits: int) -> tirx.PrimFunc:
    """`func` with its partial vector loads widened where provably in bounds (module doc)."""
    analyzer = Analyzer()

    def loop(node, mutator):
        analyzer.bind(node.loop_var, ir.Range.from_min_extent(node.min, node.extent),
                      allow_override=True)
        return mutator.default_mutate(node)

    def bind(node, mutator):  # Bind (a LetStmt) and Let: the variable's value
        if str(node.var.ty).startswith(("int", "uint")):  # indices: not handles or floats
            analyzer.bind(node.var, node.value, allow_override=True)
        return mutator.default_mutate(node)

    def call(node, mutator):  # a load under address_of names an address: not descended
        if isinstance(node.op, ir.Op) and node.op.name == "tirx.address_of":
            return node
        return mutator.default_mutate(node)

    def load(node, mutator):
        node = mutator.default_mutate(node)  # its indices first (a load may index by a load)
        if len(node.indices) != 1 or not isinstance(node.indices[0], tirx.Ramp):
            return node
        ramp = node.indices[0]
        if not (isinstance(ramp.stride, tirx.IntImm) and int(ramp.stride) == 1
                and isinstance(ramp.lanes, tirx.IntImm)):
            return node
        element = tvm.runtime.DataType(str(node.ty))
        lanes = int(ramp.lanes)
        if element.lanes != lanes or element.bits < 8 or len(node.source.shape) != 1:
            return node
        wide = widened_lanes(lanes, register_bits // element.bits)
        if wide is None or not analyzer.can_prove(ramp.base + wide <= node.source.shape[0]):
            return node
        whole = tirx.BufferLoad(node.source, [tirx.Ramp(ramp.base, 1, wide)])
        return tirx.Shuffle([whole], [tirx.IntImm("int32", k) for k in range(lanes)])

    return structural_mutate(func, [(tirx.For, loop), (tirx.Bind, bind), (tirx.Let, bind),
                                    (ir.Call, call), (ir.TensorLoad, load)])


@tvm.transform.module_pass(opt_level=0, name="WidenPartialLoads")
class WidenPartialLoads:  # pylint: disable=too-few-public-methods
    """Module pass: `widen_function` on every CPU function (lowered TIR)."""

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        from .rules.cpu.isa import vector_isa  # pylint: disable=import-outside-toplevel

        updates = {}
        for gvar, func in mod.functions_items():
            target = func.attrs.get("target") if isinstance(func, tirx.PrimFunc) and \
                func.attrs is not None else None
            if target is None or target.kind.name != "llvm":
                continue
            updates[gvar] = widen_function(func, vector_isa(target).bits)
        if not updates:
            return mod
        mod = mod.clone()
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod
