"""Kernels built once each and linked (`parallel_build`): the same outputs as `tvm.compile`,
bit for bit, in process and from an exported library; a kernel built for one module is reused
for the same kernel of another and never for a different kernel of the same name."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm_ffi import structural_equal

from tvm_einweld.parallel_build import PrebuiltKernels, _KERNELS, compile_modules, link_kernels

from conftest import run_vm

TARGET = tvm.target.Target("llvm")


def _module(name: str, fn, n: int = 37) -> tvm.IRModule:
    """x -> relu(fn(x) @ W) + 1, the kernel of fn named `name`."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 19), "float32"))
    w = np.random.default_rng(n).uniform(-1, 1, (19, 23)).astype("float32")
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_te(lambda a: te.compute(a.shape, lambda i, j: fn(a[i, j])),
                           x, primfunc_name_hint=name)
            z = bb.emit(relax.op.nn.relu(relax.op.matmul(y, relax.const(w))))
            out = bb.emit_output(relax.op.add(z, relax.const(1.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def _run(vm, x: np.ndarray) -> np.ndarray:
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def test_linked_kernels_compute_what_tvm_compile_builds(tmp_path, rng):
    mod = _module("scale", lambda v: v * 3.0)
    x = rng.uniform(-1, 1, (37, 19)).astype("float32")
    want = run_vm(mod, x)
    vm, = compile_modules([mod], TARGET)
    np.testing.assert_array_equal(_run(vm, x), want)

    # The einweld lowering links the kernels just built instead of compiling them again.
    built = len(_KERNELS)
    lowering = tvm.transform.Sequential([relax.pipeline.default_build_pipeline(),
                                         PrebuiltKernels()])
    executable = tvm.compile(mod, TARGET, relax_pipeline=lowering)
    assert len(_KERNELS) == built
    np.testing.assert_array_equal(run_vm(executable, x), want)
    # ... and the executable exports as one shared library, every kernel in it.
    path = str(tmp_path / "linked.so")
    executable.export_library(path)
    loaded = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    np.testing.assert_array_equal(_run(loaded, x), want)


def test_a_kernel_is_reused_only_for_an_equal_kernel(rng):
    """Planted: two modules whose first kernels share a name but not their computation,
    built together; each must run its own (a cache keyed by name would run one for both).
    A third module repeating the first gets the first's built kernels, not new ones."""
    times3, plus2 = _module("k", lambda v: v * 3.0), _module("k", lambda v: v + 2.0)
    x = rng.uniform(-1, 1, (37, 19)).astype("float32")
    vms = compile_modules([times3, plus2], TARGET)
    np.testing.assert_array_equal(_run(vms[0], x), run_vm(times3, x))
    np.testing.assert_array_equal(_run(vms[1], x), run_vm(plus2, x))
    assert not np.array_equal(_run(vms[0], x), _run(vms[1], x))

    with TARGET:
        lowered = relax.pipeline.default_build_pipeline()(times3)
    first = link_kernels([lowered], TARGET)[0]
    again = link_kernels([lowered], TARGET)[0]
    kernels = [f for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert not any(any(structural_equal(f, k) for k in kernels)
                   for f in first.functions.values())
    mods, mods_again = first.attrs["external_mods"], again.attrs["external_mods"]
    assert len(mods) == len(mods_again) == len(kernels) >= 3
    assert all(m.same_as(n) for m, n in zip(mods, mods_again))
    assert link_kernels([first], TARGET)[0] is first  # a linked module is not linked again


def test_modules_it_cannot_link_are_left_to_relax_build():
    """Device targets, and a kernel whose symbol is not its name, are not linked here."""
    with TARGET:
        lowered = relax.pipeline.default_build_pipeline()(_module("k", lambda v: v - 1.0))
    assert link_kernels([lowered], tvm.target.Target("cuda"))[0] is lowered
    gv = lowered.get_global_var("k")
    renamed = tvm.IRModule({**dict(lowered.functions),
                            gv: lowered[gv].with_attr("global_symbol", "other")},
                           attrs=lowered.attrs)
    assert link_kernels([renamed], TARGET)[0] is renamed
