"""Mixed-precision step: skipped steps change nothing, unscaling is exact, masters stay float32."""

import copy
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minimp import DynamicLossScaler, StaticLossScaler, Tensor, nn, optim
from minimp import functional as F
from minimp.precision import all_finite, mixed_precision_step


def fp16_model_and_optimizer(kind, seed=0):
    rng = np.random.default_rng(seed)
    model = nn.Sequential(nn.Linear(6, 8, rng=rng), nn.ReLU(), nn.Linear(8, 3, rng=rng))
    optimizer = {
        "sgd": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
        "adam": lambda p: optim.Adam(p, lr=0.01),
        "adamw": lambda p: optim.AdamW(p, lr=0.01),
    }[kind](model.parameters())
    model.to(np.float16)
    return model, optimizer, rng


def backward_once(model, scaler, rng):
    dtype = model.parameters()[0].dtype  # the input in the model's compute dtype
    x = Tensor(rng.standard_normal((5, 6)).astype(dtype))
    loss = F.cross_entropy(model(x), rng.integers(0, 3, 5))
    scaler.scale(loss).backward()


def snapshot(model, optimizer):
    return (
        copy.deepcopy([m.copy() for m in optimizer.master_weights]),
        copy.deepcopy(optimizer.state_dict()),
        [p.data.copy() for p in model.parameters()],
    )


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["sgd", "adam", "adamw"]),
    st.integers(0, 3),
    st.integers(0, 20),
    st.sampled_from([np.inf, -np.inf, np.nan]),
)
def test_a_step_with_any_non_finite_gradient_changes_nothing(kind, parameter, position, bad):
    model, optimizer, rng = fp16_model_and_optimizer(kind)
    scaler = DynamicLossScaler(init_scale=256.0)
    backward_once(model, scaler, rng)
    mixed_precision_step(optimizer, scaler)  # one real step first: non-trivial optimizer state
    before = snapshot(model, optimizer)
    backward_once(model, scaler, rng)
    grad = model.parameters()[parameter].grad
    grad.reshape(-1)[position % grad.size] = bad
    result = mixed_precision_step(optimizer, scaler)
    assert result.skipped and scaler.loss_scale == 128.0
    after = snapshot(model, optimizer)
    for a, b in zip(before[0], after[0]):
        np.testing.assert_array_equal(a, b)
    assert before[1]["step_count"] == after[1]["step_count"]
    for slots_a, slots_b in zip(before[1]["slots"], after[1]["slots"]):
        for name in slots_a:
            np.testing.assert_array_equal(slots_a[name], slots_b[name])
    for a, b in zip(before[2], after[2]):
        np.testing.assert_array_equal(a, b)
    assert all(p.grad is None for p in model.parameters())


def test_masters_are_float32_and_copies_are_their_rounding():
    model, optimizer, rng = fp16_model_and_optimizer("adam")
    scaler = DynamicLossScaler(init_scale=1024.0)
    for _ in range(3):
        backward_once(model, scaler, rng)
        assert not mixed_precision_step(optimizer, scaler).skipped
    for parameter, master in zip(model.parameters(), optimizer.master_weights):
        assert master.dtype == np.float32 and parameter.dtype == np.float16
        np.testing.assert_array_equal(parameter.data, master.astype(np.float16))


def test_scaled_and_unscaled_steps_agree_in_float32():
    """In float32 nothing underflows, so the scale must cancel exactly (it is a power of two)."""
    results = []
    for scale in (1.0, 2.0**12):
        rng = np.random.default_rng(3)
        model = nn.Sequential(nn.Linear(6, 4, rng=rng), nn.ReLU(), nn.Linear(4, 3, rng=rng))
        optimizer = optim.SGD(model.parameters(), lr=0.1)
        scaler = DynamicLossScaler(init_scale=scale)
        backward_once(model, scaler, rng)
        mixed_precision_step(optimizer, scaler)
        results.append([m.copy() for m in optimizer.master_weights])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_gradient_clipping_bounds_the_norm():
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(6, 3, rng=rng))
    optimizer = optim.SGD(model.parameters(), lr=1.0)
    before = [m.copy() for m in optimizer.master_weights]
    scaler = DynamicLossScaler(init_scale=1.0)
    backward_once(model, scaler, rng)
    result = mixed_precision_step(optimizer, scaler, max_grad_norm=1e-3)
    moved = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(before, optimizer.master_weights)))
    assert result.grad_norm > 1e-3 and moved == pytest.approx(1e-3, rel=1e-3)


def test_sgd_and_adam_match_their_formulas():
    w0, g = np.float32(0.5), np.float32(0.25)
    parameter = nn.Parameter(np.array([w0], np.float32))
    sgd = optim.SGD([parameter], lr=0.1, momentum=0.9)
    for _ in range(2):
        parameter.grad = np.array([g], np.float32)
        sgd.accumulate_gradients()
        sgd.step()
    # v1 = g, w1 = w0 - lr g; v2 = 0.9 g + g, w2 = w1 - lr v2
    assert parameter.data[0] == pytest.approx(w0 - 0.1 * g - 0.1 * 1.9 * g, rel=1e-6)
    parameter = nn.Parameter(np.array([w0], np.float32))
    adam = optim.Adam([parameter], lr=0.01)
    parameter.grad = np.array([g], np.float32)
    adam.accumulate_gradients()
    adam.step()
    # the first Adam step moves every weight by lr * sign(g) (bias correction makes m/sqrt(v) = 1)
    assert parameter.data[0] == pytest.approx(w0 - 0.01, rel=1e-5)


def train_tiny_gradients(dtype, scaler, steps=120):
    """Lesson 4's setup: a loss averaged over 2^16 terms, so every gradient is 2^-16 smaller."""
    from minimp.data import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    model = nn.Sequential(
        nn.Linear(64, 128, rng=rng),
        nn.ReLU(),
        nn.Linear(128, 128, rng=rng),
        nn.ReLU(),
        nn.Linear(128, 10, rng=rng),
    )
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    model.to(dtype)
    images, labels, losses = digits.train_images.astype(dtype), digits.train_labels, []
    for step in range(steps):
        rows = np.random.default_rng([0, step]).choice(len(labels), 256, replace=False)
        loss = F.cross_entropy(model(Tensor(images[rows])), labels[rows])
        losses.append(loss.item())
        scaler.scale(loss * 2.0**-16).backward()
        mixed_precision_step(optimizer, scaler)
    return float(np.mean(losses[-10:]))


def test_tiny_gradients_fail_in_fp16_without_scaling_and_match_fp32_with_it():
    from minimp.precision import BFLOAT16, NoLossScaler

    fp32 = train_tiny_gradients(np.float32, NoLossScaler())
    assert fp32 < 0.5
    # flushed to zero: nothing learned
    assert train_tiny_gradients(np.float16, NoLossScaler()) > 2.0
    assert train_tiny_gradients(np.float16, DynamicLossScaler()) == pytest.approx(fp32, rel=0.01)
    assert train_tiny_gradients(BFLOAT16, NoLossScaler()) < 0.5  # bf16's range needs no scaling


def test_forgetting_to_scale_the_loss_warns():
    model, optimizer, rng = fp16_model_and_optimizer("sgd")
    scaler = DynamicLossScaler(init_scale=256.0)
    x = Tensor(rng.standard_normal((5, 6)).astype(np.float16))
    F.cross_entropy(model(x), rng.integers(0, 3, 5)).backward()  # not scaler.scale(loss)
    with pytest.warns(UserWarning, match="scale was not applied"):
        mixed_precision_step(optimizer, scaler)


def test_a_static_scaler_warns_on_each_step_whose_loss_was_not_scaled():
    model, optimizer, rng = fp16_model_and_optimizer("sgd")
    scaler = StaticLossScaler(256.0)
    for scaled in (False, True, False):  # a fresh scaler, then one just updated, was not applied
        x = Tensor(rng.standard_normal((5, 6)).astype(np.float16))
        loss = F.cross_entropy(model(x), rng.integers(0, 3, 5))
        (scaler.scale(loss) if scaled else loss).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mixed_precision_step(optimizer, scaler)
        assert [str(w.message) for w in caught if "scale was not applied" in str(w.message)] == (
            [] if scaled else [str(caught[0].message)]
        )


def test_an_optimizer_built_after_the_cast_is_refused():
    model = nn.Sequential(nn.Linear(6, 3, rng=np.random.default_rng(0))).to("fp16")
    assert model.parameters()[0].dtype == np.float16  # the training command's names work
    with pytest.raises(ValueError, match="build the optimizer before model.to"):
        optim.SGD(model.parameters(), lr=0.1)


def test_step_refuses_gradients_that_were_not_accumulated():
    parameter = nn.Parameter(np.zeros(2, np.float32))
    sgd = optim.SGD([parameter], lr=0.1)
    parameter.grad = np.ones(2, np.float32)
    with pytest.raises(RuntimeError, match="accumulate_gradients"):
        sgd.step()


def test_mixed_precision_step_is_importable_from_the_top():
    import minimp

    assert minimp.mixed_precision_step is mixed_precision_step


@pytest.mark.parametrize("size", [1, 7, 8, 31, 64, 65, 1000, 4099])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_finds_one_bad_value_anywhere(size, bad, dtype):
    """The sum-of-squares shortcut sees a single inf or NaN at every position that BLAS's
    vector loops and their tails treat differently."""
    for position in sorted({0, 1, size // 2, size - 2, size - 1} & set(range(size))):
        array = np.ones(size, dtype)
        array[position] = bad
        assert not all_finite([np.ones(3, dtype), None, array]), (position, bad)
    assert all_finite([np.ones(size, dtype), None])


def test_all_finite_is_exact_when_the_squares_overflow():
    """Finite values whose squares overflow float32 are still finite: the exact check decides."""
    huge = np.full(10, 1e30, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the overflow is expected and must not warn
        assert all_finite([huge, np.ones(3, np.float32)])
        assert not all_finite([huge, np.array([np.nan], np.float32)])
    assert all_finite([np.full(4, 60000.0, np.float16)])  # 16-bit: element by element
    assert not all_finite([np.array([1.0, np.inf], np.float16)])
