"""halfcast_numba.cast's wiring: which compiled loops it asks for, and what it does with them."""

import numpy as np
import pytest

from minimp.precision import halfcast_numba


def astype_loops():
    """Stand-ins for the two compiled loops, on the same bit arrays, computed by NumPy's astype."""

    def to_float16(bits, out):
        out[...] = bits.view(np.float32).astype(np.float16).view(np.uint16)

    def to_float32(bits, out):
        out[...] = bits.view(np.float16).astype(np.float32).view(np.uint32)

    return to_float16, to_float32


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("parallel", [False, True])
def test_cast_asks_for_the_loops_compiled_with_its_parallel_flag(monkeypatch, parallel, dtype):
    # numba itself need not be installed: the compiler is replaced by one that records what it
    # was asked for; parallel=True must reach numba, or the threads are never used
    asked = []

    def fake_compiled(flag):
        asked.append(flag)
        return astype_loops()

    monkeypatch.setattr(halfcast_numba, "_compiled", fake_compiled)
    source = np.array([-2.5, 0.0, 1.0e-6, 65504.0, np.inf], dtype=np.float32)
    if dtype == np.float32:
        source = source.astype(np.float16)
    result = halfcast_numba.cast(source, dtype, parallel=parallel)
    assert asked == [parallel]
    assert result.dtype == dtype
    np.testing.assert_array_equal(result, source.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_cast_asks_for_the_serial_loops_unless_told_otherwise(monkeypatch, dtype):
    # halfcast calls cast(flat, dtype): every cast of the library runs the serial loops (whose
    # machine code numba caches on disk); threads only when asked for (cast_bench.py --parallel)
    asked = []

    def fake_compiled(flag):
        asked.append(flag)
        return astype_loops()

    monkeypatch.setattr(halfcast_numba, "_compiled", fake_compiled)
    source = np.array([0.5, -3.0, 2.0**-20], dtype=np.float32)
    if dtype == np.float32:
        source = source.astype(np.float16)
    result = halfcast_numba.cast(source, dtype)
    assert asked == [False]
    np.testing.assert_array_equal(result, source.astype(dtype))
