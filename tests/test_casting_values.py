"""The dtype predicates and names pinned as tables, and widen's result for each 16-bit format."""

import numpy as np
import pytest

from minimp.precision import BFLOAT16, casting, halfcast

TABLE = [  # dtype, is_low_precision, is_floating
    (np.float16, True, True),
    (BFLOAT16, True, True),  # not a NumPy floating subtype: only the first test knows it
    ("float16", True, True),
    (np.float32, False, True),
    (np.float64, False, True),
    (np.int32, False, False),
    (np.bool_, False, False),
]


@pytest.mark.parametrize("dtype, low, floating", TABLE)
def test_which_dtypes_are_16_bit_and_which_floating(dtype, low, floating):
    assert casting.is_low_precision(dtype) is low
    assert casting.is_floating(dtype) is floating


@pytest.mark.parametrize(
    "name, dtype",
    [("fp16", np.float16), (" FP16 ", np.float16), ("bf16", BFLOAT16), ("fp32", np.float32),
     (np.float32, np.float32), ("float64", np.float64), (np.dtype(np.int8), np.int8)],
)
def test_dtype_named_reads_the_training_commands_names_and_numpys(name, dtype):
    assert casting.dtype_named(name) == np.dtype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_widen_gives_float32_with_the_exact_values_whichever_cast_is_selected(dtype):
    # 2048 elements: past SMALL_ARRAY, so the selected NumPy bit tricks run (for float16 only:
    # they read float16 bits, and bfloat16's are laid out differently)
    source = np.linspace(-5, 5, 2048, dtype=np.float32).astype(dtype)
    with halfcast.casts("numpy"):
        widened = casting.widen(source)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, source.astype(np.float32))


@pytest.mark.parametrize("dtype", [BFLOAT16, np.float64])
def test_round_to_from_float32_gives_the_asked_dtype_by_numpys_cast(dtype):
    # only float32 -> float16 takes halfcast's bit tricks; every other pair is astype
    source = np.array([1.0 + 2.0**-20, -3.0e38, 65519.0, 2.0**-30], np.float32)
    rounded = casting.round_to(source, dtype)
    assert rounded.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(rounded.view(np.uint8), source.astype(dtype).view(np.uint8))


@pytest.mark.parametrize(
    "source_dtype, dtype", [(np.float16, np.float64), (np.float64, np.float32)]
)
def test_round_to_between_other_pairs_is_numpys_cast(source_dtype, dtype):
    # 2048 elements with the NumPy bit tricks selected: only float16 <-> float32 may take them
    source = np.linspace(-5, 5, 2048).astype(source_dtype)
    with halfcast.casts("numpy"):
        rounded = casting.round_to(source, dtype)
    assert rounded.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(rounded, source.astype(dtype))
