"""Tune one ResNet-50 conv block with each layout strategy and with the adaptive selector.

    python examples/layout_tuning_conv.py [--trials 32]

Uses ``tune_tir`` (the drop-in for ``meta_schedule.tune_tir``) on a pad + conv2d + bias + ReLU
block, prints the strategy of every round, and re-measures the best program of each run side
by side.
"""
import argparse
import logging
import tempfile

import tvm
from tvm.s_tir import meta_schedule as ms

from tvm_einweld.auto_scheduler_ext import comparison, tune_tir
from tvm_einweld.auto_scheduler_ext.workloads import Conv2dBlock


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--block", default="1,64,28,28,64,3,1,1", help="N,C,H,W,F,K,S,P")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    block = Conv2dBlock.parse(args.block)
    target = tvm.target.Target({"kind": "llvm", "num-cores": ms.utils.cpu_count(logical=False)})
    results = []
    for strategy in ("NL", "LR", "LC", "adaptive"):
        work_dir = tempfile.mkdtemp(prefix=f"layout-{strategy}-")
        done = []
        tune_tir(block.module(), target, work_dir, max_trials_global=args.trials, layout_strategy=strategy,
                 num_trials_per_iter=8, on_task=done.append,
                 on_round=lambda task, o: print(f"{strategy:8s} round {o.round_index + 1}: {o.strategy.value}"
                                                f"  best {o.best_so_far_secs * 1e3 if o.best_so_far_secs else float('nan'):.4f} ms"))
        results.append((strategy, comparison.best_program(block.module(), done[0])))
    secs = comparison.remeasure([sch for _, sch in results], target)
    for (strategy, _), t in zip(results, secs):
        print(f"{strategy:8s} {t * 1e3:.4f} ms  {block.flops / t / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
