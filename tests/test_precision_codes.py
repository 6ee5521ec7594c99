"""precision/codes.py: the compiled cast into every small float format is ml_dtypes' cast bit for
bit (each format's values, the midpoints between neighbours, where ties go to the even code, the
float32 numbers either side of each midpoint, random values down into float32's subnormals, both
signs, NaN and infinities), and the decoding reads each code's value."""

import numpy as np
import pytest

from minimp.precision import blocks, codes


def finite_values(fmt: blocks.ElementFormat) -> np.ndarray:
    """The format's non-negative finite values, ascending, as ml_dtypes decodes its codes."""
    decoded = np.arange(256, dtype=np.uint8).view(fmt.dtype).astype(np.float32)
    return np.unique(np.abs(decoded[np.isfinite(decoded)]))


@pytest.mark.parametrize("fmt", blocks.ELEMENT_FORMATS.values(), ids=repr)
def test_encode_is_ml_dtypes_cast_to_the_bit(fmt, rng):
    grid = finite_values(fmt)
    midpoints = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)  # exact
    tiny = rng.uniform(0, 1, 20_000) * 2.0 ** rng.integers(-150, 0, 20_000)
    points = np.concatenate([grid, midpoints, np.nextafter(midpoints, 0),
                             np.nextafter(midpoints, np.inf), rng.uniform(0, fmt.max, 20_000),
                             tiny]).astype(np.float32)
    points = np.clip(points, 0, fmt.max)  # encode's contract: callers saturate first
    points = np.concatenate([points, -points, [np.nan, -np.nan, np.inf, -np.inf]])
    points = points.astype(np.float32).reshape(2, -1)  # a 2-D array keeps its shape
    ours = codes.encode(points, fmt)
    assert ours.dtype == fmt.dtype and ours.shape == points.shape
    assert np.array_equal(ours.view(np.uint8), points.astype(fmt.dtype).view(np.uint8))


@pytest.mark.parametrize("fmt", blocks.ELEMENT_FORMATS.values(), ids=repr)
def test_decode_reads_each_codes_value(fmt):
    values = np.arange(256, dtype=np.uint8).view(fmt.dtype)
    if np.dtype(fmt.dtype).itemsize == 1 and fmt.name in ("E2M1", "E2M3", "E3M2"):
        values = values[: 2 ** (codes._sign_shift(fmt) + 1)]  # the codes the narrow formats use
    theirs = values.astype(np.float32)
    assert np.array_equal(codes.decode(values).view(np.uint32), theirs.view(np.uint32))
    strided = values[::-2]  # a strided view decodes too
    assert np.array_equal(codes.decode(strided).view(np.uint32), theirs[::-2].view(np.uint32))


@pytest.mark.parametrize("fmt", blocks.ELEMENT_FORMATS.values(), ids=repr)
def test_a_0_d_array_keeps_its_shape_both_ways(fmt):
    value = np.array(1.25, np.float32)  # astype keeps a 0-d array 0-d; so must the codes
    assert codes.encode(value, fmt).shape == value.astype(fmt.dtype).shape == ()
    assert codes.decode(value.astype(fmt.dtype)).shape == ()
