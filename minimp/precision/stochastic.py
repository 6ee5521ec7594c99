"""Stochastic rounding float32 -> bfloat16: up or down at random, so that the mean is exact.

bfloat16 is float32's upper half: the sign, the same 8 exponent bits and the top 7 of the 23
fraction bits. A float32 x lies between two bfloat16 numbers of its sign: t, x with its low 16
bits cleared, and t', the next one away from zero (t's bit pattern plus one in the upper half).
In magnitudes, |t'| = |t| + ulp and |x| = |t| + ulp * low / 2^16, where low is the 16 cleared
bits read as an integer. Round-to-nearest takes the closer one, so an update to a bf16 weight
smaller than half an ulp is lost every time. Stochastic rounding takes t' with probability
low / 2^16, so that

    E[|result|] = |t| + ulp * low / 2^16 = |x|,

exactly, for subnormals and negative numbers too. With 16 random bits r, uniform on 0 .. 2^16 - 1,
adding r to x's bit pattern and keeping the upper half carries into it for r >= 2^16 - low: for
low of the 2^16 values of r. That is OneTrainer's `copy_stochastic_` (Nerogar's, in PyTorch issue
#120376); llm.c's `stochastic_rounding` (llmc/cuda_utils.cuh) and torchao's `_fp32_to_bf16_sr`
have the same law, rounding away from zero when low > r. The random bits are passed in
(`draw_random_bits` takes them from a NumPy Generator): no global state.

Infinities stay (their low bits are zero). NaN stays NaN. A finite float32 beyond bfloat16's
largest value, 0x7F7F0000 = 3.3895e38, rounds to inf with probability low / 2^16, as it does to
nearest from halfway on: inf is the next bf16 pattern up.

An optimizer without float32 masters (`--master-weights none`, minimp/optim/optimizer.py) writes
each updated weight back with a `WeightRounding`: `to_nearest`, or `StochasticWeights`, which
draws its bits from a Generator seeded from (--seed, the step, the parameter's index).
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from minimp.backend import Array
from minimp.precision.accumulate import round_to_significant_bits
from minimp.precision.casting import BFLOAT16, FLOAT32, round_to

RANDOM_BITS = 16  # the float32 fraction bits bfloat16 drops


def draw_random_bits(generator: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """uint32 values uniform on 0 .. 2^16 - 1: the random bits of one stochastic rounding."""
    return generator.integers(0, 1 << RANDOM_BITS, size=shape, dtype=np.uint32)


def checked_random_bits(random_bits: np.ndarray) -> np.ndarray:
    """random_bits as an array, or a ValueError unless they are uint32 values below 2^16."""
    random_bits = np.asarray(random_bits)
    if random_bits.dtype != np.uint32 or np.any(random_bits >> np.uint32(RANDOM_BITS)):
        raise ValueError("random_bits must be uint32 values below 2^16 (draw_random_bits)")
    return random_bits


def _upper_halves(pattern: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The upper 16 bits of float32 bit patterns, as bfloat16; where x is NaN, the quiet NaN
    0x7FC0 with x's sign, as ml_dtypes' cast gives (a NaN whose payload sits in the low half
    would read as inf, and a carry out of 0x7FFFFFFF would flip the sign)."""
    upper = (pattern >> np.uint32(16)).astype(np.uint16)
    sign = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000)
    return np.where(np.isnan(x), sign | np.uint16(0x7FC0), upper).view(BFLOAT16)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 to nearest, ties to even: x rounded to bfloat16's 8 significant bits,
    then its upper half (ml_dtypes' cast gives the same bits, NaNs included)."""
    x = np.asarray(x, dtype=FLOAT32)
    return _upper_halves(round_to_significant_bits(x, 8).view(np.uint32), x)


def round_to_bfloat16_stochastic(x: np.ndarray, random_bits: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16, rounded away from zero with probability low / 2^16: the upper half of
    bits(x) + r, for random_bits r (uint32 below 2^16, one per element or broadcast)."""
    x, random_bits = np.asarray(x, dtype=FLOAT32), checked_random_bits(random_bits)
    return _upper_halves(x.view(np.uint32) + random_bits, x)  # a NaN's carry is replaced


# ----- writing an optimizer's float32 result into a bfloat16 weight (--master-weights none) ------

# Mixed into every stream's seed, so that these bits never repeat another draw made from --seed
# with the same numbers (the initial weights, the batch order, dropout's masks).
STREAM_TAG = 0x5352  # "SR"


class WeightRounding(Protocol):
    """How an optimizer without float32 masters writes the float32 result of parameter `index`'s
    update at step `step` (numbered from 1) into the parameter's dtype."""

    def __call__(self, weight: Array, dtype: np.dtype, step: int, index: int) -> Array: ...


def to_nearest(weight: Array, dtype: np.dtype, step: int, index: int) -> Array:
    """Round to nearest, ties to even (the cast every other write-back uses); step and index are
    unused: this rounding draws nothing."""
    return round_to(weight, dtype)


@dataclass(frozen=True)
class StochasticWeights:
    """Stochastic rounding into bfloat16, its random bits from a Generator seeded from (seed, the
    step, the parameter's index): no state is kept between steps, so every data-parallel replica
    draws the same bits (the replicas stay identical), and a run resumed after step k draws at
    step k + 1 exactly the bits the uninterrupted run drew (nothing to save in a checkpoint)."""

    seed: int

    def random_bits(self, shape: tuple[int, ...], step: int, index: int) -> np.ndarray:
        """The uint32 bits below 2^16 that round parameter `index` at step `step`."""
        return draw_random_bits(np.random.default_rng([self.seed, STREAM_TAG, step, index]), shape)

    def __call__(self, weight: Array, dtype: np.dtype, step: int, index: int) -> Array:
        if dtype != BFLOAT16:
            raise ValueError(f"stochastic rounding writes bfloat16 weights, not {dtype}")
        return round_to_bfloat16_stochastic(weight, self.random_bits(weight.shape, step, index))
