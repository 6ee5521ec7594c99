"""accumulate's limited accumulator compiled by numba, which is imported when first used.

The loop is accumulate._limited_numpy's, step for step: for each product position t of the
interval, every running sum of a row of outputs adds fl32(a_it b_tj) in float32, then rounds to
`bits` significant bits on its bit pattern. The row of running sums stays in L1 cache and each
of the two inner loops becomes SIMD code; NumPy makes a full (M, N) temporary for each of the
four or five operations of every step. numba is optional: without it `available()` is False and
accumulate runs the NumPy loop.
"""

from functools import cache
from typing import Any

import numpy as np

from minimp.precision.halfcast_numba import available  # one question: does numba import?

__all__ = ["available", "interval_sum"]


def interval_sum(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(M, N) float32: a (M, I) @ b (I, N) summed over I in the `bits`-bit accumulator."""
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    _compiled()(np.ascontiguousarray(a), np.ascontiguousarray(b), 24 - bits, out)
    return out


@cache
def _compiled() -> Any:
    """Compile the loop once per process (numba caches its machine code on disk between runs)."""
    import numba

    @numba.njit(cache=True)
    def interval_sum_loop(a, b, dropped, out):  # pragma: no cover (compiled; tests compare it)
        m, interval = a.shape
        n = b.shape[1]
        # uint32 constants keep the lanes 32-bit (numba's integer default is 64)
        half_less_one = np.uint32((1 << (dropped - 1)) - 1)
        keep = np.uint32(0xFFFFFFFF ^ ((1 << dropped) - 1))
        shift, one = np.uint32(dropped), np.uint32(1)
        abs_mask, infinity = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)
        sums = np.empty(n, np.float32)
        pattern = sums.view(np.uint32)  # the same memory, read as bits for the rounding
        for i in range(m):
            sums[:] = 0
            for t in range(interval):
                a_it = a[i, t]
                for j in range(n):  # float32 throughout: fl32(s + fl32(a b)), no fused multiply-add
                    sums[j] = sums[j] + a_it * b[t, j]
                for j in range(n):  # round_to_significant_bits; NaN kept (a carry could flip sign)
                    p = pattern[j]
                    rounded = (p + half_less_one + ((p >> shift) & one)) & keep
                    pattern[j] = p if (p & abs_mask) > infinity else rounded
            out[i, :] = sums

    return interval_sum_loop
