"""Dropout's counter hash pinned bit for bit against SplitMix64 written out in plain Python ints,
and the op's own contract: offset 0 by default, p = 0 keeps everything, p outside [0, 1) refused."""

import numpy as np
import pytest

from minimp import Tensor, ops
from minimp import functional as F
from minimp.ops.dropout import keep_mask, stream_key

GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (Steele, Lea & Flood 2014)
WORD = 2**64


def splitmix64_mix(z):
    """SplitMix64's finalizer, as published (Vigna's splitmix64.c), on a Python int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % WORD
    return z ^ (z >> 31)


def splitmix64_outputs(state, count):
    """The first `count` outputs of a SplitMix64 generator started at `state`."""
    return [splitmix64_mix((state + (i + 1) * GAMMA) % WORD) for i in range(count)]


def expected_key(seed, step, layer):
    """key = mix(mix(mix(seed + g) + step + g) + layer + g), as the module docstring has it."""
    key = splitmix64_mix((seed % WORD + GAMMA) % WORD)
    key = splitmix64_mix((key + step % WORD + GAMMA) % WORD)
    return splitmix64_mix((key + layer % WORD + GAMMA) % WORD)


def expected_mask(shape, p, seed, step, layer, samples, offset=0):
    """keep = mix(key + (n + 1) g) >= p 2^64 with n = sample 2^32 + offset + position."""
    key, per_sample = expected_key(seed, step, layer), int(np.prod(shape[1:]))
    keep = np.zeros((len(samples), per_sample), bool)
    for row, sample in enumerate(samples):
        for position in range(per_sample):
            n = sample * 2**32 + offset + position
            bits = splitmix64_mix((key + (n + 1) * GAMMA) % WORD)
            keep[row, position] = bits >= p * 2**64  # int against float: Python compares exactly
    return keep.reshape(shape)


def test_the_reference_is_splitmix64_by_its_published_outputs():
    assert splitmix64_outputs(0, 4) == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC,
    ]  # fmt: skip
    assert splitmix64_outputs(1234567, 3) == [
        6457827717110365317, 3203168211198807973, 9817491932198370423,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "seed, step, layer", [(0, 0, 0), (5, 3, 7), (2**63 + 11, 1, 2), (-1, 2**40, 9)]
)
def test_a_stream_key_is_three_rounds_of_splitmix64(seed, step, layer):
    assert stream_key(seed, step, layer) == expected_key(seed, step, layer)


@pytest.mark.parametrize("p", [0.3, 0.7])
def test_the_mask_is_splitmix64_of_the_counters_bit_for_bit(p):
    shape, samples = (3, 2, 4), [3, 0, 2**32 - 1]
    got = keep_mask(shape, p, 5, 3, 7, np.array(samples), offset=5)
    np.testing.assert_array_equal(got, expected_mask(shape, p, 5, 3, 7, samples, offset=5))


def test_the_op_draws_the_positions_from_0_when_no_offset_is_given():
    x = np.arange(1, 25, dtype=np.float32).reshape(2, 3, 4)
    y = ops.Dropout.apply(Tensor(x), p=0.5, seed=1, step=2, layer=3, sample_indices=[4, 9]).data
    keep = expected_mask(x.shape, 0.5, 1, 2, 3, [4, 9], offset=0)
    np.testing.assert_array_equal(y, np.where(keep, 2 * x, 0))  # 1 / (1 - 0.5) = 2: exact


def test_the_op_keeps_everything_at_p_0():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 12)
    y = ops.Dropout.apply(Tensor(x), p=0.0, seed=1, step=2, layer=3, sample_indices=[0, 1]).data
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("p", [1.0, 1.5, -0.25])
def test_a_probability_outside_0_to_1_is_refused_by_the_op(p):
    x = Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"lie in \[0, 1\)"):
        F.dropout(x, p, 1, 2, 3, [0, 1])


def test_keep_mask_draws_the_positions_from_0_when_no_offset_is_given():
    got = keep_mask((2, 3, 4), 0.5, 1, 2, 3, np.array([4, 9]))
    np.testing.assert_array_equal(got, expected_mask((2, 3, 4), 0.5, 1, 2, 3, [4, 9], offset=0))


def test_sample_indices_are_read_flat_whatever_their_shape():
    one = keep_mask((1, 5), 0.5, 1, 2, 3, 7)  # a lone sample index, as a scalar
    np.testing.assert_array_equal(one, expected_mask((1, 5), 0.5, 1, 2, 3, [7]))
    grid = keep_mask((6, 5), 0.5, 1, 2, 3, np.arange(6).reshape(2, 3))  # row-major: 0, 1, ..., 5
    np.testing.assert_array_equal(grid, expected_mask((6, 5), 0.5, 1, 2, 3, range(6)))


@pytest.mark.parametrize("samples", [[-1], [2**32], [3, 2**32], [-1, 2**32]])
def test_sample_indices_outside_0_to_2_32_minus_1_are_refused(samples):
    # 2^32 would shift out of the counter's top half: sample 2^32 would draw sample 0's bits.
    with pytest.raises(ValueError, match=r"sample indices must lie in 0\.\.2\^32 - 1"):
        keep_mask((len(samples), 4), 0.5, 1, 2, 3, np.array(samples))


@pytest.mark.parametrize("offset", [-1, 2**32 - 4, 2**32])
def test_positions_must_end_below_2_32_minus_1(offset):
    # A sample of 4 elements (2 x 2) from `offset` on: offset + 4 >= 2^32 is refused.
    with pytest.raises(ValueError, match=r"a sample may hold at most 2\^32 - 1 elements"):
        keep_mask((2, 2, 2), 0.5, 1, 2, 3, np.array([0, 1]), offset=offset)


def test_the_last_positions_allowed_draw_their_own_bits():
    offset = 2**32 - 5  # positions 2^32 - 5 .. 2^32 - 2: offset + 4 = 2^32 - 1, the largest allowed
    got = keep_mask((2, 2, 2), 0.5, 1, 2, 3, np.array([0, 2**32 - 1]), offset=offset)
    np.testing.assert_array_equal(
        got, expected_mask((2, 2, 2), 0.5, 1, 2, 3, [0, 2**32 - 1], offset=offset)
    )


def splitmix64_unmix(z):
    """The inverse of splitmix64_mix: undo each xorshift and multiply, last first."""
    z = z ^ (z >> 31) ^ (z >> 62)
    z = (z * pow(0x94D049BB133111EB, -1, WORD)) % WORD
    z = z ^ (z >> 27) ^ (z >> 54)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, WORD)) % WORD
    return z ^ (z >> 30) ^ (z >> 60)


def counter_drawing(bits, key):
    """The counter n whose hash mix(key + (n + 1) g) is `bits`, as (sample, position)."""
    n = ((splitmix64_unmix(bits) - key) * pow(GAMMA, -1, WORD) - 1) % WORD
    assert splitmix64_mix((key + (n + 1) * GAMMA) % WORD) == bits  # the inverse is right
    return n >> 32, n % 2**32


@pytest.mark.parametrize("p", [0.0, 0.25, 0.5])
def test_an_element_whose_bits_equal_p_2_64_is_kept_and_one_below_is_dropped(p):
    seed, step, layer = 5, 3, 7
    key, threshold = expected_key(seed, step, layer), int(p * 2**64)  # exact for these p
    for bits, kept in [(threshold, True), (threshold - 1, False)][: 2 if threshold else 1]:
        sample, position = counter_drawing(bits, key)
        assert position < 2**32 - 1, "pick another seed: this position is out of range"
        got = keep_mask((1, 1), p, seed, step, layer, np.array([sample]), offset=position)
        assert got[0, 0] == kept, f"bits {bits:#x} against p 2^64 = {threshold:#x}"
