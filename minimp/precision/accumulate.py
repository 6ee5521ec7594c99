"""How a low-precision GEMM accumulates: in fp32, or in 14 bits promoted to fp32 every 128 products.

DeepSeek-V3 (technical report, section 3.3, "Increasing Accumulation Precision") measured that
the H800's tensor cores keep only about 14 significant bits while they sum the products of an fp8
GEMM. Summing K = 4096 products in such an accumulator loses the small ones once the running sum
has grown (swamping), so DeepSeek promotes: after every N_C = 128 products the partial sum is
copied to an fp32 register on the CUDA cores and added there, and the tensor cores begin a new one.

The emulation (`limited_accumulation`). For an output c_ij and each K interval q of `interval`
products p_k = fl32(a_ik b_kj), the accumulator starts at 0 and, for each product in turn,

    s <- round_b(fl32(s + p_k))          round_b: to b = `bits` significant bits, ties to even,

then the intervals' sums are added in fp32: c_ij = fl32(sum over q of s_q). The rounding is after
every addition. Rounded once per interval instead, a whole-K interval would err by at most 2^-b of
its sum, as 32 promoted intervals of 128 do, and the promotion could not matter; rounded at every
step, the error grows with the number of additions made in b bits, which is what the promotion
bounds. NVIDIA does not publish the accumulator's rounding; round-to-nearest-even is this
emulation's choice. Each step depends on the one before, so the NumPy loop runs over the
`interval` positions of an interval (128, however long K is), each step a few NumPy operations on
the running sums of every output at once; with numba installed the same loop runs compiled
(accumulate_numba.py), bit for bit the same sums, about 25 times faster (a (768 x 128) @ (128 x
512) product: 0.35 s in NumPy, 0.013 s compiled, measured 2026-12-06 on this machine).

The bound. Each product is rounded once in fp32, then at most `interval` times by an fp32 addition
and a b-bit rounding, then at most K/interval - 1 times by the fp32 sum of the intervals, so

    |c_ij - sum_k a_ik b_kj| <= ((1 + 2^-24)^(interval + K/interval) (1 + 2^-b)^interval - 1)
                                 * sum_k |a_ik b_kj|,

about interval * 2^-b = 128 * 2^-14 = 0.8% of sum |a b| at worst (the sums of random products
come far closer). Plain fp32 accumulation has the same bound without the b-bit factor.

`blockwise_matmul` is DeepSeek-V3's fine-grained fp8 GEMM (section 3.3, "Fine-Grained
Quantization"): a's values come in 1 x 128 tiles, b's in 128 x 128 blocks, each with its own
scale, and every 128-wide K block's partial sum is multiplied by its two scales and added in fp32.
"""

from functools import reduce
from typing import Literal

import numpy as np

from minimp.precision import accumulate_numba
from minimp.precision.casting import FLOAT32

# The significant bits DeepSeek-V3 measured in the H800's fp8 accumulator (section 3.3).
TENSOR_CORE_BITS = 14
# N_C: the products summed on the tensor cores before each promotion to fp32 (section 3.3).
PROMOTION_INTERVAL = 128

Accumulate = Literal["fp32", "limited"]


def round_to_significant_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 values rounded to `bits` significant bits (2 to 24), to nearest, ties to even.

    Done on the bit pattern: adding half the dropped part's weight less one, plus the last kept
    bit (so a tie goes up only from an odd kept value), then clearing the dropped bits. A carry
    out of the fraction raises the exponent, as the next binade needs; past float32's largest
    number it gives inf, as round-to-nearest does. Subnormals round on the same grid as the
    smallest normals, as bfloat16's do (bits = 8 is float32 -> bfloat16). NaN stays NaN.
    """
    if not 2 <= bits <= 24:  # with one bit every significand is 1: no tie has an even side
        raise ValueError(f"bits must be between 2 and 24 (float32 keeps 24), got {bits}")
    x = np.asarray(x, dtype=FLOAT32)
    dropped = 24 - bits
    if dropped == 0:
        return x.copy()
    pattern = x.view(np.uint32)
    last_kept = (pattern >> np.uint32(dropped)) & np.uint32(1)
    half_less_one = np.uint32((1 << (dropped - 1)) - 1)
    keep = np.uint32(0xFFFFFFFF ^ ((1 << dropped) - 1))
    rounded = ((pattern + half_less_one + last_kept) & keep).view(FLOAT32)
    return np.where(np.isnan(x), x, rounded)  # a NaN's carry could reach the sign bit


def _check_shapes(a: np.ndarray, b: np.ndarray, interval: int) -> None:
    """A clear ValueError unless a is (M, K), b (K, N) and interval divides K."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"a (M, K) times b (K, N): got shapes {a.shape} and {b.shape}")
    if a.shape[1] % interval:
        raise ValueError(f"K = {a.shape[1]} is not a multiple of the interval {interval}")


def _limited_numpy(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """(M, N): a (M, I) @ b (I, N) summed over I in the module docstring's b-bit accumulator."""
    sums = np.zeros((a.shape[0], b.shape[1]), dtype=FLOAT32)
    for t in range(a.shape[1]):  # one product per step into every running sum at once
        products = a[:, t, None] * b[None, t, :]  # (M, N), fl32(a b)
        sums = round_to_significant_bits(sums + products, bits)
    return sums


def _interval_sum(a: np.ndarray, b: np.ndarray, bits: int | None) -> np.ndarray:
    """(M, N): a (M, I) @ b (I, N) summed in plain fp32 (BLAS, bits None) or in the b-bit
    accumulator (compiled when numba is installed, the same sums either way)."""
    if bits is None:
        return a @ b  # fp32 on purpose: what the promotion restores
    if accumulate_numba.available():
        return accumulate_numba.interval_sum(a, b, bits)
    return _limited_numpy(a, b, bits)


def _blocks(k: int, interval: int) -> list[slice]:
    """The K intervals of `interval` values, in order."""
    return [slice(start, start + interval) for start in range(0, k, interval)]


def limited_accumulation(a: np.ndarray, b: np.ndarray, interval: int = PROMOTION_INTERVAL,
                         bits: int = TENSOR_CORE_BITS) -> np.ndarray:
    """a @ b (float32, (M, K) @ (K, N)) summed in a `bits`-bit accumulator promoted to fp32
    every `interval` products (the module docstring's emulation); K a multiple of interval."""
    a, b = np.asarray(a, dtype=FLOAT32), np.asarray(b, dtype=FLOAT32)
    _check_shapes(a, b, interval)
    # fp32 on purpose: the promoted partial sums add up on the CUDA cores' fp32 registers, in order
    return reduce(np.add, (_interval_sum(a[:, cols], b[cols], bits)
                           for cols in _blocks(a.shape[1], interval)))


def blockwise_matmul(a_values: np.ndarray, a_scales: np.ndarray, b_values: np.ndarray,
                     b_scales: np.ndarray, block: int = 128,
                     accumulate: Accumulate = "fp32") -> np.ndarray:
    """DeepSeek-V3's fine-grained GEMM: each K block's partial product times its scales, summed.

    a_values (M, K) has a scale per 1 x block tile, a_scales (M, K/block); b_values (K, N) one per
    block x block block, b_scales (K/block, ceil(N/block)), or one per block x 1 column, b_scales
    (K/block, N) (DeepGEMM's "1D-1D" weight-gradient GEMM, where both operands are activations
    or gradients scaled along K). A scale multiplies the values back to
    what they stand for (PyTorch's `_scaled_mm` and DeepGEMM's convention; Transformer Engine's
    scale_inv). The values are float32 arrays (normally holding fp8 values; any float32 works).
    Each K block's partial sum P_q (M, N) is taken in plain fp32 (accumulate="fp32") or in the
    14-bit accumulator promoted at the block's end (accumulate="limited"); then
    out = fl32(sum over q of P_q * fl32(a_scales[:, q] b_scales[q, j // block])).
    """
    if accumulate not in ("fp32", "limited"):
        raise ValueError(f'accumulate must be "fp32" or "limited", got {accumulate!r}')
    a_values, b_values = np.asarray(a_values, FLOAT32), np.asarray(b_values, FLOAT32)
    a_scales, b_scales = np.asarray(a_scales, FLOAT32), np.asarray(b_scales, FLOAT32)
    _check_shapes(a_values, b_values, block)
    (m, k), n = a_values.shape, b_values.shape[1]
    blocks = k // block
    b_shapes = ((blocks, -(-n // block)), (blocks, n))  # per block x block block, or per column
    if a_scales.shape != (m, blocks) or b_scales.shape not in b_shapes:
        raise ValueError(f"with block {block}, a {a_values.shape} needs scales ({m}, {blocks}) "
                         f"and b {b_values.shape} scales ({blocks}, {-(-n // block)}) or "
                         f"({blocks}, {n}); got {a_scales.shape} and {b_scales.shape}")
    bits = TENSOR_CORE_BITS if accumulate == "limited" else None
    if b_scales.shape == (blocks, n):  # already one per column (the same thing when n is 1)
        b_columns = b_scales
    else:
        b_columns = np.repeat(b_scales, block, axis=1)[:, :n]  # (Q, N): each column's block scale

    def scaled_partial(q: int, cols: slice) -> np.ndarray:
        """P_q (M, N) times fl32(sa sb)."""
        partial = _interval_sum(a_values[:, cols], b_values[cols], bits)
        partial *= a_scales[:, q, None] * b_columns[q]
        return partial

    # fp32 on purpose: DeepSeek-V3 scales and adds the promoted partial sums in fp32, in order
    return reduce(np.add, (scaled_partial(q, cols) for q, cols in enumerate(_blocks(k, block))))
