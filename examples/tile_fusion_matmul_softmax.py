"""Welder's running example (§2): Matmul + Softmax fused through a tile-graph, on CPU and CUDA.

Prints the model's traffic for the paper's 4x128 and 16x128 tiles, the plan TileGraphFusion picks
on this CPU (measured), checks the fused module against the unfused one, and shows that the CUDA
build keeps the matmul tile in shared memory.

    python examples/tile_fusion_matmul_softmax.py
"""
import numpy as np
import tvm
from tvm import relax

from tvm_einweld.tir_passes import TileGraphFusion, cuda_device, prepare, workloads
from tvm_einweld.tir_passes.cost import TileConfig, tile_cost
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.measure import generated_source
from tvm_einweld.tir_passes.tile_graph import build_tile_graph, subgraph


def paper_arithmetic() -> None:
    graph = build_tile_graph(relax.transform.LegalizeOps()(workloads.matmul_softmax(98304, 64, 128)))
    sub = subgraph(graph, [n.name for n in graph.nodes])
    for tile in [(4, 128), (16, 128)]:
        cost = tile_cost(graph, sub, TileConfig(tile), cuda_device("v100"))
        print(f"tile {tile}: {cost.num_tiles} tiles, DRAM traffic {cost.traffic / 2**20:.0f} MiB, "
              f"shared-memory footprint {cost.footprint / 1024:.0f} KiB")


def cpu_fusion() -> None:
    target = host_target()
    mod = prepare()(workloads.matmul_softmax(8192, 64, 128))
    fuse = TileGraphFusion(target, topk=3)
    fused = fuse(mod)
    for group in fuse.report.plan.groups:
        names = [n.name for n in group.sub.nodes]
        print(f"group {names}: tile {group.candidate.config.tile}, "
              f"{group.latency * 1e3:.3f} ms measured")
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((8192, 64)).astype("float32"),
            rng.standard_normal((64, 128)).astype("float32")]
    outs = []
    for m in (mod, fused):
        vm = relax.VirtualMachine(tvm.compile(m, target=target), tvm.cpu())
        outs.append(vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy())
    print("fused == unfused:", np.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4))


def cuda_source() -> None:
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    mod = prepare()(workloads.matmul_softmax(16384, 64, 128))
    fused = TileGraphFusion(target, topk=1)(mod)
    ex = tvm.compile(fused, target=target)
    source = generated_source(ex, "cuda")
    print("\n".join(line for line in source.splitlines() if "__shared__" in line))


if __name__ == "__main__":
    paper_arithmetic()
    cpu_fusion()
    cuda_source()
