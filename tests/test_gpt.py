"""The GPT: names, tied head, init, gradients, causality, saved bytes, and that it learns."""

import numpy as np
import pytest

from minimp import Tensor, backend, nn, no_grad, optim
from minimp import functional as F
from minimp.data import load_shakespeare, text_batch
from minimp.models import GPT, GPTConfig, block_activation_bytes
from minimp.precision import ACTIVATION_DTYPES, NoLossScaler, mixed_precision_step
from minimp.tensor import saved_bytes

TINY = GPTConfig(vocab_size=7, context=5, layers=2, heads=2, width=8, dropout=0.2)


def tiny_gpt(config=TINY, seed=0):
    return GPT(config, np.random.default_rng(seed))


def loss_of(model, ids, targets):
    logits = model(ids)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_layers_and_parameter_names_follow_nanogpt():
    model = tiny_gpt()
    assert len(model) == 4  # embeddings, 2 blocks, head: the pipeline's cut points
    names = [name for name, _ in model.named_parameters()]
    assert names[:4] == ["0.wte.weight", "0.wpe.weight", "1.ln_1.weight", "1.ln_1.bias"]
    assert "2.attn.c_attn.weight" in names and "2.mlp.c_proj.bias" in names
    assert names[-2:] == ["3.ln_f.weight", "3.ln_f.bias"]
    v, t, c, layers = 7, 5, 8, 2
    expected = v * c + t * c + layers * (12 * c * c + 13 * c) + 2 * c
    assert sum(p.size for p in model.parameters()) == expected
    assert model[1].attn.c_attn.weight.shape == (3 * c, c)


def test_the_head_is_the_token_embedding_and_gets_the_summed_gradient(rng):
    model = tiny_gpt()
    wte = model[0].wte.weight
    assert model[-1].wte.weight is wte  # the same Parameter object, so the same array
    assert sum(p is wte for p in model.parameters()) == 1  # listed once: updated once
    model.to(np.float64).eval()
    ids, targets = rng.integers(0, 7, (3, 5)), rng.integers(0, 7, (3, 5))
    loss_of(model, ids, targets).backward()
    tied = wte.grad
    # untie: the head reads a copy, so each use's gradient lands in its own .grad
    copy = nn.Embedding(7, 8)
    copy.weight = nn.Parameter(wte.data.copy())
    object.__setattr__(model[-1], "wte", copy)
    wte.grad = None
    loss_of(model, ids, targets).backward()
    np.testing.assert_allclose(tied, wte.grad + copy.weight.grad, rtol=1e-12)
    assert np.abs(copy.weight.grad).sum() > 0 and np.abs(wte.grad).sum() > 0


def test_initialisation_follows_gpt2_and_is_reproducible():
    config = GPTConfig(vocab_size=65, context=64, layers=4, heads=4, width=256)
    model = GPT(config, np.random.default_rng(3))
    params = dict(model.named_parameters())
    for name, parameter in params.items():
        values = parameter.data
        if name.endswith("bias"):
            assert (values == 0).all(), name
        elif ".ln_" in name:
            assert (values == 1).all(), name
        else:
            expected = 0.02 / np.sqrt(2 * 4) if name.endswith("c_proj.weight") else 0.02
            assert abs(values.std() / expected - 1) < 0.05 and abs(values.mean()) < 1e-3, name
    again = GPT(config, np.random.default_rng(3)).state_dict()
    assert all(np.array_equal(params[name].data, again[name]) for name in params)
    other = GPT(config, np.random.default_rng(4)).state_dict()
    assert not np.array_equal(params["1.attn.c_attn.weight"].data, other["1.attn.c_attn.weight"])


def test_whole_model_gradients_match_central_differences_in_float64(rng):
    """Every parameter of a 2-block GPT with dropout on; 4 random entries of each are checked."""
    model = tiny_gpt().to(np.float64)
    model.set_dropout_state(seed=1, step=2, sample_indices=[4, 0, 9])
    ids, targets = rng.integers(0, 7, (3, 5)), rng.integers(0, 7, (3, 5))
    loss_of(model, ids, targets).backward()
    for name, parameter in model.named_parameters():
        flat = parameter.data.reshape(-1)  # a view: writing it perturbs the parameter
        for position in rng.choice(flat.size, size=min(4, flat.size), replace=False):
            original = flat[position]
            values = []
            for shift in (1e-6, -1e-6):
                flat[position] = original + shift
                with no_grad():
                    values.append(loss_of(model, ids, targets).item())
            flat[position] = original
            numerical = (values[0] - values[1]) / 2e-6
            analytic = parameter.grad.reshape(-1)[position]
            assert abs(analytic - numerical) <= 1e-7 + 1e-5 * abs(numerical), name


def test_a_later_token_never_changes_an_earlier_position(rng):
    model = tiny_gpt(GPTConfig(vocab_size=7, context=6, layers=2, heads=2, width=8))
    ids = rng.integers(0, 7, (2, 6))
    before = model(ids).data
    for t in range(6):
        changed = ids.copy()
        changed[:, t] = (changed[:, t] + 1) % 7
        after = model(changed).data
        np.testing.assert_array_equal(before[:, :t], after[:, :t], err_msg=f"token {t} leaked")
        assert not np.allclose(before[:, t:], after[:, t:])


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no dropout", "dropout"])
def test_saved_bytes_of_one_block_equal_the_formula(dtype, dropout, rng):
    s, b, h, a = 16, 3, 32, 4
    config = GPTConfig(vocab_size=7, context=s, layers=1, heads=a, width=h, dropout=dropout)
    model = tiny_gpt(config).to(dtype)
    model.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
    x = Tensor(rng.standard_normal((b, s, h)).astype(dtype), requires_grad=True)
    out = model[1](x)  # one Block
    parameters = [p.data for p in model.parameters()]
    assert saved_bytes(out, exclude=parameters) == block_activation_bytes(
        s, b, h, a, dtype, dropout > 0
    )
    if dtype == np.float16 and dropout:  # Korthikanti et al.'s 34sbh + 5as^2b, plus fp32 stats
        expected = 34 * s * b * h + 5 * a * s * s * b + 16 * s * b
        assert block_activation_bytes(s, b, h, a, dtype, True) == expected


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_16_bit_model_stays_close_to_float32(name, rng):
    dtype = ACTIVATION_DTYPES[name]
    ids = rng.integers(0, 7, (2, 5))
    reference = tiny_gpt().eval()(ids).data
    model = tiny_gpt().to(dtype).eval()
    logits = model(ids)
    assert logits.dtype == dtype
    np.testing.assert_allclose(logits.data.astype(np.float32), reference, atol=3e-2)
    loss_of(model, ids, ids).backward()
    assert all(p.grad.dtype == dtype for p in model.parameters())


def test_config_needs_width_divisible_by_heads_and_ids_within_the_context():
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTConfig(width=10, heads=4)
    with pytest.raises(ValueError, match="the context is 5"):
        tiny_gpt().eval()(np.zeros((1, 6), np.int64))


def test_a_small_gpt_learns_shakespeare_below_the_unigram_entropy():
    """2 layers, width 64, 4 heads, context 32, batch 16, AdamW 3e-3, float32: 150 steps take the
    loss from ln(65) = 4.17 to ~2.5 nats, under the 3.31 of predicting character frequencies."""
    data = load_shakespeare()
    config = GPTConfig(vocab_size=65, context=32, layers=2, heads=4, width=64)
    model = GPT(config, np.random.default_rng(0))
    optimizer = optim.AdamW(model.parameters(), lr=3e-3)
    scaler, losses = NoLossScaler(), []
    # (768, 64) products: one BLAS thread is faster than two fighting over two busy cores
    with backend.limit_cpu_threads(1):
        for step in range(1, 151):
            ids, targets = text_batch(data.train, seed=0, step=step, batch_size=16, context=32)
            loss = loss_of(model, ids, targets)
            scaler.scale(loss).backward()
            mixed_precision_step(optimizer, scaler)  # accumulate, step, zero_grad
            losses.append(loss.item())
    assert abs(losses[0] - np.log(65)) < 0.1
    assert np.mean(losses[-25:]) < 2.8, f"last losses {losses[-25:]}"


def test_without_biases_there_are_no_bias_parameters_and_training_still_works(rng):
    config = GPTConfig(vocab_size=7, context=5, layers=2, heads=2, width=8, bias=False)
    model = GPT(config, np.random.default_rng(0)).to(np.float16)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    ids = rng.integers(0, 7, (2, 5))
    loss_of(model, ids, ids).backward()
    assert all(np.isfinite(p.grad.astype(np.float32)).all() for p in model.parameters())
