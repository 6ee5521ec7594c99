"""Which cast widen and round_to take for each array, and cross-entropy's edge cases.

casting: only a NumPy float16 <-> float32 cast goes through halfcast (minimp's own casts); every
other pair, and any device array, takes the array's own astype. Values alone cannot show the
route (both round the same), so a spy on halfcast records it.

loss: the max shift of _log_softmax32 is per row and subtracted (finite for logits far beyond
exp's float32 range), the shape and range checks, an empty batch, integer logits and where the
targets live on a device.
"""

import sys
import warnings

import ml_dtypes
import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in

from minimp import Tensor
from minimp import functional as F
from minimp.function import Context
from minimp.ops.softmax import CrossEntropy
from minimp.precision import casting, halfcast

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def halfcast_calls(monkeypatch):
    """Record (function, input dtype, input type) for each call into halfcast's two casts."""
    calls = []
    for name in ("to_float16", "to_float32"):
        original = getattr(halfcast, name)

        def spy(array, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, array.dtype, type(array)))
            return _original(array, *args, **kwargs)

        monkeypatch.setattr(halfcast, name, spy)
    return calls


def test_widen_takes_halfcast_for_a_numpy_float16_array_only(halfcast_calls, monkeypatch):
    """float16 on the host: halfcast; bfloat16: astype (halfcast reads float16 bits); float32:
    the same array back; a device float16 array: its own astype, staying on the device."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    half = np.linspace(-3, 3, 12, dtype=np.float32).astype(np.float16)
    widened = casting.widen(half)
    assert widened.dtype == np.float32 and type(widened) is np.ndarray
    np.testing.assert_array_equal(widened, half.astype(np.float32))
    assert halfcast_calls == [("to_float32", np.dtype(np.float16), np.ndarray)]

    halfcast_calls.clear()
    brain = half.astype(BF16)
    widened = casting.widen(brain)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, brain.astype(np.float32))
    single = half.astype(np.float32)
    assert casting.widen(single) is single
    device = half.view(DeviceLike)
    widened = casting.widen(device)
    assert type(widened) is DeviceLike and widened.dtype == np.float32
    np.testing.assert_array_equal(widened, half.astype(np.float32))
    assert halfcast_calls == []


@pytest.mark.parametrize(
    "source, dtype, expected_call",
    [
        (np.float32, np.float16, "to_float16"),
        (np.float16, np.float32, "to_float32"),
        (np.float64, np.float16, None),  # through float32 it would round twice
        (np.float32, BF16, None),
        (np.float64, np.float32, None),
        (np.float16, np.float64, None),
        (BF16, np.float32, None),
    ],
    ids=["f32-f16", "f16-f32", "f64-f16", "f32-bf16", "f64-f32", "f16-f64", "bf16-f32"],
)
def test_round_to_takes_halfcast_only_between_numpy_float32_and_float16(
    source, dtype, expected_call, halfcast_calls
):
    array = np.array([1.0 + 2.0**-12, -2.5, 65519.0, 2.0**-20], np.float64).astype(source)
    rounded = casting.round_to(array, dtype)
    assert rounded.dtype == np.dtype(dtype) and type(rounded) is np.ndarray
    np.testing.assert_array_equal(rounded.view(np.uint8), array.astype(dtype).view(np.uint8))
    expected = [] if expected_call is None else [(expected_call, np.dtype(source), np.ndarray)]
    assert halfcast_calls == expected


def test_round_to_leaves_a_device_array_to_its_own_astype(halfcast_calls, monkeypatch):
    """A DeviceLike (CuPy) float32 -> float16 or float16 -> float32: no halfcast, still a device
    array; and an array already in the dtype comes back as itself."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    single = np.array([1.0 + 2.0**-12, -2.5, 3.0], np.float32).view(DeviceLike)
    half = casting.round_to(single, np.float16)
    assert type(half) is DeviceLike and half.dtype == np.float16
    back = casting.round_to(half, np.float32)
    assert type(back) is DeviceLike and back.dtype == np.float32
    np.testing.assert_array_equal(back, single.astype(np.float16).astype(np.float32))
    assert halfcast_calls == []
    assert casting.round_to(single, np.float32) is single


def test_log_softmax_shifts_each_row_by_its_own_max_so_huge_logits_stay_finite():
    """Shifting by +max would exp(200) (inf in float32); shifting every row by the global max
    would leave exp(-1000) == 0 in the small row and log(0) = -inf."""
    x = np.array([[100.0, 0.0], [1000.0, 1000.0], [0.0, 0.0]], np.float32)
    y = F.log_softmax(Tensor(x), axis=1).data
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0], [0.0, -100.0], atol=1e-6)
    np.testing.assert_allclose(y[1:], np.full((2, 2), -np.log(2.0)), rtol=1e-6)
    loss = F.cross_entropy(Tensor(x), np.array([0, 1, 0])).data
    assert loss.dtype == np.float32
    np.testing.assert_allclose(loss, 2.0 * np.log(2.0) / 3.0, rtol=1e-6)


@pytest.mark.parametrize(
    "shape, targets",
    [((2, 3), np.array([0, 1, 2])), ((2, 3, 4), np.array([0, 1])), ((2,), np.array([0, 1]))],
    ids=["targets-too-long", "3d-logits", "1d-logits"],
)
def test_cross_entropy_refuses_wrong_shapes_naming_both(shape, targets):
    """Either a logits rank other than 2 or a targets shape other than (B,) is refused."""
    with pytest.raises(ValueError, match=r"needs logits \(B, C\) and targets \(B,\), got"):
        F.cross_entropy(Tensor(np.zeros(shape, np.float32)), targets)


def test_cross_entropy_of_an_empty_batch_is_nan_not_a_range_error():
    """The range check is skipped for no targets (min() of nothing would raise): the mean of no
    losses is NaN, like NumPy's."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        loss = F.cross_entropy(Tensor(np.zeros((0, 3), np.float32)), np.zeros(0, np.int64))
    assert loss.dtype == np.float32 and np.isnan(loss.data)


def test_cross_entropy_of_integer_logits_is_still_a_float32_loss():
    """The mean is taken in result_dtype(logits, float32): int8 logits give exp() in float16, and
    the loss must still come out float32."""
    logits = np.array([[1, 2, 3], [0, 0, 4]], np.int8)
    loss = F.cross_entropy(Tensor(logits), np.array([0, 2])).data
    assert loss.dtype == np.float32
    x = logits.astype(np.float64)
    log_p = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(loss, -(log_p[0, 0] + log_p[1, 2]) / 2, rtol=2e-3)


def test_cross_entropy_moves_host_targets_onto_the_logits_device(monkeypatch):
    """Integer labels from the host are made device arrays by the logits' array module (CuPy
    indexes with device arrays only); the loss is a device array too."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    logits = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], np.float32).view(DeviceLike)
    ctx = Context((True, False))
    loss = CrossEntropy.forward(ctx, logits, np.array([1, 2]))
    saved_logits, saved_targets = ctx.saved_arrays
    assert type(saved_targets) is DeviceLike and saved_targets.tolist() == [1, 2]
    assert type(loss) is DeviceLike and loss.dtype == np.float32
    grad, none = CrossEntropy.backward(ctx, np.float32(1.0))
    assert none is None and type(grad) is DeviceLike and grad.dtype == np.float32


class IndexRecordingDevice(DeviceLike):
    """A device array that records the type of every index array it is assigned through."""

    __module__ = "cupy.stand_in"
    index_types: list = []

    def __setitem__(self, index, value):
        parts = index if isinstance(index, tuple) else (index,)
        IndexRecordingDevice.index_types += [type(p) for p in parts if isinstance(p, np.ndarray)]
        super().__setitem__(index, value)


def test_cross_entropy_backward_indexes_the_device_softmax_with_device_arrays(monkeypatch):
    """softmax - onehot subtracts 1 at [arange(B), targets]: both index arrays are made by the
    logits' array module (cupy.arange), so no index array is copied from the host each step."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    monkeypatch.setattr(IndexRecordingDevice, "index_types", [])
    logits = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], np.float32).view(IndexRecordingDevice)
    ctx = Context((True, False))
    CrossEntropy.forward(ctx, logits, np.array([1, 2]))
    IndexRecordingDevice.index_types = []
    grad, _ = CrossEntropy.backward(ctx, np.float32(1.0))
    assert IndexRecordingDevice.index_types, "backward assigned through no index array"
    assert all(issubclass(t, DeviceLike) for t in IndexRecordingDevice.index_types)
    x = logits.view(np.ndarray).astype(np.float64)
    softmax = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    softmax[[0, 1], [1, 2]] -= 1.0
    np.testing.assert_allclose(grad.view(np.ndarray), softmax / 2, rtol=1e-6)
