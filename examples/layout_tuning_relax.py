"""Adaptive layout tuning of a small conv network in Relax, then deployment.

    python examples/layout_tuning_relax.py [--trials 32]

Builds a two-block conv net with constant weights, tunes it with
``adaptive_layout_tuning_pass`` (the drop-in for
``static_shape_tuning_pipeline(..., cpu_weight_prepack=True)``), checks the tuned build
against the untuned one on a random input and prints both times.
"""
import argparse
import logging
import tempfile

import numpy as np
import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms

from tvm_einweld.auto_scheduler_ext import adaptive_layout_tuning_pass


def conv_net(rng):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 28, 28), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for cin, cout in ((16, 32), (32, 32)):
                w = relax.const(rng.standard_normal((cout, cin, 3, 3)).astype("float32") * 0.1)
                b = relax.const(rng.standard_normal((1, cout, 1, 1)).astype("float32"))
                y = bb.emit(relax.op.nn.conv2d(y, w, padding=1))
                y = bb.emit(relax.op.nn.relu(relax.op.add(y, b)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=32, help="trials per task")
    parser.add_argument("--selector", default="predefined", choices=["predefined", "bandit", "leader", "stall"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("tvm_einweld.auto_scheduler_ext").setLevel(logging.INFO)
    logging.getLogger("tvm_einweld.auto_scheduler_ext.search").setLevel(logging.WARNING)

    rng = np.random.default_rng(0)
    mod = conv_net(rng)
    target = tvm.target.Target({"kind": "llvm", "num-cores": ms.utils.cpu_count(logical=False)})
    work_dir = tempfile.mkdtemp(prefix="layout-tuning-")
    stage = adaptive_layout_tuning_pass(target, work_dir, max_trials_global=2 * args.trials,
                                        selector=args.selector, num_trials_per_iter=8)
    tuned = stage(mod)

    x = tvm.runtime.tensor(rng.standard_normal((1, 16, 28, 28)).astype("float32"))
    vms = {name: relax.VirtualMachine(tvm.compile(m, target), tvm.cpu())
           for name, m in (("untuned", mod), ("tuned", tuned))}
    np.testing.assert_allclose(vms["tuned"]["main"](x).numpy(), vms["untuned"]["main"](x).numpy(),
                               rtol=1e-4, atol=1e-4)
    for name, vm in vms.items():
        t = vm.time_evaluator("main", tvm.cpu(), number=10, repeat=5)(x)
        print(f"{name:8s} median {t.median * 1e3:.3f} ms")
    print(f"outputs agree; tuning records in {work_dir}")


if __name__ == "__main__":
    main()
