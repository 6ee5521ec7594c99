"""Attention's fused softmax in 16 bits: huge scores, -inf masks, fully masked rows: no NaN."""

import ml_dtypes
import numpy as np
import pytest

from minimp import Tensor
from minimp import functional as F

FLOAT16_MAX = 65504.0


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_scores_near_the_float16_maximum_give_a_finite_softmax(dtype, rng):
    scores = (FLOAT16_MAX - rng.uniform(0, 200, size=(2, 4, 8, 8))).astype(dtype)
    scores[..., ::2] *= -1  # -65504 too
    tensor = Tensor(scores, requires_grad=True)
    y = F.scaled_masked_softmax(tensor, 1 / 8)
    y.backward(rng.standard_normal(y.shape).astype(dtype))
    assert np.isfinite(y.data.astype(np.float32)).all() and np.isfinite(tensor.grad).all()
    np.testing.assert_allclose(y.data.astype(np.float32).sum(axis=-1), 1.0, atol=1e-2)
    assert (np.triu(np.ones((8, 8)), 1) * y.data.astype(np.float32) == 0).all()  # causal


def test_float16_exp_overflow_is_what_the_float32_softmax_avoids():
    logits = np.array([12.0, 11.0], np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(logits)).any()  # exp(12) > 65504: a float16 softmax gives inf/inf
    y = F.scaled_masked_softmax(Tensor(logits.reshape(1, 2)), 1.0, causal=False).data
    np.testing.assert_allclose(y.astype(np.float32), [[0.731, 0.269]], atol=1e-3)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=str)
def test_fully_masked_rows_give_zeros_and_zero_gradients(dtype, rng):
    scores = rng.standard_normal((2, 5, 5)).astype(dtype)
    mask = np.ones((5, 5), bool)
    mask[[1, 3]] = False  # queries 1 and 3 may see nothing (padding)
    tensor = Tensor(scores, requires_grad=True)
    y = F.scaled_masked_softmax(tensor, 0.5, mask=mask)
    y.backward(np.ones(y.shape, dtype))
    wide = y.data.astype(np.float32)
    assert not np.isnan(wide).any() and not np.isnan(tensor.grad.astype(np.float32)).any()
    assert (wide[:, [1, 3]] == 0).all() and (tensor.grad[:, [1, 3]] == 0).all()
    np.testing.assert_allclose(wide[:, [0, 2, 4]].sum(axis=-1), 1.0, atol=1e-2)


def test_masking_in_float16_with_a_large_negative_number_is_minus_infinity():
    """Why the mask is applied in float32: -1e9 does not exist in float16."""
    with np.errstate(over="ignore"):
        assert np.float16(-1e9) == -np.inf
    row = np.full(3, -np.inf, np.float16)
    with np.errstate(invalid="ignore"):
        assert np.isnan(row - row.max()).all()  # the naive fully masked row: (-inf) - (-inf)
