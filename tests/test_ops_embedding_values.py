"""Embedding's backward scatter-add (minimp/ops/embedding.py) by value: each row's sum in the rows'
dtype, in the positions' order, and on a device by the device's own add.at, in the device's memory.

The float64 np.add.at sums are the independent reference; the bits of a float32 sum depend on the
order it adds in, which is why the order of equal indices is pinned apart from the values.
"""

import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in

from minimp import Tensor
from minimp import functional as F
from minimp.ops.embedding import _scatter_add_rows

ROWS = 7  # the table's rows; row 6 is never picked: its sum is empty, exactly 0


def picked(rng, positions=300, width=5, dtype=np.float32):
    """Indices into rows 0..5, each picked ~50 times, and one gradient row per position."""
    indices = rng.integers(0, ROWS - 1, size=positions)
    return indices, rng.standard_normal((positions, width)).astype(dtype)


def exact_sums(indices, rows):
    """The reference: every row's sum in float64 (np.add.at adds each position in turn)."""
    out = np.zeros((ROWS, rows.shape[1]))
    np.add.at(out, indices, rows.astype(np.float64))
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_scatter_add_sums_every_row_s_gradients_in_the_rows_dtype(dtype, rng):
    """A float32 sum stays float32 (Embedding's backward then rounds it once) and a float64 one
    float64: the sums of ~50 terms each are within float32's (float64's) rounding of exact."""
    indices, rows = picked(rng, dtype=dtype)
    out = _scatter_add_rows(indices, rows, ROWS)
    assert type(out) is np.ndarray and out.dtype == dtype and out.shape == (ROWS, 5)
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, exact_sums(indices, rows), rtol=rtol, atol=rtol)
    assert not out[ROWS - 1].any()


def test_a_row_s_sum_is_the_same_bits_whatever_the_other_positions_hold(rng):
    """Row v's gradient adds v's rows in the order of their positions (the sort keeps equal
    indices in order): the same bits as scatter-adding those rows alone, and as in a batch whose
    other positions are shuffled. An unstable sort would add them in an order that depends on
    the whole batch (and on the sort's implementation), changing the last bits of the float32 sum.
    """
    indices, rows = picked(rng, positions=2000, width=8)
    out = _scatter_add_rows(indices, rows, ROWS)
    others = np.flatnonzero(indices != 2)
    shuffled = indices.copy()
    shuffled[others] = rng.permutation(indices[others])  # row 2's positions stay where they were
    again = _scatter_add_rows(shuffled, rows, ROWS)
    for v in range(ROWS - 1):
        mine = rows[indices == v]  # (n_v, 8), in position order
        alone = _scatter_add_rows(np.zeros(len(mine), np.int64), mine, 1)[0]
        assert out[v].tobytes() == alone.tobytes(), f"row {v}"
    assert again[2].tobytes() == out[2].tobytes()


class RecordingAdd:
    """A device module's `add` whose .at (the scatter-add CuPy has; it has no reduceat) counts
    its calls and adds as NumPy's does."""

    def __init__(self):
        self.at_calls = 0

    def __call__(self, *args, **kwargs):
        return np.add(*args, **kwargs)

    def at(self, out, indices, rows):
        self.at_calls += 1
        np.add.at(out, indices, rows)


def device_module(monkeypatch):
    """The cupy stand-in (conftest), with its add recorded."""
    cupy = cupy_stand_in()
    cupy.add = RecordingAdd()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_device_rows_are_scatter_added_on_the_device_in_their_dtype(dtype, rng, monkeypatch):
    """Device gradient rows go to the device module's add.at (NumPy's sort and reduceat cannot
    take a CuPy array), once, into a device array of the rows' dtype holding the sums."""
    cupy = device_module(monkeypatch)
    indices, rows = picked(rng, dtype=dtype)
    out = _scatter_add_rows(indices.view(DeviceLike), rows.view(DeviceLike), ROWS)
    assert cupy.add.at_calls == 1
    assert type(out) is DeviceLike and out.dtype == dtype and out.shape == (ROWS, 5)
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    sums = exact_sums(indices, rows)
    np.testing.assert_allclose(out.view(np.ndarray), sums, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_16_bit_gradients_of_a_frequent_token_are_summed_in_float32(dtype, device, monkeypatch):
    """Token 0 at 3072 of 3172 positions with gradient 1, the others multiples of 1/8: every
    float32 sum here is exact, so the one correct answer is the exact sum rounded once to the
    16-bit dtype (3072 for token 0, where a float16 running sum stalls at 2048)."""
    rng = np.random.default_rng(5)
    ids = np.where(np.arange(3172) < 3072, 0, rng.integers(1, ROWS - 1, size=3172))
    ids = rng.permutation(ids).reshape(13, 244)
    g = np.where(ids[..., None] == 0, 1.0, rng.integers(-64, 64, size=(13, 244, 4)) / 8)
    g, weight = g.astype(dtype), np.zeros((ROWS, 4), dtype)
    if device:
        cupy = device_module(monkeypatch)
        g, weight = g.view(DeviceLike), weight.view(DeviceLike)
    table = Tensor(weight, requires_grad=True)
    F.embedding(ids, table).backward(g)
    grad = table.grad
    assert type(grad) is (DeviceLike if device else np.ndarray) and grad.dtype == dtype
    if device:
        assert cupy.add.at_calls == 1
    expected = exact_sums(ids.reshape(-1), np.asarray(g, np.float64).reshape(-1, 4)).astype(dtype)
    assert grad.view(np.ndarray).view(np.uint16).tolist() == expected.view(np.uint16).tolist()
    assert float(grad[0, 0]) == 3072.0
