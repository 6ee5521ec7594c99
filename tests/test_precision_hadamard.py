"""The 16 x 16 random Hadamard transform of NVIDIA's NVFP4 recipe (applied to the weight-gradient
GEMM's inputs along K, the tokens): orthonormal, the GEMM unchanged (exactly on small integers,
within float32's rounding bound otherwise), an outlier token spread over its block of 16."""

import numpy as np
import pytest

from minimp.precision.hadamard import hadamard_matrix, hadamard_transform, random_hadamard_matrix

UNIT_FP32 = 2.0**-24


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n float32 roundings."""
    return n * UNIT_FP32 / (1 - n * UNIT_FP32)


def test_sylvester_matrix_is_its_closed_form_and_orthogonal():
    """Sylvester's H_n has H[i, j] = (-1)^popcount(i & j), written here without the doubling."""
    index = np.arange(16)
    ones_in_common = np.vectorize(lambda v: bin(v).count("1"))(index[:, None] & index[None, :])
    h = hadamard_matrix(16)
    assert np.array_equal(h, (-1.0) ** ones_in_common)
    assert np.array_equal(h @ h.T, 16 * np.eye(16))


def test_the_random_hadamard_matrix_is_orthonormal_in_float32_exactly():
    r = random_hadamard_matrix(np.random.default_rng(3))
    assert r.dtype == np.float32
    assert np.array_equal(r @ r.T, np.eye(16)) and np.array_equal(r.T @ r, np.eye(16))
    column_signs = 4 * r / hadamard_matrix(16)  # R = H diag(s) / 4: one sign per column
    assert (column_signs == column_signs[:1]).all() and set(column_signs[0]) <= {-1.0, 1.0}
    again = random_hadamard_matrix(np.random.default_rng(3))
    other = random_hadamard_matrix(np.random.default_rng(4))
    assert np.array_equal(r, again) and not np.array_equal(r, other)


def test_the_weight_gradient_is_unchanged_exactly_on_small_integers(rng):
    """(R dY)^T (R X) = dY^T X: with integers below 8 every step is exact in float64."""
    r = random_hadamard_matrix(rng)
    grad_output = rng.integers(-8, 8, (64, 5)).astype(np.float64)
    inputs = rng.integers(-8, 8, (64, 7)).astype(np.float64)
    transformed = hadamard_transform(grad_output, r).T @ hadamard_transform(inputs, r)
    assert np.array_equal(transformed, grad_output.T @ inputs)


def test_the_weight_gradient_in_float32_is_within_its_rounding_bound(rng):
    """Each transformed value is 16 products by +-1/4 (exact) summed: error <= gamma_15 |R||A|;
    the GEMM over T tokens adds gamma_T, so |error| <= ((1 + gamma_T)(1 + gamma_15)^2 - 1)
    (|R||dY|)^T (|R||X|), against the float64 product of the untransformed operands."""
    tokens = 256
    r = random_hadamard_matrix(rng)
    grad_output = rng.normal(size=(tokens, 24)).astype(np.float32)
    inputs = (rng.normal(size=(tokens, 40)) * 2.0 ** rng.uniform(-6, 6, 40)).astype(np.float32)
    ours = hadamard_transform(grad_output, r).T @ hadamard_transform(inputs, r)
    exact = grad_output.astype(np.float64).T @ inputs.astype(np.float64)
    quarter = np.full((16, 16), 0.25)  # |R|
    magnitudes = (hadamard_transform(np.abs(grad_output).astype(np.float64), quarter).T
                  @ hadamard_transform(np.abs(inputs).astype(np.float64), quarter))
    bound = ((1 + gamma(tokens)) * (1 + gamma(15)) ** 2 - 1) * magnitudes
    assert (np.abs(ours - exact) <= bound).all()


def max_over_rms(blocks: np.ndarray) -> np.ndarray:
    """max |x| / rms(x) over axis 1: sqrt(16) = 4 for a lone spike, 1 for equal magnitudes."""
    return np.abs(blocks).max(axis=1) / np.sqrt((blocks.astype(np.float64) ** 2).mean(axis=1))


def test_an_outlier_token_is_spread_over_its_block_of_16(rng):
    r = random_hadamard_matrix(rng)
    spike = np.zeros((16, 1), np.float32)
    spike[5] = 100.0
    assert (np.abs(hadamard_transform(spike, r)) == 25.0).all()  # 16 values of 100 / 4
    x = rng.normal(size=(256, 64)).astype(np.float32)
    x[37] = 100.0  # token 37, in the third block of 16, is an outlier in every channel
    before = max_over_rms(x.reshape(16, 16, 64))[2]
    after = max_over_rms(hadamard_transform(x, r).reshape(16, 16, 64))[2]
    assert (before > 3.5).all() and (after < 2.0).all()


def test_a_token_count_not_divisible_by_16_is_refused(rng):
    r = random_hadamard_matrix(rng)
    with pytest.raises(ValueError, match="T a multiple of 16, got shape"):
        hadamard_transform(np.ones((100, 8), np.float32), r)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
