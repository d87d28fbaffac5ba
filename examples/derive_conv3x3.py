"""EinNet's motivating derivation (Fig. 5), applied rule by rule.

    python examples/derive_conv3x3.py

Prints every step (each rule instance's side conditions were proven by z3 before it was
produced), verifies the derived expression against the conv (exact screening modulo a prime
and random testing), and prints the instantiated Relax program: one Matmul + OffsetReduce.
`python -m tvm_einweld derive MODEL.onnx` runs the search that finds such programs itself.
"""
import numpy as np

from tvm_einweld.expr import Tensor, evaluate, random_inputs
from tvm_einweld.relay_passes import instantiate
from tvm_einweld.relay_passes.cases import conv3x3_to_matmul
from tvm_einweld.verify import verify_rewrite

data, weight = Tensor("A", (1, 64, 14, 14)), Tensor("K", (64, 64, 3, 3))
case = conv3x3_to_matmul(data, weight)
print("E1:", case.original[0])
for k, step in enumerate(case.steps, start=2):
    print(f"E{k}: [{step.rule}] {step.result}")

verdict = verify_rewrite(case.original[0], case.derived[0])
print("\nverification:", verdict)

inputs = random_inputs(case.original[0], seed=0)
err = np.abs(evaluate(case.derived[0], inputs) - evaluate(case.original[0], inputs)).max()
print(f"interpreter: max |derived - conv| = {err:.2e}")
print("\ninstantiated program:")
print(instantiate(case.derived[0]).mod)
