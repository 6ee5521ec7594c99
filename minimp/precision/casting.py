"""Mixed precision's named dtypes and its only two casts: widen to float32, round back once.

Why an op widens: float16 keeps 11 significant bits, so a sum or a dot product done in
float16 loses the small terms (2048 + 1 == 2048 in float16). Tensor cores and GPU kernels
therefore read half-precision inputs, compute in float32 registers and round the result
once when they store it. minimp does the same on NumPy, which also happens to be faster:
NumPy has no SIMD float16 arithmetic (~8 ns per element here) while float32 arithmetic costs
~0.2 ns and the casts around it ~0.4 ns (float16 -> float32) and ~0.6 ns (float32 -> float16).
Those are minimp's own casts, written from the bit layout and compiled by numba
(`halfcast.py`); NumPy's astype takes ~1.6 and ~2.5 ns, and 65 ns for a result that
overflows or lands among float16's subnormals. CuPy arrays keep CuPy's casts, which a GPU
fuses into its kernels.

Every cast in minimp goes through `widen` and `round_to`, so a benchmark can count them.
"""

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from minimp.backend import Array
from minimp.precision import halfcast

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)

# The optimizer's copy of every weight: float32, so updates below half a float16 ulp still land.
MASTER_DTYPE = FLOAT32
# Where matmul, sums, means, softmax and losses accumulate, whatever their inputs are stored in.
ACCUMULATE_DTYPE = FLOAT32
# What activations (and so their gradients) are stored in, by the name the training command uses.
ACTIVATION_DTYPES = {"fp32": FLOAT32, "fp16": FLOAT16, "bf16": BFLOAT16}
LOW_PRECISION_DTYPES = (FLOAT16, BFLOAT16)


def is_low_precision(dtype: DTypeLike) -> bool:
    """True for the 16-bit floats that must not be used as accumulators."""
    return np.dtype(dtype) in LOW_PRECISION_DTYPES


def is_floating(dtype: DTypeLike) -> bool:
    """float16, bfloat16, float32 and float64: the dtypes that can carry gradients."""
    return is_low_precision(dtype) or np.issubdtype(np.dtype(dtype), np.floating)


def dtype_named(dtype: DTypeLike) -> np.dtype:
    """A dtype from a NumPy dtype, a type, or a name the training command uses ("fp16", "bf16",
    "fp32"); a clear ValueError for anything else."""
    if isinstance(dtype, str) and dtype.strip().lower() in ACTIVATION_DTYPES:
        return ACTIVATION_DTYPES[dtype.strip().lower()]
    try:
        return np.dtype(dtype)
    except TypeError:
        names = ", ".join(ACTIVATION_DTYPES)
        raise ValueError(f"unknown dtype {dtype!r}: use a NumPy dtype or one of {names}") from None


def widen(array: Array) -> Array:
    """The array in float32 when stored in 16 bits; float32/float64 arrays come back unchanged."""
    if array.dtype in LOW_PRECISION_DTYPES:
        return round_to(array, ACCUMULATE_DTYPE)  # exact: every 16-bit value is a float32 value
    return array


def round_to(array: Array, dtype: DTypeLike) -> Array:
    """The array rounded (to nearest, ties to even) into dtype; no copy when it is already there."""
    if array.dtype == dtype:
        return array
    if type(array) is np.ndarray:  # CuPy arrays keep CuPy's own casts
        # float32 <-> float16 only: from float64, going through float32 would round twice.
        if dtype == FLOAT16 and array.dtype == FLOAT32:
            return halfcast.to_float16(array)
        if dtype == FLOAT32 and array.dtype == FLOAT16:
            return halfcast.to_float32(array)  # a widening, exact (the optimizer's gradients)
    return array.astype(dtype)


def result_dtype(*dtypes: DTypeLike) -> np.dtype:
    """The dtype of an op on inputs of these dtypes
    (NumPy's promotion; float16 with bfloat16 -> float32)."""
    try:
        return np.result_type(*dtypes)
    except TypeError:  # ml_dtypes' bfloat16 has no promotion rule with float16
        return FLOAT32
