"""minimp's float16 casts give NumPy's astype bit for bit: both implementations, every class."""

import threading
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import float32_bits

from minimp.precision import casting, halfcast, halfcast_numba


def numpy_path(array, dtype):
    if np.dtype(dtype) == np.float16:
        return halfcast.float32_to_float16_numpy(array)
    return halfcast.float16_to_float32_numpy(array)


def numba_path(array, dtype):
    return halfcast_numba.cast(array, dtype)


needs_numba = pytest.mark.skipif(not halfcast_numba.available(), reason="numba is not installed")
PATHS = [
    pytest.param(numpy_path, id="numpy"),
    pytest.param(numba_path, id="numba", marks=needs_numba),
]


def numpy_astype(array, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "overflow encountered in cast"
        return array.astype(dtype)


def assert_same_bits(inputs, cast, dtype):
    """cast(inputs) has the bits of NumPy's astype, or the message lists the first differences."""
    ours, theirs = cast(inputs, dtype), numpy_astype(inputs, dtype)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    unsigned = np.uint16 if np.dtype(dtype) == np.float16 else np.uint32
    differ = np.nonzero(ours.view(unsigned) != theirs.view(unsigned))[0]
    bits = inputs.view(np.uint32 if unsigned is np.uint16 else np.uint16)
    examples = [
        f"{bits[i]:#x} ({inputs[i]!r}) -> ours {ours.view(unsigned)[i]:#x}, "
        f"NumPy's {theirs.view(unsigned)[i]:#x}"
        for i in differ[:5]
    ]
    assert differ.size == 0, f"{differ.size} of {inputs.size} differ, e.g. " + "; ".join(examples)


def all_float16():
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def with_both_signs(bits):
    bits = np.asarray(bits, np.uint32)
    return np.concatenate([bits, bits | 0x80000000]).view(np.float32)


def ties_and_their_neighbours():
    """Every point halfway between adjacent float16 numbers (65520, halfway to the 2^16 float16
    lacks, included) and the float32 numbers just below and above each: rounding's hardest cases."""
    lower = all_float16()[:0x7C00].astype(np.float64)  # 0 up to 65504
    upper = np.append(lower[1:], 65536.0)
    midpoint = ((lower + upper) / 2).astype(np.float32)  # exact: 12 significant bits at most
    below = np.nextafter(midpoint, np.float32(0))
    above = np.nextafter(midpoint, np.float32(np.inf))
    return with_both_signs(np.concatenate([midpoint, below, above]).view(np.uint32))


def one_of_every_shift():
    """For every float32 exponent (zero and subnormals, every normal binade, inf and NaN) a few
    fractions: each exponent takes its own shift through the rounding."""
    exponents = np.arange(256, dtype=np.uint32) << 23
    fractions = np.array([0, 1, 0x1000, 0x1FFF, 0x2000, 0x3000, 0x400000, 0x7FFFFF], np.uint32)
    return with_both_signs((exponents[:, None] | fractions[None, :]).reshape(-1))


# Named cases a reader can check by hand: (float32 bits, why it is here).
EDGES = [
    (0x00000000, "0.0 (and -0.0 below)"),
    (0x00000001, "smallest float32 subnormal: rounds to 0"),
    (0x33000000, "2^-25, half the smallest float16 subnormal: a tie, rounds to even 0"),
    (0x33000001, "just above 2^-25: rounds up to 2^-24"),
    (0x33C00000, "1.5 * 2^-24: a tie between subnormals 1 and 2, rounds to even 2"),
    (0x38800000, "2^-14, smallest float16 normal"),
    (0x387FE000, "2^-14 - 2^-25: a tie between the largest subnormal and 2^-14, rounds up"),
    (0x3F801000, "1 + 2^-11: a tie, rounds to even 1.0"),
    (0x3F803000, "1 + 3 * 2^-11: a tie, rounds to even 1 + 2^-9"),
    (0x477FE000, "65504, the largest float16"),
    (0x477FEFFF, "just below 65520: rounds down to 65504"),
    (0x477FF000, "65520: a tie, rounds to even, which is the overflow to infinity"),
    (0x477FF001, "just above 65520: infinity"),
    (0x7F7FFFFF, "largest float32: infinity"),
    (0x7F800000, "infinity"),
    (0x7F800001, "signalling NaN with payload 1: NumPy keeps it a NaN as 0x7c01"),
    (0x7F802000, "signalling NaN whose payload survives the 13-bit shift"),
    (0x7FA00000, "signalling NaN, top payload bit: 0x7d00"),
    (0x7FC00000, "the default quiet NaN"),
    (0x7FC00001, "quiet NaN, payload in the dropped bits"),
    (0x7FFFFFFF, "quiet NaN, all payload bits set"),
]


@pytest.mark.parametrize("cast", PATHS)
def test_every_float16_widens_exactly(cast):
    assert_same_bits(all_float16(), cast, np.float32)


@pytest.mark.parametrize("cast", PATHS)
def test_every_float16_comes_back_from_float32_unchanged(cast):
    assert_same_bits(all_float16().astype(np.float32), cast, np.float16)


@pytest.mark.parametrize("cast", PATHS)
def test_named_edge_cases_round_like_numpy(cast):
    assert_same_bits(with_both_signs([bits for bits, _ in EDGES]), cast, np.float16)


@pytest.mark.parametrize("cast", PATHS)
def test_ties_and_their_neighbours_round_like_numpy(cast):
    assert_same_bits(ties_and_their_neighbours(), cast, np.float16)


@pytest.mark.parametrize("cast", PATHS)
def test_every_exponent_rounds_like_numpy(cast):
    assert_same_bits(one_of_every_shift(), cast, np.float16)


@pytest.mark.parametrize("cast", PATHS)
@given(st.lists(float32_bits(), min_size=1, max_size=64))
def test_any_float32_rounds_like_numpy(cast, bits):
    assert_same_bits(np.array(bits, np.uint32).view(np.float32), cast, np.float16)


@pytest.mark.parametrize("cast", PATHS)
@given(st.lists(st.floats(-(2.0**-14), 2.0**-14, width=32), min_size=1, max_size=64))
def test_float32_values_with_subnormal_results_round_like_numpy(cast, values):
    assert_same_bits(np.array(values, np.float32), cast, np.float16)


@pytest.mark.parametrize("implementation", ["numpy", pytest.param("numba", marks=needs_numba)])
@pytest.mark.parametrize("layout", ["C", "F", "strided"])
def test_widen_and_round_to_take_the_fast_path_in_any_layout(implementation, layout):
    rng = np.random.default_rng(0)
    scales = 2.0 ** rng.integers(-30, 12, (96, 64))  # float16 normals and subnormals
    x32 = (rng.standard_normal((96, 64)) * scales).astype(np.float32)
    x32 = {"C": x32, "F": np.asfortranarray(x32), "strided": x32[::2, ::3]}[layout]
    with halfcast.casts(implementation):
        x16 = casting.round_to(x32, np.float16)
        theirs = numpy_astype(x32, np.float16)
        np.testing.assert_array_equal(x16.view(np.uint16), theirs.view(np.uint16))
        assert x16.flags.f_contiguous == theirs.flags.f_contiguous
        widened = casting.widen(x16)
        assert widened.dtype == np.float32 and widened.shape == x16.shape
        np.testing.assert_array_equal(widened, x16.astype(np.float32))
        np.testing.assert_array_equal(casting.round_to(x16, np.float32), widened)
        assert casting.round_to(x16, np.float16) is x16 and casting.widen(widened) is widened


def test_widen_and_round_to_call_the_selected_implementation(monkeypatch):
    calls = []

    def spy(function, name):
        def wrapper(*args):
            calls.append(name)
            return function(*args)

        return wrapper

    monkeypatch.setattr(halfcast, "_numpy_in_chunks", spy(halfcast._numpy_in_chunks, "numpy"))
    monkeypatch.setattr(halfcast_numba, "cast", spy(halfcast_numba.cast, "numba"))
    x32 = np.ones((64, 64), np.float32)
    x16 = x32.astype(np.float16)
    for implementation in ("astype", "numpy") + (("numba",) if halfcast_numba.available() else ()):
        calls.clear()
        with halfcast.casts(implementation):
            casting.widen(x16), casting.round_to(x16, np.float32), casting.round_to(x32, np.float16)
        assert calls == ([] if implementation == "astype" else [implementation] * 3)
    calls.clear()
    with halfcast.casts(implementation):  # the last one: NumPy's or numba's bit tricks
        casting.round_to(x32.astype(np.float64), np.float16)  # one rounding from float64: astype's
        casting.widen(x16[:8])  # smaller than SMALL_ARRAY: a call would cost more than the work
    assert calls == []


@pytest.fixture
def unread_environment():
    """default_casts() reads the environment once per process: forget it before and after."""
    halfcast.default_casts.cache_clear()
    yield
    halfcast.default_casts.cache_clear()


def test_the_choice_comes_from_a_casts_block_or_the_environment(monkeypatch, unread_environment):
    monkeypatch.setenv(halfcast.ENVIRONMENT_VARIABLE, "numpy")
    assert halfcast.selected_casts() == "numpy"
    with halfcast.casts("astype"):
        assert halfcast.selected_casts() == "astype"
        with halfcast.casts("numpy"):  # blocks nest; leaving one restores the choice before it
            assert halfcast.selected_casts() == "numpy"
        assert halfcast.selected_casts() == "astype"
    assert halfcast.selected_casts() == "numpy"
    with pytest.raises(ValueError, match="use one of numba, numpy, astype"):
        with halfcast.casts("fast"):
            pass


def test_a_casts_block_does_not_reach_threads_started_inside_it():
    """A context variable: a thread (a simulated world's rank) starts outside every block."""
    seen, default = [], halfcast.default_casts()
    with halfcast.casts("numpy" if default == "astype" else "astype"):
        thread = threading.Thread(target=lambda: seen.append(halfcast.selected_casts()))
        thread.start()
        thread.join()
    assert seen == [default]


def test_without_numba_the_default_is_numpys_astype(monkeypatch, unread_environment):
    monkeypatch.delenv(halfcast.ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(halfcast_numba, "available", lambda: False)
    assert halfcast.selected_casts() == "astype"
    with pytest.raises(ValueError) as caught:
        with halfcast.casts("numba"):
            pass
    assert str(caught.value) == "float16 cast 'numba' needs numba: pip install 'minimp[fast]'"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_numpy_casts_run_a_chunk_at_a_time(dtype, monkeypatch):
    sizes = []
    name = "float32_to_float16_numpy" if dtype == np.float16 else "float16_to_float32_numpy"
    convert = getattr(halfcast, name)

    def counted(chunk):
        sizes.append(chunk.size)
        return convert(chunk)

    monkeypatch.setattr(halfcast, name, counted)
    monkeypatch.setattr(halfcast, "NUMPY_CHUNK", 1000)
    source = np.random.default_rng(0).standard_normal(2500).astype(
        np.float32 if dtype == np.float16 else np.float16
    )
    result = halfcast._numpy_in_chunks(source, dtype)
    assert sizes == [1000, 1000, 500]  # 2500 elements, chunks of 1000
    np.testing.assert_array_equal(result.view(np.uint8), numpy_astype(source, dtype).view(np.uint8))


def test_with_numba_the_default_is_numba(monkeypatch, unread_environment):
    monkeypatch.delenv(halfcast.ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(halfcast_numba, "available", lambda: True)  # only asked, not run here
    assert halfcast.selected_casts() == "numba"


@pytest.mark.parametrize(
    "size, converted", [(halfcast.SMALL_ARRAY - 1, []), (halfcast.SMALL_ARRAY, [1])]
)
def test_arrays_from_small_array_elements_on_take_the_named_cast(size, converted, monkeypatch):
    # below SMALL_ARRAY a call costs more than the work: astype; from it on, the bit tricks
    calls, convert = [], halfcast.float32_to_float16_numpy

    def counted(chunk):
        calls.append(1)
        return convert(chunk)

    monkeypatch.setattr(halfcast, "float32_to_float16_numpy", counted)
    source = np.linspace(-3, 3, size, dtype=np.float32)
    result = halfcast.to_float16(source, "numpy")
    assert calls == converted
    np.testing.assert_array_equal(result.view(np.uint16), source.astype(np.float16).view(np.uint16))


def test_the_numba_cast_is_asked_for_the_dtype_wanted(monkeypatch):
    # numba itself need not be installed: its cast is replaced by one that records its arguments
    asked = []

    def fake_cast(flat, dtype):
        asked.append((flat.shape, np.dtype(dtype)))
        return flat.astype(dtype)

    monkeypatch.setattr(halfcast_numba, "cast", fake_cast)
    source = np.linspace(-3, 3, 2 * halfcast.SMALL_ARRAY, dtype=np.float32).reshape(2, -1)
    result = halfcast.to_float16(source, "numba")
    assert asked == [((source.size,), np.dtype(np.float16))]
    np.testing.assert_array_equal(result, source.astype(np.float16))
