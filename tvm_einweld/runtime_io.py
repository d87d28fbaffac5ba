"""How numpy arrays meet TVM's runtime, in one place: the alignment TVM's kernels assume, an
aligned copy, a VM argument read in place where TVM can, and a VM result as numpy arrays.

Used by the benchmark workers (`bench.isolation`, `bench.runners`), the ONNX backend
(`models.onnx_backend`) and the kernel checks (`tir_passes.measure`, which also puts guard
zones around its copies).
"""
from __future__ import annotations

import numpy as np

# TVM's kernels declare their buffers 64-byte aligned: a tensor is read in place only at that
# alignment (onnxruntime and OpenVINO read any).
BUFFER_ALIGNMENT = 64


def place_aligned(raw: np.ndarray, offset: int, array: np.ndarray,
                  alignment: int = BUFFER_ALIGNMENT) -> np.ndarray:
    """A copy of `array` inside the byte buffer `raw`, starting at its first address that is a
    multiple of `alignment` at or after byte `offset` (`raw` needs `alignment` bytes of slack)."""
    source = np.asarray(array, order="C")  # (np.ascontiguousarray makes a 0-d array 1-d)
    start = offset + (-(raw.ctypes.data + offset)) % alignment
    out = raw[start:start + source.nbytes].view(source.dtype).reshape(source.shape)
    out[...] = source
    return out


def aligned(array: np.ndarray, alignment: int = BUFFER_ALIGNMENT) -> np.ndarray:
    """A C-contiguous copy of `array` whose data starts at a multiple of `alignment` bytes.
    The benchmark worker gives every runner its inputs this way, so each runtime reads the same
    arrays in place (onnxruntime does with any numpy array; TVM needs the alignment) instead of
    one runner paying a copy into its own allocation on each call."""
    return place_aligned(np.empty(array.nbytes + alignment, np.uint8), 0, array, alignment)


def vm_input(array: np.ndarray) -> "tvm.runtime.Tensor":
    """A TVM tensor for a numpy input: the array itself (DLPack, no copy) where TVM can read it
    in place, C-contiguous and `BUFFER_ALIGNMENT`-aligned (`aligned`), as onnxruntime reads any
    numpy input; else (read-only, non-native byte order, a dtype numpy does not export, empty)
    a copy. A Relax function does not write its parameters, so the caller's array is left as
    it was."""
    import tvm  # pylint: disable=import-outside-toplevel

    # numpy exports neither read-only arrays nor ml_dtypes' (bfloat16, float8) through DLPack
    if array.flags.c_contiguous and array.flags.writeable and array.dtype.isnative and \
            array.dtype.kind in "biuf" and array.size and \
            array.ctypes.data % BUFFER_ALIGNMENT == 0:
        return tvm.runtime.from_dlpack(array)
    return tvm.runtime.tensor(np.asarray(array, order="C"))


def flatten_outputs(result: object) -> list[np.ndarray]:
    """A VM result (a tensor, or nested tuples of them) as the list of its numpy arrays."""
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [array for item in result for array in flatten_outputs(item)]
