"""Random inputs shared by the two sides of a comparison.

Both sides of a rewrite must read the *same* arrays, so inputs are drawn once per trial for
the union of the tensors the two expressions read. A tensor name that means different shapes
or dtypes on the two sides makes the comparison meaningless; `shared_tensors` reports it.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..expr.expression import Expr, Tensor, input_tensors


def shared_tensors(a: Expr, b: Expr) -> Tuple[Optional[Dict[str, Tensor]], str]:
    """(name -> tensor over both sides, "") or (None, why they cannot share inputs)."""
    ta, tb = input_tensors(a), input_tensors(b)
    for name in sorted(set(ta) & set(tb)):
        if (ta[name].shape, ta[name].dtype) != (tb[name].shape, tb[name].dtype):
            return None, (f"input {name} is {ta[name].dtype}{list(ta[name].shape)} on one side "
                          f"and {tb[name].dtype}{list(tb[name].shape)} on the other")
    return {**ta, **tb}, ""


def shape_mismatch(a: Expr, b: Expr) -> str:
    """"" when the outputs have equal shapes, else a sentence saying how they differ."""
    if a.shape == b.shape:
        return ""
    return f"output shapes differ: {list(a.shape)} vs {list(b.shape)}"


def draw(tensors: Dict[str, Tensor], seed: int, modulus: Optional[int] = None
         ) -> Dict[str, np.ndarray]:
    """One array per tensor (see `random_array`), the same for a given seed."""
    rng = np.random.default_rng(seed)
    return {name: random_array(rng, tensors[name].shape, tensors[name].dtype, modulus)
            for name in sorted(tensors)}


def random_array(rng: np.random.Generator, shape: Sequence[int], dtype: str,
                 modulus: Optional[int] = None) -> np.ndarray:
    """Uniform in [-1, 1] in `dtype` ({-1, 0, 1} for integers), or int64 residues mod p."""
    if modulus is not None:
        return rng.integers(0, modulus, size=tuple(shape), dtype=np.int64)
    if np.issubdtype(_numpy_dtype(dtype), np.integer):
        return rng.integers(-1, 2, size=tuple(shape)).astype(dtype)
    return rng.uniform(-1.0, 1.0, size=tuple(shape)).astype(_numpy_dtype(dtype))


def _numpy_dtype(dtype: str) -> np.dtype:
    # numpy has no bfloat16; draw in float32, which holds every bfloat16 value's neighbourhood.
    return np.dtype("float32") if dtype == "bfloat16" else np.dtype(dtype)


__all__ = ["shared_tensors", "shape_mismatch", "draw", "random_array"]
