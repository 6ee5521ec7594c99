"""Attention's mask and fused softmax, LayerNorm and MatMul: their defaults, their mask and result
dtypes, the gradients they skip, and their 16-bit values pinned bit for bit against "compute in
float32 from the same inputs, round once" (the rule tests/test_values16.py states).

The ops' own defaults (`causal=True`, `eps=1e-5`) are reached through `Op.apply` without the
option: minimp.functional always passes it, so only a direct call can tell a changed default.
"""

import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in

from minimp import Tensor, ops
from minimp.function import Context
from minimp.ops.softmax import attention_mask

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)


def same_bits(actual, expected):
    """Equal dtype, shape and bit pattern (no NaNs in these tests)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    width = np.dtype(f"uint{8 * actual.dtype.itemsize}")
    np.testing.assert_array_equal(actual.view(width), expected.view(width))


def softmax_reference(scores, scale, keep):
    """The fused softmax written out in float32, rounded once into the scores' dtype."""
    wide = scores.astype(F32) * scale
    wide = np.where(keep, wide, F32.type(-np.inf))
    exps = np.exp(wide - wide.max(axis=-1, keepdims=True))
    return (exps / exps.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def test_attention_mask_is_causal_by_default_and_aligns_a_query_block_to_the_last_keys():
    """Two queries over four keys: query i sees keys up to i + T_k - T_q (the block sits at the
    end of the key sequence, as a decoder's new tokens do), not only up to key i."""
    keep = attention_mask(np, (3, 2, 4))
    assert keep.dtype == np.bool_
    np.testing.assert_array_equal(keep, [[True, True, True, False], [True, True, True, True]])


def test_scaled_masked_softmax_of_a_short_query_block_sees_the_keys_before_it():
    scores = np.array([[0.5, -1.0, 2.0, 3.0], [1.0, 0.25, -2.0, 0.75]], F16)
    y = ops.ScaledMaskedSoftmax.apply(Tensor(scores), scale=0.5, causal=True).data
    keep = np.array([[True, True, True, False], [True, True, True, True]])
    same_bits(y, softmax_reference(scores, 0.5, keep))
    assert y[0, 3] == 0 and y[1, 3] != 0


@pytest.mark.parametrize("causal", [False, True], ids=["mask only", "causal and mask"])
def test_attention_mask_reads_a_0_1_mask_as_bools(causal):
    """A mask may come as 0/1 integers (a list, a padding comparison cast to int): it is read as
    bool, so the result is a bool array that `where` and `&` treat as the mask it means."""
    mask = [[1, 0, 1], [1, 1, 0], [0, 1, 1]]
    keep = attention_mask(np, (3, 3), causal=causal, mask=mask)
    expected = np.array(mask, bool) & (np.tri(3, 3, dtype=bool) if causal else True)
    assert keep.dtype == np.bool_
    np.testing.assert_array_equal(keep, expected)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_scaled_masked_softmax_is_causal_by_default_and_rounds_once(dtype):
    """ScaledMaskedSoftmax.apply without `causal` masks the keys after each query (the op's
    default; functional.scaled_masked_softmax passes its own)."""
    scores = np.random.default_rng(7).uniform(-4, 4, size=(2, 5, 5)).astype(dtype)
    y = ops.ScaledMaskedSoftmax.apply(Tensor(scores), scale=0.75).data
    same_bits(y, softmax_reference(scores, 0.75, np.tri(5, 5, dtype=bool)))
    assert (y[:, np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] == 0).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "mask only"])
def test_scaled_masked_softmax_builds_its_mask_on_the_scores_device(monkeypatch, causal):
    """Device scores are masked with a device mask: `tri`, `asarray` and `where` come from the
    scores' module. With NumPy's instead, the causal mask is a host array (on a GPU,
    cupy.where then refuses it) and numpy.where's result is a host array. The stand-in's `tri`
    and `where` make DeviceLike arrays, as CuPy's make CuPy arrays (numpy.where would not keep
    the subclass)."""
    cupy = cupy_stand_in()
    cupy.tri = lambda *args, **kwargs: np.tri(*args, **kwargs).view(DeviceLike)
    cupy.where = lambda *args: np.where(*args).view(DeviceLike)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    host = np.array([[1.0, 2.0, -1.0], [0.5, 0.25, 3.0], [-2.0, 1.5, 0.0]], F16)
    mask = np.array([[True, True, False], [True, False, True], [False, True, True]])
    ctx = Context((True,))
    y = ops.ScaledMaskedSoftmax.forward(
        ctx, host.view(DeviceLike), 0.5, causal=causal, mask=mask.view(DeviceLike)
    )
    assert type(y) is DeviceLike and y.dtype == F16
    keep = mask & np.tri(3, 3, dtype=bool) if causal else mask
    same_bits(y.view(np.ndarray), softmax_reference(host, 0.5, keep))


@pytest.mark.parametrize(
    "a_dtype, b_dtype", [(F32, F16), (F16, F32)], ids=["float32 @ float16", "float16 @ float32"]
)
def test_matmul_of_mixed_dtypes_promotes_both_sides(a_dtype, b_dtype):
    """The result dtype is NumPy's promotion of both operands (float32 here), not either one's:
    the float32 product is kept, not rounded to 16 bits."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 4)).astype(a_dtype)
    b = rng.standard_normal((4, 2)).astype(b_dtype)
    y = ops.MatMul.apply(Tensor(a), Tensor(b)).data
    same_bits(y, a.astype(F32) @ b.astype(F32))


def layer_norm_reference(x, weight, bias, eps):
    wide = x.astype(F32)
    mean = wide.mean(axis=-1, keepdims=True)
    inverse_std = 1.0 / np.sqrt(((wide - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    return ((wide - mean) * inverse_std * weight.astype(F32) + bias.astype(F32)).astype(x.dtype)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_layer_norm_s_default_eps_is_1e_5_and_it_rounds_once(dtype):
    """LayerNorm.apply without eps uses 1e-5 (torch's default). Rows of small spread show it:
    an eps near 1 would swamp their variance."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 8)) * np.array([[0.01], [1.0], [30.0]])).astype(dtype)
    weight = rng.uniform(0.5, 1.5, 8).astype(dtype)
    bias = rng.uniform(-0.5, 0.5, 8).astype(dtype)
    y = ops.LayerNorm.apply(Tensor(x), Tensor(weight), Tensor(bias)).data
    same_bits(y, layer_norm_reference(x, weight, bias, 1e-5))


@pytest.mark.parametrize(
    "needs",
    [(True, False, False), (False, True, False), (False, False, True)],
    ids=["x only", "weight only", "bias only"],
)
def test_layer_norm_backward_skips_the_gradients_nobody_asked_for(needs):
    """Each gradient not asked for is None (not merely some placeholder), and the one asked for
    has its input's shape and dtype."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4)).astype(F32)
    weight, bias = rng.standard_normal(4).astype(F32), rng.standard_normal(4).astype(F32)
    ctx = Context(needs)
    ops.LayerNorm.forward(ctx, x, weight, bias)
    grads = ops.LayerNorm.backward(ctx, rng.standard_normal(x.shape).astype(F32))
    for grad, needed, like in zip(grads, needs, (x, weight, bias)):
        if needed:
            assert grad.shape == like.shape and grad.dtype == like.dtype
        else:
            assert grad is None
