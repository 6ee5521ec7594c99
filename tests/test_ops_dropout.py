"""Dropout masks are a pure function of (seed, step, layer, sample, position): layouts agree."""

import numpy as np
import pytest

from minimp import Tensor, nn
from minimp import functional as F
from minimp.models import GPT, GPTConfig
from minimp.ops.dropout import keep_mask

SHAPE = (8, 4, 6, 6)  # (B, H, T, T): attention probabilities


def test_shards_and_micro_batches_draw_the_rows_of_the_whole_batch():
    whole = keep_mask(SHAPE, 0.2, 5, 3, 7, np.arange(8))
    shards = [keep_mask((4,) + SHAPE[1:], 0.2, 5, 3, 7, rows) for rows in (range(4), range(4, 8))]
    micro = [keep_mask((2,) + SHAPE[1:], 0.2, 5, 3, 7, [r, r + 1]) for r in range(0, 8, 2)]
    np.testing.assert_array_equal(whole, np.concatenate(shards))
    np.testing.assert_array_equal(whole, np.concatenate(micro))
    reordered = keep_mask((3,) + SHAPE[1:], 0.2, 5, 3, 7, [6, 1, 6])  # any rows, in any order
    np.testing.assert_array_equal(reordered, whole[[6, 1, 6]])


@pytest.mark.parametrize("changed", ["seed", "step", "layer", "sample"])
def test_masks_differ_across_seeds_steps_layers_and_samples(changed):
    base = dict(seed=5, step=3, layer=7)
    other = dict(base, **({changed: base[changed] + 1} if changed in base else {}))
    rows = np.arange(8) + (8 if changed == "sample" else 0)
    a = keep_mask(SHAPE, 0.5, base["seed"], base["step"], base["layer"], np.arange(8))
    b = keep_mask(SHAPE, 0.5, other["seed"], other["step"], other["layer"], rows)
    agreement = (a == b).mean()
    assert 0.45 < agreement < 0.55, f"changing the {changed} should give an unrelated mask"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_rate_is_one_minus_p(p):
    keep = keep_mask((64, 128, 128), p, 0, 1, 0, np.arange(64))
    n = keep.size
    assert abs(keep.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)  # within 5 standard errors


def test_no_position_is_kept_more_often_than_the_others():
    keep = keep_mask((4096, 64), 0.5, 1, 1, 1, np.arange(4096))
    assert np.abs(keep.mean(axis=0) - 0.5).max() < 5 * 0.5 / np.sqrt(4096)  # 5 standard errors


def test_dropout_scales_the_kept_elements_and_recomputation_draws_the_same_mask():
    x = Tensor(np.ones((3, 10, 10), np.float32))
    first = F.dropout(x, 0.25, 1, 2, 3, [7, 8, 9]).data
    again = F.dropout(x, 0.25, 1, 2, 3, [7, 8, 9]).data  # an activation recomputed in backward
    np.testing.assert_array_equal(first, again)
    assert set(np.unique(first)) <= {0.0, np.float32(1 / 0.75)}


def gpt_with_dropout():
    config = GPTConfig(vocab_size=11, context=8, layers=2, heads=2, width=8, dropout=0.3)
    return GPT(config, np.random.default_rng(0))


def test_a_gpt_on_two_shards_or_micro_batches_computes_the_whole_batch_rows():
    model, ids = gpt_with_dropout(), np.random.default_rng(1).integers(0, 11, (6, 8))
    model.set_dropout_state(seed=9, step=4, sample_indices=np.arange(6))
    whole = model(ids).data
    parts = []
    for rows in (np.arange(0, 2), np.arange(2, 5), np.arange(5, 6)):
        model.set_dropout_state(seed=9, step=4, sample_indices=rows)
        parts.append(model(ids[rows]).data)
    # Not bit for bit: OpenBLAS's Haswell kernel sums a row's dot products in an order that
    # depends on how many rows the matmul has (measured: 121 of 528 logits 1 ulp apart, at most
    # 1.5e-8). A wrong mask moves a logit by about its size (0.01-0.07), a million times more.
    np.testing.assert_allclose(whole, np.concatenate(parts), rtol=0, atol=1e-6)
    model.set_dropout_state(seed=9, step=5, sample_indices=np.arange(6))
    assert not np.array_equal(whole, model(ids).data)  # the next step draws new masks


def test_dropout_needs_its_state_in_training_and_nothing_in_eval():
    model, ids = gpt_with_dropout(), np.zeros((2, 8), np.int64)
    with pytest.raises(RuntimeError, match="set_dropout_state"):
        model(ids)
    model.eval()
    assert all(not module.training for module in model.modules())
    model(ids)  # no dropout, no state needed
    config = GPTConfig(vocab_size=11, context=8, layers=1, heads=2, width=8, dropout=0.0)
    GPT(config, np.random.default_rng(0))(ids)  # p = 0: nothing needed either


def test_dropout_probability_must_lie_in_0_to_1():
    with pytest.raises(ValueError, match=r"lie in \[0, 1\)"):
        nn.Dropout(1.0)
