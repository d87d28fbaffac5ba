"""TileGraphFusion end to end: fused modules equal the unfused ones after tvm.compile."""
from dataclasses import replace

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir
from tvm.script import tirx as T
from tvm_ffi import structural_equal

from conftest import compile_vm, run_vm
from tvm_einweld.tir_passes import (TileGraphFusion, compile_pipeline, pipeline, prepare,
                                    workloads)
from tvm_einweld.tir_passes import codegen
from tvm_einweld.tir_passes import fusion as fusion_mod
from tvm_einweld.tir_passes.cost import propagate_subgraph
from tvm_einweld.tir_passes.device import MemoryLevel, cpu_device
from tvm_einweld.tir_passes.localize import allocations
from tvm_einweld.tir_passes.measure import generated_source
from tvm_einweld.tir_passes.propagate import leaf_blocks


def _run(mod, args):
    return run_vm(mod, *args)


def _random_args(mod, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype("float32")
            for p in mod["main"].params]


def _call_tir_targets(mod):
    main = mod["main"]
    return [b.value.args[0].name_hint for blk in main.body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]


def _fuse_and_compare(mod, **kwargs):
    mod = prepare()(mod)
    fuse = TileGraphFusion("llvm", topk=2, **kwargs)
    fused = fuse(mod)
    args = _random_args(mod)
    np.testing.assert_allclose(_run(fused, args), _run(mod, args), rtol=1e-4, atol=1e-4)
    return mod, fused, fuse.report


def _multi_node_groups(report):
    return [names for names in report.replaced if len(names) > 1]


def test_matmul_softmax_fused_by_model_and_equal():
    """With the analytic rules, the pair is one merged function for `rules.cpu.gemm_rows`
    (the GEMM's micro-kernel with the softmax in its row tiles): no tile config."""
    mod, fused, report = _fuse_and_compare(workloads.matmul_softmax(256, 32, 64), measure=False)
    assert _multi_node_groups(report), report
    assert len(_call_tir_targets(fused)) == 1
    (group,) = report.plan.groups
    assert group.candidate is None and len(group.sub.nodes) == 2
    from tvm_einweld.tir_passes.rules.cpu import schedule_cpu
    claim = schedule_cpu(fused[_call_tir_targets(fused)[0]], tvm.target.Target("llvm"))
    assert claim is not None and claim[0] == "gemm-rows"


def test_matmul_softmax_tile_kernel_by_model_and_equal():
    """Without the analytic rules, Welder's tile kernel: the matmul result in tile scratch."""
    mod, fused, report = _fuse_and_compare(workloads.matmul_softmax(256, 32, 64), measure=False,
                                           rules=False)
    assert _multi_node_groups(report), report
    assert len(_call_tir_targets(fused)) == 1
    kernel = fused[_call_tir_targets(fused)[0]]
    # The matmul result is a tile scratch buffer under the parallel tile loop, not a tensor.
    scratch = [b for _, b, depth in allocations(kernel) if depth > 0]
    assert any(b.scope() == "local" for b in scratch)
    assert not [b for _, b, depth in allocations(kernel) if depth == 0]
    # Its exp is fast_math's vectorisable formula, as in the rules' kernels, not libm's.
    assert "T.exp(" not in kernel.script()


def test_matmul_softmax_measured_choice_is_equal():
    # Measurement may or may not connect the pair; either way the result must be right and every
    # priced group carries a measured latency.
    _, _, report = _fuse_and_compare(workloads.matmul_softmax(256, 32, 64), measure=True)
    assert report.plan.groups and all(g.latency > 0 for g in report.plan.groups)


def test_conv_relu_maxpool():
    _, fused, report = _fuse_and_compare(
        workloads.conv_relu_maxpool(channels=4, size=16, filters=8), measure=False)
    assert _multi_node_groups(report)
    assert len(_call_tir_targets(fused)) == 1


def test_layernorm_chain():
    _, _, report = _fuse_and_compare(workloads.layernorm_chain(rows=64, dim=64), measure=False)
    assert _multi_node_groups(report)


def test_bert_attention_block():
    mod, fused, report = _fuse_and_compare(
        workloads.bert_attention(seq=32, hidden=32, heads=2), measure=False)
    assert _multi_node_groups(report)
    assert len(_call_tir_targets(fused)) < len(_call_tir_targets(mod))


def _small_l1_cpu():
    """This CPU with an 8 KiB L1: the fused tiles' working sets must be split into sub-tiles."""
    cpu = cpu_device()
    return replace(cpu, levels=cpu.levels[:2] + (MemoryLevel("L1", 8 * 1024, 64,
                                                             cpu.levels[2].bandwidth),))


def _split_sub_tiles(graph, group):
    """The SubTiles of a planned group that really split their node's tile."""
    plan = propagate_subgraph(graph, group.sub, group.candidate.config)
    return [t for t in group.candidate.inner
            if tuple(plan.tiles[graph.node(t.node).output]) != tuple(t.config.tile)]


@pytest.mark.parametrize("build", [
    lambda: workloads.matmul_softmax(256, 32, 64),
    lambda: workloads.conv_relu_maxpool(channels=4, size=16, filters=8),
    lambda: workloads.layernorm_chain(rows=64, dim=64),
    lambda: workloads.bert_attention(seq=32, hidden=32, heads=2),
], ids=["matmul_softmax", "conv_relu_maxpool", "layernorm_chain", "bert_attention"])
def test_two_level_tiles_equal_unfused(build):
    # An 8 KiB L1 makes the scheduler split the fused tiles into L1 sub-tiles, which the code
    # generator turns into the inner loop nests; the module must still compute the same values.
    # Tile kernels only (rules=False): the analytic rules would claim some merged groups.
    mod, fused, report = _fuse_and_compare(build(), measure=False, device=_small_l1_cpu(),
                                           rules=False)
    assert _multi_node_groups(report)
    graph = fusion_mod.build_tile_graph(mod)
    fused_groups = [g for g in report.plan.groups
                    if tuple(n.name for n in g.sub.nodes) in report.replaced]
    assert any(_split_sub_tiles(graph, g) for g in fused_groups)


def _loops(stmt) -> int:
    """The number of For loops in a TIR statement tree."""
    if isinstance(stmt, tvm.tirx.PrimFunc):
        return _loops(stmt.body)
    if isinstance(stmt, tvm.tirx.SeqStmt):
        return sum(_loops(s) for s in stmt.seq)
    count = int(isinstance(stmt, tvm.tirx.For))
    for attr in ("block", "body", "init", "then_case", "else_case"):
        child = getattr(stmt, attr, None)
        if isinstance(child, tvm.tirx.Stmt):
            count += _loops(child)
    return count


def test_sub_tiles_become_the_inner_loop_nest():
    mod = prepare()(workloads.matmul_softmax(4096, 64, 128))
    graph = fusion_mod.build_tile_graph(mod)
    sub = fusion_mod.subgraph(graph, [n.name for n in graph.nodes])
    device = _small_l1_cpu()
    cand = fusion_mod.subgraph_tiling(graph, sub, device, 1)[0]
    split = [t for t in cand.inner if t.node == graph.nodes[0].name]
    assert split, cand  # the matmul's tile does not fit 8 KiB: it has an L1 sub-tile
    factory = fusion_mod.KernelFactory(graph, device)
    plain = factory.kernel(sub, cand.config)
    tiled = factory.kernel(sub, cand.config, cand.inner)
    assert plain is not None and tiled is not None
    assert _loops(tiled) > _loops(plain)  # the sub-tile loops around the matmul's inner nest
    assert fusion_mod.check_group(tiled, graph, sub).ok


def test_unsupported_scalar_output_is_left_unchanged():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 32), "float32"))
    w = relax.Var("w", relax.TensorType((32, 16), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(relax.op.sum(y))
        bb.emit_func_output(out)
    mod, fused, report = _fuse_and_compare(bb.get(), measure=False)
    # The scalar sum cannot be tiled: its call is the original PrimFunc, the matmul alone is tiled.
    assert mod["main"].body.blocks[0].bindings[-1].value.args[0].name_hint in _call_tir_targets(
        fused)
    assert not _multi_node_groups(report)


def _exp_read_twice(return_exp: bool):
    """exp(x) read by a row sum and a row max, added; with `return_exp` exp(x) is returned
    too (a reader outside every group)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            e = bb.emit(relax.op.exp(x))
            s = bb.emit(relax.op.sum(e, axis=[1], keepdims=True))
            m = bb.emit(relax.op.max(e, axis=[1], keepdims=True))
            out = relax.op.add(s, m)
            out = bb.emit_output(relax.Tuple([out, e]) if return_exp else out)
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def test_shared_intermediate_joins_the_group_of_all_its_readers():
    """exp(x) is read by two nodes. Welder's edge-by-edge sweep keeps such a tensor in memory;
    once both readers are in one group, exp joins it where that prices lower
    (`scheduler._join_shared_producers`): it then lives only in tiles. The fused module
    computes what numpy does."""
    mod = _exp_read_twice(False)
    fuse = TileGraphFusion("llvm", topk=1, measure=False)
    fused = fuse(mod)
    exp_node = mod["main"].body.blocks[0].bindings[0].var.name
    readers = {c for a, c in fuse.report.plan.connected if a == exp_node}
    assert len(readers) == 2, fuse.report.plan.connected
    assert any(exp_node in names and len(names) == 4 for names in fuse.report.replaced)
    x = np.random.default_rng(0).standard_normal((64, 64)).astype("float32")
    e = np.exp(x)
    np.testing.assert_allclose(run_vm(fused, x), e.sum(1, keepdims=True) +
                               e.max(1, keepdims=True), rtol=1e-5)


def test_shared_intermediate_read_outside_stays_in_dram():
    """The same exp(x), also returned: a reader outside every group, so it stays in memory."""
    mod = _exp_read_twice(True)
    fuse = TileGraphFusion("llvm", topk=1, measure=False)
    fuse(mod)
    exp_node = mod["main"].body.blocks[0].bindings[0].var.name
    assert not any(exp_node == a for a, _ in fuse.report.plan.connected)


def test_intermediate_read_by_a_packed_call_stays_in_memory():
    # matmul -> relu could be one group, but the matmul result is also read by a packed
    # function (as numpy_gemm calls in derived programs are): it must not become a tile buffer.
    from tvm_einweld.relay_passes import numpy_gemm
    from tvm_einweld.tir_passes.tile_graph import build_tile_graph

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 32), "float32"))
    w = relax.Var("w", relax.TensorType((32, 32), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            r = bb.emit(relax.op.nn.relu(y))
            g = bb.emit(numpy_gemm.matmul_call(y, w))
            out = bb.emit_output(relax.op.add(r, g))
        bb.emit_func_output(out)
    mod = prepare()(bb.get())
    assert y.name in build_tile_graph(mod).outputs
    fused = TileGraphFusion("llvm", topk=1, measure=False)(mod)
    relax.analysis.well_formed(fused)
    args = _random_args(mod)
    np.testing.assert_allclose(_run(fused, args), _run(mod, args), rtol=1e-4, atol=1e-4)


def _relu_graph():
    """matmul + ReLU with matmul_softmax(128, 32, 64)'s signature: a planted wrong kernel."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((128, 32), "float32"))
    b = relax.Var("b", relax.TensorType((32, 64), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(bb.emit(relax.op.matmul(a, b))))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def test_planted_wrong_analytic_group_is_rejected(monkeypatch):
    """The analytic rules' kernel of a merged group (gemm_rows's matmul + softmax) is checked
    like a tile kernel: planted to compute matmul + ReLU, the group is rejected and the
    module keeps the two kernels, still equal."""
    wrong = TileGraphFusion("llvm", topk=1, measure=False, rules=False)(_relu_graph())
    wrong_kernel = wrong[_call_tir_targets(wrong)[0]]
    from tvm_einweld.tir_passes.rules import cpu as rules_cpu
    real = rules_cpu.schedule_cpu

    def planted(func, target, families=None):
        claim = real(func, target, families)
        return (claim[0], wrong_kernel) if claim and claim[0] == "gemm-rows" else claim

    monkeypatch.setattr(rules_cpu, "schedule_cpu", planted)
    mod = relax.transform.LegalizeOps()(workloads.matmul_softmax(128, 32, 64))
    fuse = TileGraphFusion("llvm", topk=1, measure=False)
    out = fuse(mod)
    assert fuse.report.rejected and "max abs error" in fuse.report.rejected[0][1]
    assert not _multi_node_groups(fuse.report)
    args = _random_args(mod)
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-4, atol=1e-4)


def test_planted_wrong_kernel_is_rejected(monkeypatch):
    # Every kernel the factory hands out computes matmul+ReLU instead of matmul+softmax: the check
    # on random inputs must catch it and leave the module as it was.
    wrong = TileGraphFusion("llvm", topk=1, measure=False)(_relu_graph())
    wrong_kernel = wrong[_call_tir_targets(wrong)[0]]
    real_kernel = fusion_mod.KernelFactory.kernel
    mod = relax.transform.LegalizeOps()(workloads.matmul_softmax(128, 32, 64))

    monkeypatch.setattr(fusion_mod.KernelFactory, "kernel",
                        lambda self, sub, config, inner=(): wrong_kernel if len(sub.nodes) == 2
                        else None)
    # (The tile kernels' path: with the analytic rules the pair is gemm_rows's, no tile config.)
    fuse = TileGraphFusion("llvm", topk=1, measure=False, rules=False)
    out = fuse(mod)
    assert fuse.report.rejected and not fuse.report.replaced
    assert "max abs error" in fuse.report.rejected[0][1]
    # The fallback to single nodes gets no kernel from the planted factory either: unchanged.
    tvm.ir.assert_structural_equal(out["main"], mod["main"])

    # With real single-node kernels the fallback tiles matmul and softmax separately.
    monkeypatch.setattr(
        fusion_mod.KernelFactory, "kernel",
        lambda self, sub, config, inner=(): wrong_kernel if len(sub.nodes) == 2
        else real_kernel(self, sub, config, inner))
    fuse = TileGraphFusion("llvm", topk=1, measure=False, rules=False)
    out = fuse(mod)
    assert sorted(fuse.report.replaced) == sorted((n.name,) for n in
                                                  fusion_mod.build_tile_graph(mod).nodes)
    args = _random_args(mod)
    np.testing.assert_allclose(_run(out, args), _run(mod, args), rtol=1e-4, atol=1e-4)


def test_is_a_pass_in_sequential():
    mod = workloads.matmul_softmax(128, 32, 64)
    seq = tvm.transform.Sequential([prepare(), TileGraphFusion("llvm", topk=1, measure=False)])
    assert isinstance(pipeline("llvm"), tvm.transform.Pass)
    assert isinstance(TileGraphFusion("llvm"), tvm.transform.Pass)
    fused = seq(mod)
    # A second run finds only scheduled kernels and leaves the module alone.
    again = TileGraphFusion("llvm", topk=1, measure=False)
    tvm.ir.assert_structural_equal(again(fused), fused)
    args = _random_args(mod)
    np.testing.assert_allclose(_run(fused, args), _run(prepare()(mod), args), rtol=1e-4,
                               atol=1e-4)


def test_cuda_build_keeps_intermediate_in_shared_memory():
    # Large enough that 108 SMs stay busy with fused 16-row tiles (the model prefers them).
    mod = prepare()(workloads.matmul_softmax(16384, 64, 128))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    fuse = TileGraphFusion(target, topk=1)
    fused = fuse(mod)
    assert _multi_node_groups(fuse.report)
    ex = tvm.compile(fused, target=target)
    source = generated_source(ex, "cuda")
    assert source, "no CUDA module was generated"
    # The matmul has a per-thread register tile (threads = tile / sub-tile): each thread
    # accumulates its sub-tile in a local array of that size.
    group = fuse.report.plan.groups[0]
    register = [t for t in group.candidate.inner if t.node == group.sub.nodes[0].name]
    assert register, group.candidate
    size = int(np.prod(register[0].config.tile))
    assert size > 1 and f"float matmul_intermediate_local_ptr[{size}];" in source
    # The matmul result C lives in shared memory; only x, w and the softmax output are pointers.
    assert "__shared__" in source
    assert "matmul_intermediate_shared" in source
    assert "__syncthreads()" in source
    kernel_sig = [line for line in source.splitlines() if "__global__" in line]
    assert all("matmul_intermediate" not in line for line in kernel_sig)


def test_cuda_lone_gemm_keeps_its_call_for_dlight():
    """On a GPU target a GEMM the plan leaves alone keeps its call and gets DLight's matmul
    (NeRF's GEMMs as single-node tile kernels ran 11x slower than TVM's build on an H200),
    while a GEMM joined with its softmax is still one tile kernel."""
    from tvm.relax import op

    def body(bb, x, w1, w2):
        hidden = bb.emit(op.nn.relu(bb.emit(op.matmul(x, w1))))
        return op.matmul(hidden, w2)

    mod = prepare()(workloads._module([("x", (4096, 64)), ("w1", (64, 256)),
                                       ("w2", (256, 256))], body))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    fuse = TileGraphFusion(target, topk=1)
    fused = fuse(mod)
    assert not fuse.report.replaced and len(fuse.report.analytic) == 2, fuse.report
    tvm.ir.assert_structural_equal(fused, mod)
    source = generated_source(tvm.compile(fused, target=target), "cuda")
    kernels = [line for line in source.splitlines() if "__global__" in line]
    assert kernels and not any("tile_" in k for k in kernels), kernels
    assert "matmul_reindex" in source  # DLight's matmul rule reindexes its operands
    assert not fusion_mod.gpu_matmul(mod[_call_tir_targets(mod)[0]], tvm.target.Target("llvm"))


def test_cuda_build_of_conv_relu_maxpool():
    mod = prepare()(workloads.conv_relu_maxpool(channels=16, size=56, filters=32))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    fuse = TileGraphFusion(target, topk=1)
    fused = fuse(mod)
    assert _multi_node_groups(fuse.report) and not fuse.report.rejected
    source = generated_source(tvm.compile(fused, target=target), "cuda")
    # The conv+ReLU tile feeding the pooling window is a shared-memory buffer.
    assert "__shared__" in source and "__syncthreads()" in source


def test_compile_pipeline_for_tvm_compile():
    mod = workloads.layernorm_chain(rows=64, dim=64)
    run = compile_vm(mod, "llvm", relax_pipeline=compile_pipeline("llvm", topk=1))
    args = _random_args(mod)
    got = run(*args)
    np.testing.assert_allclose(got, _run(prepare()(mod), args), rtol=1e-4, atol=1e-4)


def test_gemm_with_prologue_and_epilogue_becomes_one_analytic_kernel():
    """A reshape feeding a matmul with a constant weight, then bias add and ReLU: the group's
    merged function is priced under the analytic GEMM rule (which inlines the reshape and
    applies the epilogue in the output tile), replaces the four calls as one, and, scheduled
    by that rule, computes what the unfused module does."""
    from tvm_einweld.tir_passes.device import host_target
    from tvm_einweld.tir_passes.rules.cpu import ApplyCPURules

    rng = np.random.default_rng(3)
    x = relax.Var("x", relax.TensorType((2, 37, 40), "float32"))
    w = relax.const(rng.standard_normal((40, 53)).astype("float32"))
    b = relax.const(rng.standard_normal((53,)).astype("float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(x, (74, 40)))
            out = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.matmul(flat, w), b)))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    mod = prepare()(bb.get())
    target = host_target()
    fuse = TileGraphFusion(target, measure=False)
    fused = fuse(mod)
    groups = [g for g in fuse.report.analytic if "+" in g]
    assert groups, fuse.report
    assert len(_call_tir_targets(fused)) == 1
    rules = ApplyCPURules(target)
    scheduled = rules(fused)
    assert "gemm" in rules.scheduled.values()
    args = _random_args(mod)
    ex = tvm.compile(scheduled, target)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    np.testing.assert_allclose(got.numpy(), _run(mod, args), rtol=1e-4, atol=1e-4)


@T.prim_func(s_tir=True)
def _ragged_rows(a: T.Buffer((8, 16), "float32"), b: T.Buffer((8, 16), "float32")):
    for i in range(8):
        for j in range(i * 2 + 1):  # row i has 2i + 1 elements: an extent that varies per row
            with T.sblock("B"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.spatial(16, j)
                b[vi, vj] = a[vi, vj] * T.float32(2)


def test_a_tile_dependent_extent_stays_scalar():
    """compute_at gives a producer the region one tile reads, which varies from tile to tile
    where the consumer reads it through a reshape (CSRNet on a 2 MiB-L2 Xeon: `(tile % 10 %
    9 + 6) % 7 + 1` elements). The code generator took every loop extent for a constant and
    failed the whole compile (TypeError on int()); such a loop now stays as it is, scalar,
    and the function computes what it did."""
    sch = s_tir.Schedule(_ragged_rows)
    rv = sch.get_sblock("B")
    assert codegen._split_sub_tile(sch, rv, 1, ((16,), (4,))) == []
    codegen._vectorize_inner(sch, rv, 1)
    assert structural_equal(sch.mod["main"], _ragged_rows)
    a = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    b = tvm.runtime.tensor(np.zeros((8, 16), "float32"))
    tvm.compile(sch.mod, target="llvm")["main"](tvm.runtime.tensor(a), b)
    want = np.where(np.arange(16)[None, :] < 2 * np.arange(8)[:, None] + 1, 2 * a, 0)
    np.testing.assert_allclose(b.numpy(), want)


def test_a_code_generator_defect_costs_the_group_not_the_compile(monkeypatch, caplog):
    """Planted fault: the code generator raises an unforeseen error (a TypeError, as the
    tile-dependent extent above did) on every group; the fusion pass leaves every group as it
    was, says so, and the module still computes what it did."""
    def broken(*args, **kwargs):
        raise TypeError("planted")

    monkeypatch.setattr(fusion_mod, "schedule_group", broken)
    with caplog.at_level("WARNING", logger=fusion_mod.logger.name):
        _, fused, report = _fuse_and_compare(
            workloads.conv_relu_maxpool(channels=4, size=16, filters=8), measure=False)
    assert not _multi_node_groups(report)
    assert "code generation failed (TypeError: planted)" in caplog.text


def _channel_layer_norm(channels=32, size=12):
    """NAFNet's LayerNorm2d as ONNX exports it: statistics over the channel axis of NCHW."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, channels, size, size + 3), "float32"))
    rng = np.random.default_rng(1)
    gamma, beta = (relax.const(rng.standard_normal((channels, 1, 1)).astype("float32"))
                   for _ in range(2))
    with bb.function("main", [x]):
        with bb.dataflow():
            mean = bb.emit(relax.op.mean(x, axis=[1], keepdims=True))
            centred = bb.emit(relax.op.subtract(x, mean))
            var = bb.emit(relax.op.mean(relax.op.multiply(centred, centred), axis=[1],
                                        keepdims=True))
            deviation = bb.emit(relax.op.sqrt(relax.op.add(var, relax.const(1e-6, "float32"))))
            scaled = bb.emit(relax.op.multiply(relax.op.divide(centred, deviation), gamma))
            out = bb.emit_output(relax.op.add(scaled, beta))
        bb.emit_func_output(out)
    return bb.get()


def _tile_buffers(kernel):
    """Shapes of the tile buffers under a kernel's tile loop."""
    return [[int(d) for d in b.shape] for _, b, depth in allocations(kernel) if depth > 0]


def test_tile_kernel_recomputes_cheap_values_and_keeps_the_square_root():
    """`codegen.inline_cheap_spatial`: in the channel LayerNorm's tile kernel x - mean, its
    square, the division and the affine scaling are recomputed where read (no tile buffer
    spans the channels); the square root, one per position and read by every channel, and the
    two reductions stay per-position tile buffers. Equal to the unfused module."""
    mod, fused, report = _fuse_and_compare(_channel_layer_norm(), measure=False, rules=False)
    (names,) = _multi_node_groups(report)
    kernel = fused[_call_tir_targets(fused)[0]]
    buffers = _tile_buffers(kernel)
    assert len(buffers) == 3 and all(shape[1] == 1 for shape in buffers), buffers
    sqrt_blocks = [b for b in leaf_blocks(kernel) if "sqrt" in b.body.value.script()
                   if isinstance(b.body, tvm.tirx.BufferStore)]
    assert len(sqrt_blocks) == 1, [b.name_hint for b in leaf_blocks(kernel)]


def test_inlining_keeps_an_expensive_value_read_twice_and_a_padded_input():
    """What `inline_cheap_spatial` must not recompute: exp(x) read by two reductions (once per
    element each: computed once, kept), and a convolution's padded input (read for every tap).
    The cheap sum of the two is recomputed where read. Equal to the function as it was."""
    from tvm import te, topi

    x = te.placeholder((1, 3, 10, 11), name="x")
    w = te.placeholder((4, 3, 3, 3), name="w")
    e = te.compute(x.shape, lambda n, c, h, v: te.exp(x[n, c, h, v]), name="e")
    c = te.reduce_axis((0, 3), name="c")
    total = te.compute((1, 1, 10, 11), lambda n, _, h, v: te.sum(e[n, c, h, v], axis=c),
                       name="total")
    c2 = te.reduce_axis((0, 3), name="c2")
    top = te.compute((1, 1, 10, 11), lambda n, _, h, v: te.max(e[n, c2, h, v], axis=c2),
                     name="top")
    both = te.compute(x.shape, lambda n, ch, h, v: x[n, ch, h, v] + total[n, 0, h, v]
                      + top[n, 0, h, v], name="both")
    out = topi.nn.conv2d_nchw(both, w, 1, 1, 1)
    func = te.create_prim_func([x, w, out])
    sch = s_tir.Schedule(func)
    codegen.inline_cheap_spatial(sch, func)
    kept = {b.name_hint for b in leaf_blocks(sch.mod["main"])}
    assert "e" in kept and "both" not in kept, kept
    assert any("pad" in name for name in kept), kept
    args = [np.random.default_rng(2).standard_normal([int(d) for d in t.shape]).astype("float32")
            for t in (x, w, out)]
    results = []
    for f in (func, sch.mod["main"]):
        bufs = [tvm.runtime.tensor(a) for a in args]
        tvm.compile(f, "llvm")(*bufs)
        results.append(bufs[-1].numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
