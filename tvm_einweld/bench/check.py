"""Comparing a runner's outputs with the onnxruntime reference.

fp32 results from different backends differ by summation order, so the tolerance is
relative: |actual - expected| <= atol + rtol * |expected|, with atol scaled by the largest
reference magnitude (a value near zero in a large-valued output may carry the absolute
rounding error of its neighbours). A runner that computes in reduced precision by design
(OpenVINO's bf16 default) is checked against a looser `Tolerance`, and its error is reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

RTOL = 1e-3
ATOL_SCALE = 1e-4


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol_scale: float


FP32 = Tolerance(RTOL, ATOL_SCALE)
# bf16 keeps 8 significant bits (relative rounding 2^-8 = 0.4 %), and the error grows through
# a network's layers: a few percent of the largest output is still a faithful bf16 result.
BF16 = Tolerance(rtol=5e-2, atol_scale=3e-2)


@dataclass(frozen=True)
class Agreement:
    ok: bool
    max_abs_err: float
    max_ref: float
    detail: str

    def __str__(self) -> str:
        return self.detail

    @property
    def relative_error(self) -> float:
        """max |actual - expected| over the largest reference magnitude."""
        return self.max_abs_err / self.max_ref if self.max_ref else self.max_abs_err


def compare_outputs(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray],
                    rtol: float = RTOL, atol_scale: float = ATOL_SCALE) -> Agreement:
    if len(actual) != len(expected):
        return Agreement(False, float("inf"), 0.0,
                         f"{len(actual)} outputs, expected {len(expected)}")
    worst_err, worst_ref = 0.0, 0.0
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            return Agreement(False, float("inf"), 0.0,
                             f"output {i}: shape {a.shape}, expected {e.shape}")
        if not np.all(np.isfinite(a)):
            return Agreement(False, float("inf"), 0.0, f"output {i}: non-finite values")
        ref = float(np.max(np.abs(e))) if e.size else 0.0
        err = np.abs(a.astype(np.float64) - e.astype(np.float64))
        bound = atol_scale * max(ref, 1.0) + rtol * np.abs(e)
        max_err = float(err.max()) if err.size else 0.0
        worst_err, worst_ref = max(worst_err, max_err), max(worst_ref, ref)
        if np.any(err > bound):
            bad = int(np.count_nonzero(err > bound))
            return Agreement(False, max_err, ref,
                             f"output {i}: {bad}/{e.size} elements out of tolerance, "
                             f"max |err| {max_err:.3g} (max |ref| {ref:.3g})")
    return Agreement(True, worst_err, worst_ref,
                     f"max |err| {worst_err:.3g} (max |ref| {worst_ref:.3g})")
