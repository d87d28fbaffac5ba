"""TileGraphFusion on a BERT encoder layer (batch 1): which operators end up in one kernel.

Schedules the layer on this CPU (measuring the top-k tiles of every candidate group), prints the
groups with their tiles and measured latencies, the model's DRAM traffic with and without the
connections, and checks the fused module against the unfused one on random inputs.

    python examples/tile_fusion_bert.py [--seq 128 --hidden 256 --heads 4 --ffn 1024]
"""
import argparse
import time

import numpy as np
import tvm
from tvm import relax

from tvm_einweld.tir_passes import TileGraphFusion, prepare, workloads
from tvm_einweld.tir_passes.device import host_target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    args = parser.parse_args()
    target = host_target()
    mod = prepare()(workloads.bert_encoder(args.seq, args.hidden, args.heads, args.ffn))
    fuse = TileGraphFusion(target, topk=2)
    start = time.perf_counter()
    fused = fuse(mod)
    print(f"scheduled in {time.perf_counter() - start:.1f} s, "
          f"{fuse.report.measurements} kernels measured")
    for group in fuse.report.plan.groups:
        funcs = [n.gvar.name_hint for n in group.sub.nodes]
        print(f"  {len(funcs)} op(s) {funcs}: tile {group.candidate.config.tile}, "
              f"{group.latency * 1e3:.3f} ms, model traffic "
              f"{group.candidate.cost.traffic / 2**20:.2f} MiB")
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype("float32")
              for p in mod["main"].params]
    outs = []
    for m in (mod, fused):
        vm = relax.VirtualMachine(tvm.compile(m, target=target), tvm.cpu())
        outs.append(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy())
    print("fused == unfused:", np.allclose(outs[0], outs[1], rtol=1e-3, atol=1e-3))


if __name__ == "__main__":
    main()
