"""Lesson 10 (attention): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/10_attention.ipynb became false, or a checker passes a wrong answer."""

import functools
import math

import ml_dtypes
import numpy as np
from exercising import Wrong, exercise_tests, solutions

from minimp import DynamicLossScaler, Tensor, mixed_precision_step, nn, no_grad, optim
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.data import load_shakespeare, text_batch
from minimp.models.gpt import GPT, GPTConfig, block_activation_bytes
from minimp.precision import NoLossScaler
from minimp.sample import generate
from minimp.tensor import saved_bytes

f16 = np.float16

LESSON10 = GPTConfig(vocab_size=65, context=32, layers=2, heads=4, width=64)
CAUSAL = np.tri(32, dtype=bool)


def lesson10_loss(model, ids, targets):
    logits = model(Tensor(ids))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@functools.cache
def lesson10_training():
    """Lesson 10's 200 float32 steps: (the trained weights, the losses, the two samples)."""
    data = load_shakespeare()
    model = GPT(LESSON10, np.random.default_rng(0))
    optimizer, losses, samples = optim.AdamW(model.parameters(), lr=3e-3), [], []
    with limit_cpu_threads(1):
        for step in range(1, 201):
            if step == 1:
                samples.append(data.decode(generate(model.eval(), data.encode("ROMEO:"), 160,
                                                    0.8, 0, 0)))
                model.train()
            ids, targets = text_batch(data.train, seed=0, step=step, batch_size=16, context=32)
            loss = lesson10_loss(model, ids, targets)
            loss.backward()
            mixed_precision_step(optimizer, NoLossScaler())
            losses.append(loss.item())
        samples.append(data.decode(generate(model.eval(), data.encode("ROMEO:"), 160, 0.8, 0, 0)))
    return model.state_dict(), losses, samples


def lesson10_model(dtype=np.float32):
    model = GPT(LESSON10, np.random.default_rng(0))
    model.load_state_dict(lesson10_training()[0])
    return model.to(dtype)


def lesson10_batch():
    return text_batch(load_shakespeare().validation, seed=1, step=1, batch_size=64, context=32)


def lesson10_records(model, ids):
    """The notebook's recorded forward: the logits and, per block, its named intermediate
    Tensors (input, ln_1's output, q.k unscaled, the softmax, the MLP's hidden layer)."""
    x, records = model[0](ids), []
    for block in model.layers[1:-1]:
        attn, record = block.attn, {"residual stream": x}
        h = record["ln_1 output"] = block.ln_1(x)
        q, k, v = F.split(attn.c_attn(h), 64, axis=2)
        q, k, v = (t.reshape(-1, 32, 4, 16).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = record["q.k"] = q @ k.transpose(0, 1, 3, 2)
        record["softmax"] = F.scaled_masked_softmax(scores, 1 / 4)
        y = (record["softmax"] @ v).transpose(0, 2, 1, 3).reshape(-1, 32, 64)
        x = x + attn.c_proj(y)
        hidden = record["mlp hidden"] = block.mlp.c_fc(block.ln_2(x))
        x = x + block.mlp.c_proj(block.mlp.gelu(hidden))
        records.append(record)
    return model[-1](x), records


def flat(array):
    return (array[..., CAUSAL] if array.ndim == 4 else array).ravel()


def float16_shares(array):
    """(zero, subnormal) shares of the non-zero values once stored in float16."""
    stored = np.abs(array[array != 0]).astype(f16)
    return np.mean(stored == 0), np.mean((stored > 0) & (stored < 2**-14))


def test_lesson10_the_loss_falls_from_ln_65_to_about_2_5_below_the_unigram_3_31():
    _, losses, _ = lesson10_training()
    assert abs(losses[0] - math.log(65)) < 0.05 and round(math.log(65), 2) == 4.17
    assert 2.4 < np.mean(losses[-20:]) < 2.6
    frequencies = np.bincount(load_shakespeare().train, minlength=65) / 1_003_854
    assert round(-np.sum(frequencies * np.log(frequencies)), 2) == 3.31


def test_lesson10_the_text_before_is_noise_after_it_has_lines_spaces_and_a_few_words():
    before, after = lesson10_training()[2]
    train = load_shakespeare().train
    space = np.mean(train == load_shakespeare().vocabulary.index(" "))
    assert before.count(" ") / len(before) < 0.05
    assert abs(after.count(" ") / len(after) - space) < 0.06 and after.count("\n") >= 3
    words = {"the", "and", "he", "are", "art", "my", "to", "of", "a", "i", "me", "is"}
    assert len(words & set(after.lower().split())) >= 3
    assert not words & set(before.lower().split())


def test_lesson10_the_recorded_forward_is_the_models_and_where_the_activations_lie():
    model, (ids, _) = lesson10_model(), lesson10_batch()
    logits, records = lesson10_records(model, ids)
    with no_grad():
        assert np.array_equal(logits.data, model(Tensor(ids)).data)
    largest = [{name: float(np.abs(flat(t.data)).max()) for name, t in r.items()} for r in records]
    assert round(largest[0]["residual stream"], 2) == 0.34
    assert round(largest[1]["residual stream"], 1) == 5.5
    assert round(largest[1]["q.k"]) == 68 and 9.5 < math.log2(65504 / largest[1]["q.k"]) < 10
    logit = float(np.max(flat(records[1]["q.k"].data)) / 4)
    assert round(logit) == 17 and logit > math.log(65504) and round(math.log(65504), 2) == 11.09
    assert all(float(np.max(flat(r["q.k"].data))) / 4 < math.log(65504) for r in records[:1])
    assert 0.015 < float16_shares(flat(records[1]["softmax"].data))[0] < 0.025
    assert all(np.isfinite(t.data.astype(f16)).all() for r in records for t in r.values())


def lesson10_unfused(scores, scale, keep, shift):
    dtype = scores.dtype.type
    logits = np.where(keep, scores * dtype(scale), dtype(-np.inf))
    if shift:
        logits = logits - logits.max(axis=-1, keepdims=True)
    exps = np.exp(logits)
    return exps / exps.sum(axis=-1, keepdims=True), exps


def lesson10_scores16():
    _, records = lesson10_records(lesson10_model(), lesson10_batch()[0])
    return records[1]["q.k"].data.astype(f16)


def row_ulps(probabilities, exact):
    gaps = np.spacing(np.abs(exact).astype(f16)).astype(np.float64)
    return np.max(np.abs(probabilities.astype(np.float64) - exact) / gaps, axis=-1)


def test_lesson10_the_textbook_float16_softmax_breaks_2_percent_of_rows_two_ways():
    from minimp.lessons.lesson10 import exact_softmax

    scores16 = lesson10_scores16()
    exact = exact_softmax(scores16, 1 / 4)
    row_max = np.max(np.where(CAUSAL, scores16.astype(np.float32) / 4, -np.inf), axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        textbook, exps = lesson10_unfused(scores16, 1 / 4, CAUSAL, shift=False)
        shifted, _ = lesson10_unfused(scores16, 1 / 4, CAUSAL, shift=True)
    nan_rows, zero_rows = np.isnan(textbook).any(axis=-1), (textbook == 0).all(axis=-1)
    assert nan_rows.sum() > 0 and zero_rows.sum() > 0
    assert 0.015 < np.mean(nan_rows | zero_rows) < 0.03  # "about 2%"
    assert np.all(np.isinf(exps).any(axis=-1) == nan_rows)  # NaN: an exp overflowed
    with np.errstate(over="ignore"):
        sums = exps.sum(axis=-1)
    assert not np.isinf(exps[zero_rows]).any() and np.isinf(sums[zero_rows]).all()
    errors = np.where(nan_rows | zero_rows, -1, row_ulps(textbook, exact))
    worst = np.unravel_index(np.argmax(errors), errors.shape)
    assert row_max[worst] < math.log(2.0**-14) and round(math.log(2.0**-14), 2) == -9.70
    assert float(np.exp(np.float32(math.log(2.0**-14) - 0.01)).astype(f16)) < 2**-14
    assert not np.isnan(shifted).any() and 3 < row_ulps(shifted, exact).max() < 20  # "several"
    assert shifted.shape[-1] == 32  # "the sum at most 32"
    fused = F.scaled_masked_softmax(Tensor(scores16), 1 / 4).data
    assert 0.5 <= row_ulps(fused, exact).max() < 0.50025  # "within 0.5002 ulps"


def test_lesson10_a_padded_row_is_nan_unfused_in_fp16_and_bf16_and_zero_fused():
    scores16, padding = lesson10_scores16(), np.arange(32) >= 4
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isneginf(f16(-1e9))
        unfused, _ = lesson10_unfused(scores16, 1 / 4, CAUSAL & padding, shift=True)
        for dtype in (f16, ml_dtypes.bfloat16):
            assert np.isnan(np.float32(dtype(-np.inf) - dtype(-np.inf)))
    assert np.isnan(unfused).any(axis=-1).sum() == 1024 == 64 * 4 * 4
    scores = Tensor(scores16, requires_grad=True)
    fused = F.scaled_masked_softmax(scores, 1 / 4, mask=padding)
    assert not np.isnan(fused.data).any() and np.all(fused.data[..., :4, :] == 0)
    fused.backward(np.ones_like(scores16))
    assert np.all(scores.grad[..., :4, :] == 0)


def test_lesson10_a_power_of_two_scale_rounds_nothing_above_the_subnormals_1_over_sqrt_48_does():
    scores16 = lesson10_scores16()
    quarter = (scores16 * f16(0.25)).astype(np.float64)
    exact = scores16.astype(np.float64) / 4
    normal = np.abs(exact) >= 2**-14
    assert np.array_equal(quarter[normal], exact[normal])
    with np.errstate(under="ignore"):
        scale = 1 / math.sqrt(48)
        twice = (scores16 * f16(scale)).astype(np.float64)
        once = (scores16.astype(np.float64) * scale).astype(f16).astype(np.float64)
    assert not np.array_equal(twice, once)


def lesson10_layer_norm_float16(x):
    width = f16(x.shape[-1])
    mean = np.cumsum(x, axis=-1, dtype=f16)[..., -1:] / width
    centered = x - mean
    variance = np.cumsum(centered * centered, axis=-1, dtype=f16)[..., -1:] / width
    return centered / np.sqrt(variance + f16(1e-5)), variance


def test_lesson10_float16_layer_norm_statistics_six_times_the_error_then_overflow_at_16x():
    with np.errstate(over="ignore"):
        assert np.isfinite(f16(255.875) * f16(255.875)) and np.isinf(f16(256) * f16(256))
    assert 65504 / 64 == 1023.5 and round(math.sqrt(1023.5)) == 32
    _, records = lesson10_records(lesson10_model(), lesson10_batch()[0])
    residual = records[1]["residual stream"].data
    plain = nn.LayerNorm(64).to(f16)
    results = {}
    for k in (0, 2, 4, 5):
        x16 = (residual * 2.0**k).astype(f16)
        x64 = x16.astype(np.float64)
        centered = x64 - x64.mean(axis=-1, keepdims=True)
        exact = centered / np.sqrt((centered**2).mean(axis=-1, keepdims=True) + 1e-5)
        with np.errstate(over="ignore", invalid="ignore"):
            naive, variance = lesson10_layer_norm_float16(x16)
        with no_grad():
            ours = plain(Tensor(x16)).data
        overflowed = np.isinf(variance[..., 0])
        assert np.all(naive[overflowed] == 0)  # x / inf: the whole row zero
        results[k] = (np.mean(overflowed), np.abs(naive - exact).max(), np.abs(ours - exact).max())
    assert results[0][0] == results[2][0] == 0 and 5.5 < results[0][1] / results[0][2] < 6.5
    assert all(2**-10 - 1e-6 < ours <= 2**-10 * 1.001 for _, _, ours in results.values())
    assert float(np.spacing(f16(2))) == 2**-9 and round(2**-10, 4) == 0.0010
    assert 0.04 < results[4][0] < 0.08 and results[5][0] > 0.95


def lesson10_gradients():
    model, (ids, targets) = lesson10_model(), lesson10_batch()
    logits, records = lesson10_records(model, ids)
    gradients = [{} for _ in records]
    for record, store in zip(records, gradients):
        for name, tensor in record.items():
            tensor.register_hook(lambda grad, store=store, name=name: store.update({name: grad}))
    F.cross_entropy(logits.reshape(-1, 65), targets.reshape(-1)).backward()
    return gradients


def test_lesson10_the_activation_gradients_against_float16_and_bf16():
    gradients = lesson10_gradients()
    every = np.concatenate([flat(g) for store in gradients for g in store.values()])
    zero, subnormal = float16_shares(every)
    assert 0.04 < zero < 0.06 and 0.8 < subnormal < 0.9  # "most", "about 5%"
    assert 0.35 < float16_shares(flat(gradients[1]["q.k"]))[0] < 0.45  # "about 40%"
    assert every.size == 2 * (64 * 32 * (64 + 64 + 256) + 64 * 4 * 528 * 2)  # what was hooked
    zero, subnormal = float16_shares(every * 2.0**16)
    assert DynamicLossScaler().loss_scale == 2**16
    assert 0.005 < zero + subnormal < 0.02 and round(np.abs(every).max() * 2**16) == 313
    nonzero = every[every != 0]

    def median_error(values, dtype):
        stored = values.astype(dtype).astype(np.float64)
        return np.median(np.abs(stored - values) / np.abs(values))

    assert np.all(nonzero.astype(ml_dtypes.bfloat16) != 0)
    assert median_error(nonzero, ml_dtypes.bfloat16) < median_error(nonzero, f16)
    scaled = median_error(nonzero * 2.0**16, f16)
    assert 6 < median_error(nonzero, ml_dtypes.bfloat16) / scaled < 10  # "about eight times"


def test_lesson10_bf16_scores_lose_precision_not_range_and_the_three_losses():
    _, records = lesson10_records(lesson10_model(), lesson10_batch()[0])
    scores32 = records[1]["q.k"].data
    truth = F.scaled_masked_softmax(Tensor(scores32), 1 / 4).data
    errors, broken = {}, {}
    with np.errstate(over="ignore", invalid="ignore"):
        for dtype in (f16, ml_dtypes.bfloat16):
            rounded = scores32.astype(dtype)
            fused = F.scaled_masked_softmax(Tensor(rounded), 1 / 4).data.astype(np.float32)
            errors[dtype] = np.abs(fused - truth).max()
            unfused, _ = lesson10_unfused(rounded, 1 / 4, CAUSAL, shift=False)
            broken[dtype] = np.mean(np.isnan(unfused).any(axis=-1) | (unfused == 0).all(axis=-1))
    assert broken[ml_dtypes.bfloat16] == 0 and broken[f16] > 0
    assert 4 < errors[ml_dtypes.bfloat16] / errors[f16] < 7  # "about five times"
    assert round(math.log(float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)), 1) == 88.7
    ids, targets = lesson10_batch()
    with no_grad(), limit_cpu_threads(1):  # the notebook's one BLAS thread
        losses = {d: lesson10_loss(lesson10_model(d).eval(), ids, targets).item()
                  for d in (np.float32, f16, ml_dtypes.bfloat16)}
    moved = {d: abs(losses[d] - losses[np.float32]) for d in (f16, ml_dtypes.bfloat16)}
    assert all(1e-5 < m < 1e-4 for m in moved.values())  # "both ... in the fifth decimal"
    assert moved[f16] < moved[ml_dtypes.bfloat16]  # "bf16 the more"


def test_lesson10_one_block_keeps_what_the_formula_says_korthikanti_plus_16sb():
    s, b, h, a = 32, 16, 64, 4
    measured = {}
    for dropout in (0.0, 0.1):
        for dtype in (np.float32, f16):
            config = GPTConfig(vocab_size=65, context=s, layers=1, heads=a, width=h,
                               dropout=dropout)
            model = GPT(config, np.random.default_rng(0)).to(dtype)
            model.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
            x = Tensor(np.random.default_rng(1).standard_normal((b, s, h)).astype(dtype),
                       requires_grad=True)
            kept = saved_bytes(model[1](x), exclude=[p.data for p in model.parameters()])
            assert kept == block_activation_bytes(s, b, h, a, dtype, dropout > 0)
            measured[dtype, dropout] = kept
    assert measured[f16, 0.1] == 34 * s * b * h + 5 * a * s * s * b + 16 * s * b
    assert 16 * s * b == 8192 and measured[np.float32, 0.1] < 2 * measured[f16, 0.1]
    ratios = [5 * a * s / h for s, h, a in ((32, 64, 4), (256, 384, 6), (1024, 768, 12))]
    assert ratios == [10, 20, 80]


def test_lesson10_a_samples_keep_mask_is_the_same_on_a_shard():
    from minimp.ops.dropout import keep_mask

    whole = keep_mask((8, 32, 64), 0.1, seed=0, step=1, layer=2, sample_indices=range(8))
    shard = keep_mask((4, 32, 64), 0.1, seed=0, step=1, layer=2, sample_indices=range(4, 8))
    assert np.array_equal(whole[4:], shard) and abs(whole.mean() - 0.9) < 0.01


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def softmax_in_float16(scores, scale, mask=None):
    """Every step in the scores' dtype: float16 rounds the scaled logits a second time."""
    keep = np.tri(scores.shape[-1], dtype=bool) & (True if mask is None else mask)
    logits = np.where(keep, scores * scores.dtype.type(scale), scores.dtype.type(-np.inf))
    exps = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return exps / exps.sum(axis=-1, keepdims=True)


def softmax_without_the_shift(scores, scale, mask=None):
    keep = np.tri(scores.shape[-1], dtype=bool) & (True if mask is None else mask)
    exps = np.where(keep, np.exp(scores.astype(np.float32) * np.float32(scale)), 0)
    return (exps / exps.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def softmax_with_nan_rows(scores, scale, mask=None):
    keep = np.tri(scores.shape[-1], dtype=bool) & (True if mask is None else mask)
    logits = np.where(keep, scores.astype(np.float32) * np.float32(scale), -np.inf)
    exps = np.exp(logits - logits.max(axis=-1, keepdims=True))  # a -inf row: -inf - -inf
    return (exps / exps.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def backward_without_the_scale(y, grad_output, scale):
    return solutions(10).softmax_backward(y, grad_output, 1.0)


def backward_in_float16(y, grad_output, scale):
    dot = (grad_output * y).sum(axis=-1, keepdims=True).astype(y.dtype)
    return (y.dtype.type(scale) * y * (grad_output - dot)).astype(y.dtype)


def korthikanti_bytes(s, b, h, a, itemsize, dropout):
    return (34 * s * b * h + 5 * a * s * s * b) * itemsize // 2


def block_bytes_with_masks_of_itemsize(s, b, h, a, itemsize, dropout):
    kept = solutions(10).block_bytes(s, b, h, a, itemsize, dropout)
    return kept + (itemsize - 1) * (2 * s * b * h + a * s * s * b) if dropout else kept


def block_bytes_with_statistics_of_itemsize(s, b, h, a, itemsize, dropout):
    kept = solutions(10).block_bytes(s, b, h, a, itemsize, dropout)
    return kept - 4 * max(itemsize, 4) * s * b + 4 * itemsize * s * b


def keep_mask_from_a_generator(shape, p, seed, step, layer, sample_indices):
    """One generator for the whole batch: a shard draws other numbers for the same sample."""
    return np.random.default_rng([seed, step, layer]).random(shape) >= p


def keep_mask_with_a_summed_key(shape, p, seed, step, layer, sample_indices):
    """One generator per sample, seeded by a sum: (seed 1, step 2) collides with (2, 1)."""
    rows = [np.random.default_rng(seed + step + layer + int(n)).random(shape[1:]) >= p
            for n in sample_indices]
    return np.array(rows).reshape(shape)


WRONG = {
    "check_scaled_masked_softmax": [
        Wrong(softmax_in_float16, ""),
        Wrong(softmax_without_the_shift, ""),
        Wrong(softmax_with_nan_rows, ""),
    ],
    "check_softmax_backward": [
        Wrong(backward_without_the_scale, ""),
        Wrong(backward_in_float16, ""),
    ],
    "check_block_bytes": [
        Wrong(korthikanti_bytes, ""),
        Wrong(block_bytes_with_masks_of_itemsize, ""),
        Wrong(block_bytes_with_statistics_of_itemsize, ""),
    ],
    "check_keep_mask": [
        Wrong(keep_mask_from_a_generator, ""),
        Wrong(keep_mask_with_a_summed_key, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(10, WRONG)
