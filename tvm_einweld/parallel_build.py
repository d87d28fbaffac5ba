"""Compiling several Relax modules at once, their code generation in parallel threads.

A module check compiles two modules (the one a stage was given and the one it returned), a
paired timing two more; on GCN each of those builds is ~9 s, nearly all of it TIR lowering,
LLVM's optimiser and the JIT's machine-code generation. Those run in C++ and release the GIL,
so two of them in two threads take the time of the longer one (the JIT runs when a
`relax.VirtualMachine` loads the executable: the threads load them too). The Relax pipeline before them
does not parallelise: TVM's Python passes keep global state (legalisation's `te.tag` scope
raises "nested op_tag" when two threads enter it), so each module's pipeline runs in turn
here, then the code generation of all of them in a pool of threads (at most one per physical
core: more would only share the cores).

Why the result is the same program: `relax.build` runs the Relax pipeline and then generates
code from its output; here the pipeline is run by the caller's thread and `relax.build` is
called with `relax_pipeline=None` on its output, the same two steps in the same order, each
module in one thread only.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import List, Sequence, Union

import tvm

from .machine import physical_cores


def compile_modules(mods: Sequence[tvm.IRModule], target: tvm.target.Target,
                    pipeline: Union[tvm.transform.Pass, str] = "default"
                    ) -> List["tvm.relax.VirtualMachine"]:
    """Each module built as `tvm.compile(mod, target, relax_pipeline=pipeline)` and loaded
    in a `relax.VirtualMachine` on the target's device (loading is when the JIT generates
    machine code: ~0.3 s for one analytic conv kernel, so it runs in the threads too)."""
    from tvm import relax

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

    if len(lowered) == 1:
        return [generate(lowered[0])]
    with ThreadPoolExecutor(max_workers=min(len(lowered), physical_cores())) as pool:
        return list(pool.map(generate, lowered))


__all__ = ["compile_modules"]
