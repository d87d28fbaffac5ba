"""Register-sized "local" buffers kept on the stack (tir_passes/stack_buffers.py): which
allocations are moved (scope, size limit, budget), GEMM register blocks larger than TVM's
1 KiB stack limit built with the einweld TIR pipeline against numpy (odd shapes, fp64,
K = 3) on the package's thread pool, their workspace call gone after host lowering, and a
planted register-file size of zero that the structural assertion catches."""
import numpy as np
import pytest
import tvm
import tvm_einweld  # noqa: F401  (registers the pipelines)
from tvm import tirx
from tvm.script import tirx as T
from tvm_ffi import structural_map

from tvm_einweld.tir_passes import stack_buffers
from tvm_einweld.tir_passes.deinterleave import TIR_PIPELINE
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu import gemm
from tvm_einweld.tir_passes.rules.cpu.isa import vector_isa

TARGET = host_target()
ISA = vector_isa(TARGET)
RNG = np.random.default_rng(11)


def _allocs(mod) -> dict:
    """name -> (scope, bytes, on the stack by annotation) of every AllocBuffer in `mod`."""
    found = {}

    def alloc(node):
        buf = node.buffer
        found[buf.name] = (buf.scope(), stack_buffers._constant_bytes(buf),
                           stack_buffers.DISABLE_LOWER_BUILTIN in node.annotations)
        return node

    structural_map(mod, [(tirx.AllocBuffer, alloc)])
    return found


def _workspace_sizes(mod) -> list[int]:
    """Byte sizes of the TVMBackendAllocWorkspace calls left after host lowering."""
    sizes = []

    def call(node):
        if isinstance(node.op, tvm.ir.Op) and node.op.name == "tirx.TVMBackendAllocWorkspace":
            sizes.append(int(node.args[2]))  # (device type, device id, bytes, ...)
        return node

    structural_map(mod, [(tvm.ir.Call, call)])
    return sizes


def scratch(sizes: dict) -> tirx.PrimFunc:
    """A function that allocates one buffer per entry of `sizes` (name -> (elements, scope)),
    fills it and sums it into B: lowered, it shows which allocations the pass moves."""
    (na, sa), (nb, sb), (nc, sc) = sizes.values()

    @T.prim_func(s_tir=True)
    def func(B: T.Buffer((3,), "float32")):
        a = T.sblock_alloc_buffer((na,), "float32", scope=sa)
        b = T.sblock_alloc_buffer((nb,), "float32", scope=sb)
        c = T.sblock_alloc_buffer((nc,), "float32", scope=sc)
        for i in range(na):
            with T.sblock("fa"):
                vi = T.axis.remap("S", [i])
                a[vi] = T.Cast("float32", vi)
        for i in range(nb):
            with T.sblock("fb"):
                vi = T.axis.remap("S", [i])
                b[vi] = T.Cast("float32", vi)
        for i in range(nc):
            with T.sblock("fc"):
                vi = T.axis.remap("S", [i])
                c[vi] = T.Cast("float32", vi)
        B[0] = a[na - 1]
        B[1] = b[nb - 1]
        B[2] = c[nc - 1]

    return func.with_attr("global_symbol", "main")


def _bound(func: tirx.PrimFunc) -> tvm.IRModule:
    """`func` in a module, bound to the host target as `tvm.tirx.build` binds it."""
    target = TARGET.with_host(TARGET)
    return tvm.tirx.transform.BindTarget(target)(tvm.IRModule({"main": func}))


def _lower(func: tirx.PrimFunc, pipeline: str = "default") -> tvm.IRModule:
    """TVM's TIR lowering (without the host finalisation) of `func` for the host."""
    return tvm.tirx.get_tir_pipeline(pipeline)[0](_bound(func))


def test_which_allocations_move():
    limit = stack_buffers.register_file_bytes(TARGET)
    assert limit == ISA.registers * ISA.bits // 8
    elements = limit // 4
    mod = _lower(scratch({"a": (elements, "local"), "b": (elements + 1, "local"),
                          "c": (8, "global")}))
    moved = stack_buffers.StackLocalBuffers()(mod)
    allocs = {name[0]: v for name, v in _allocs(moved).items()}
    assert allocs["a"] == ("local", limit, True)       # fits the register file
    assert allocs["b"][2] is False                      # one element too many
    assert allocs["c"][2] is False                      # global scope: TVM's own rule
    # the budget: only as many bytes as it allows, the rest stay workspaces
    func = next(iter(mod.functions.values()))
    small = stack_buffers.stack_local_buffers(func, limit, budget=limit - 1)
    assert not any(v[2] for v in _allocs(small).values())


def test_generic_and_foreign_functions_left_alone():
    mod = _lower(scratch({"a": (16, "local"), "b": (16, "local"), "c": (16, "local")}))
    func = next(iter(mod.functions.values())).with_attr("target", tvm.target.Target("cuda"))
    assert stack_buffers.StackLocalBuffers()(tvm.IRModule({"main": func}))["main"].same_as(
        func)


_TALL = max(1, min(13, (ISA.registers - 3) // 2))  # rows of a 2-vector block that fits


def _gemm(m: int, n: int, k: int, dtype: str, tiling: gemm.Tiling | None):
    a = tvm.te.placeholder((m, k), dtype, name="A")
    b = tvm.te.placeholder((k, n), dtype, name="B")
    r = tvm.te.reduce_axis((0, k), "k")
    c = tvm.te.compute((m, n), lambda i, j: tvm.te.sum(a[i, r] * b[r, j], axis=r), name="C")
    func = tvm.te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")
    return gemm.schedule_gemm(func, TARGET, tiling).mod["main"]


@pytest.mark.parametrize("m,n,k,dtype", [(65, 1000, 32, "float32"), (97, 89, 101, "float32"),
                                         (26, 67, 3, "float32"), (31, 17, 19, "float64")])
def test_register_blocks_on_the_stack_against_numpy(m, n, k, dtype):
    """A 13 x 2-vector block (1664 bytes of float32 on AVX-512, more than TVM's 1 KiB stack
    limit; 2 vectors of the ISA on any target) is an annotated stack buffer, no workspace call
    of its size is left, and the parallel tiles compute the product numpy does."""
    lanes = ISA.lanes(dtype)
    mr = _TALL
    tiling = gemm.Tiling(gemm.RegisterBlock(mr, 2, lanes), mr, k)
    func = _gemm(m, n, k, dtype, tiling)
    block_bytes = mr * 2 * lanes * np.dtype(dtype).itemsize
    lowered = _lower(func, TIR_PIPELINE)
    accumulators = [v for v in _allocs(lowered).values() if v[0] == "local"]
    assert accumulators == [("local", block_bytes, True)]
    assert block_bytes not in _workspace_sizes(tvm.tirx.get_tir_pipeline(TIR_PIPELINE)[1]()(
        lowered))
    lib = tvm.tirx.build(tvm.IRModule({"main": func}), target=TARGET, pipeline=TIR_PIPELINE)
    a, b = RNG.standard_normal((m, k)).astype(dtype), RNG.standard_normal((k, n)).astype(dtype)
    out = tvm.runtime.tensor(np.zeros((m, n), dtype))
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)  # the package's pool
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=tol, atol=tol)


def test_planted_zero_register_file_is_caught(monkeypatch):
    """With the limit planted at 0 bytes the accumulator stays a workspace: no buffer is
    annotated and host lowering allocates the block as a workspace, which the assertions of
    the test above reject."""
    monkeypatch.setattr(stack_buffers, "register_file_bytes", lambda target: 0)
    mr, lanes = _TALL, ISA.lanes("float32")
    tiling = gemm.Tiling(gemm.RegisterBlock(mr, 2, lanes), mr, 32)
    lowered = _lower(_gemm(mr * 5, 64, 32, "float32", tiling), TIR_PIPELINE)
    assert [v for v in _allocs(lowered).values() if v[0] == "local"] == [
        ("local", mr * 2 * lanes * 4, False)]
    host = tvm.tirx.get_tir_pipeline(TIR_PIPELINE)[1]()
    assert mr * 2 * lanes * 4 in _workspace_sizes(host(lowered))
