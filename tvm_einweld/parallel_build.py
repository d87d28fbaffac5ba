"""Building Relax modules with each kernel compiled once, in parallel threads.

A compile of one zoo model builds many modules that share kernels: every whole-module check
builds the module a stage was given and the one it returned, every paired timing two more, and
at the end `tvm.compile` builds the final module, which the final check has just built (GCN:
~10 s a build, nearly all of it TIR lowering, LLVM's optimiser and the JIT's machine-code
generation, one kernel after another). Here each kernel (PrimFunc) is built on its own, once:

1. `compile_modules` runs each module's Relax pipeline in the caller's thread (TVM's Python
   passes keep global state: legalisation's `te.tag` scope raises "nested op_tag" when two
   threads enter it).
2. `link_kernels` collects the PrimFuncs of all the lowered modules, builds those not built yet
   with `tvm.tirx.build` in a pool of threads (one per physical core; the C++ work releases
   the GIL) and makes each thread's JIT generate its machine code there and then; each module's
   PrimFuncs are then replaced by `relax.ExternFunc`s of the same symbol, and the built kernels
   are attached as the module's `external_mods`, which `relax.build` imports into the
   executable.
3. `relax.build(..., relax_pipeline=None)` generates the VM code and links: it compiles only
   an empty stub function (its executable needs a library of its own: without one it would
   link an empty C source module, which a C compiler must build before the VM can load it).

`PrebuiltKernels` is step 2 as a pass: the einweld pipeline ends with it, so that
`tvm.compile(mod, target, relax_pipeline="einweld")` links the kernels its final check built
instead of compiling the whole module again (GCN on 2 cores: that build was 4.6 s of a 63.8 s
cold compile, 5-10 s in earlier runs; with it gone and every build on both cores, 55-61 s).

Why the result is the same program: `relax.build` builds the PrimFuncs of the module with
`tvm.tirx.build(mod's PrimFuncs, target)` into one library and the VM calls each by its
global symbol, looked up in the executable's imports. Here each PrimFunc goes through the same
`tvm.tirx.build` on its own (a PrimFunc's lowering and code generation do not depend on the
other functions of its module; a kernel that calls another function fails to build alone,
and its module is then left to `relax.build`), the VM code calls the same symbols, and VM
initialisation finds them in the imported modules. A cached kernel is reused only for a
PrimFunc structurally equal to the one it was built from, global symbol included, so one
executable never imports two kernels under one symbol. Only CPU (llvm) targets that are not
a system library take this path; other targets are built by `relax.build` as before.
The TIR pipeline here is TVM's default followed by `tir_passes.deinterleave` (strided vector
loads read as contiguous vectors and a shuffle, the same elements: see that module) and
`tir_passes.widen_loads` (partial vector loads read as one wider load, where it provably stays
inside the buffer, and a shuffle), so a kernel built here computes what `relax.build`'s would,
with fewer loads. (A kernel
that fails to build alone, the pass included, is left to `relax.build` and TVM's default
pipeline, which then reports any real error.)
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple, Union

import tvm
from tvm import relax, tirx
from tvm_ffi import structural_equal, structural_hash

from .machine import physical_cores
from .tir_passes.deinterleave import TIR_PIPELINE, register_tir_pipeline

# Built kernels kept for reuse, most recent last: (structural hash, target) -> (func, module).
# A zoo model's compile builds a few hundred distinct kernels; each kept one holds its LLVM
# module and machine code, so the oldest are dropped beyond this.
_KERNELS: "OrderedDict[Tuple[int, str], Tuple[tirx.PrimFunc, tvm.runtime.Module]]" = \
    OrderedDict()
_KERNEL_CACHE_SIZE = 512
register_tir_pipeline()  # TVM's TIR lowering, then deinterleave and widen_loads


def _links_kernels(target: tvm.target.Target) -> bool:
    """Kernels are built one by one for CPU targets: not for a system library (WebAssembly,
    whose functions `relax.build` registers under a prefix) nor for device targets (each
    kernel split into host and device code, which `relax.build` links itself)."""
    return target.kind.name == "llvm" and "wasm" not in str(target.attrs.get("mtriple", ""))


# relax.build makes the executable's own library from the module's PrimFuncs; with none left
# it links an empty C source module, and the VM's first load then exports and links the whole
# executable with a C compiler (`Executable.jit`: 3.4 s on GCN). An empty function avoids it.
_STUB = "__tvm_einweld_linked"


def _stub() -> tirx.PrimFunc:
    return tirx.PrimFunc([], tirx.Evaluate(0)).with_attr("global_symbol", _STUB)


def _kernels(mod: tvm.IRModule) -> Dict[tvm.ir.GlobalVar, tirx.PrimFunc]:
    """The PrimFuncs of `mod`, or {} when any of them is called by a symbol other than its
    name (the VM code calls a kernel by its name) or the module is linked already (it holds
    the stub)."""
    if any(gv.name_hint == _STUB for gv in mod.get_global_vars()):
        return {}
    prims = {gv: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    for gv, func in prims.items():
        if str(func.attrs.get("global_symbol", "") if func.attrs else "") != gv.name_hint:
            return {}
    return prims


def _build_one(func: tirx.PrimFunc, name: str, target: tvm.target.Target
               ) -> Optional[tvm.runtime.Module]:
    """`func` built alone, its machine code generated; None when it cannot be built alone
    (e.g. it calls another function of its module): its module is then built whole."""
    try:
        lib = tvm.tirx.build(tvm.IRModule({name: func}), target=target, pipeline=TIR_PIPELINE)
        lib.get_function(name)  # the JIT generates machine code now, in this thread
        return lib
    except Exception:  # pylint: disable=broad-except  # relax.build reports the real error
        return None


def link_kernels(mods: Sequence[tvm.IRModule], target: tvm.target.Target
                 ) -> List[tvm.IRModule]:
    """Each module (after its Relax pipeline) with every PrimFunc built (once per distinct
    kernel, in parallel threads, reusing kernels built before) and replaced by an ExternFunc
    of its symbol; the built kernels are in the module's `external_mods`. Modules for other
    targets, or whose kernels cannot be built alone, are returned unchanged."""
    if not _links_kernels(target):
        return list(mods)
    tkey = str(target)
    plans, todo = [], {}
    for mod in mods:
        prims = _kernels(mod)
        keys = {gv: (structural_hash(f), tkey) for gv, f in prims.items()}
        for gv, key in keys.items():
            hit = _KERNELS.get(key)
            if hit is not None and not structural_equal(hit[0], prims[gv]):
                # A hash collision: this function gets a key of its own.
                keys[gv] = key = (key[0], f"{tkey}#{id(prims[gv])}")
                hit = None
            if hit is None and key not in todo:
                todo[key] = (prims[gv], gv.name_hint)
        plans.append((mod, prims, keys))
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(len(todo), physical_cores()))) as pool:
            built = pool.map(lambda item: _build_one(item[0], item[1], target), todo.values())
            for key, (func, _), lib in zip(todo, todo.values(), built):
                if lib is not None:
                    _KERNELS[key] = (func, lib)
    out = []
    for mod, prims, keys in plans:
        if not prims or any(keys[gv] not in _KERNELS for gv in prims):
            out.append(mod)
            continue
        libs = []
        for gv in prims:
            _KERNELS.move_to_end(keys[gv])
            libs.append(_KERNELS[keys[gv]][1])
        functions = {gv: relax.ExternFunc(gv.name_hint) if gv in prims else f
                     for gv, f in mod.functions.items()}
        functions[tvm.ir.GlobalVar(_STUB)] = _stub()
        linked = tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
        external = list(mod.attrs.get("external_mods", [])) if mod.attrs else []
        out.append(linked.with_attr("external_mods", external + libs))
    while len(_KERNELS) > _KERNEL_CACHE_SIZE:
        _KERNELS.popitem(last=False)
    return out


@tvm.transform.module_pass(opt_level=0, name="PrebuiltKernels")
class PrebuiltKernels:
    """The last pass of a `relax_pipeline`: the module's kernels built by `link_kernels`
    (each once per process; a kernel a check or a timing built is linked, not rebuilt)."""

    def transform_module(self, mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
        target = tvm.target.Target.current()  # relax.build runs its pipeline under it
        return mod if target is None else link_kernels([mod], target)[0]


def compile_modules(mods: Sequence[tvm.IRModule], target: tvm.target.Target,
                    pipeline: Union[tvm.transform.Pass, str] = "default"
                    ) -> List["relax.VirtualMachine"]:
    """Each module built as `tvm.compile(mod, target, relax_pipeline=pipeline)` and loaded
    in a `relax.VirtualMachine` on the target's device, its kernels built by `link_kernels`
    (on other targets each module's code generation runs in a thread of its own)."""
    if isinstance(pipeline, str):  # as relax.build resolves a pipeline's name
        gpu = pipeline == "default" and "gpu" in target.keys
        pipeline = relax.get_default_pipeline(target) if gpu else relax.get_pipeline(pipeline)
    lowered = []
    for mod in mods:
        with target:
            lowered.append(pipeline(mod))
    device = tvm.device(target.get_target_device_type(), 0)

    def generate(mod: tvm.IRModule) -> "relax.VirtualMachine":
        return relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=None),
                                    device)

    if _links_kernels(target):
        return [generate(mod) for mod in link_kernels(lowered, target)]
    if len(lowered) == 1:
        return [generate(lowered[0])]
    with ThreadPoolExecutor(max_workers=min(len(lowered), physical_cores())) as pool:
        return list(pool.map(generate, lowered))


__all__ = ["compile_modules", "link_kernels", "PrebuiltKernels"]
