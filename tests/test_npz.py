"""minimp.npz: an archive read whole, a bare .npy refused, and no two threads parsing at once."""

import ast
import threading
import time

import numpy as np
import pytest

from minimp import npz


def test_every_array_comes_back_whole_by_name(tmp_path):
    path = tmp_path / "a.npz"
    np.savez(path, x=np.arange(5, dtype=np.float16), y=np.array("meta"))
    arrays = npz.read_arrays(str(path))
    assert sorted(arrays) == ["x", "y"] and arrays["x"].dtype == np.float16
    assert np.array_equal(arrays["x"], np.arange(5)) and str(arrays["y"]) == "meta"
    with open(path, "rb") as handle:  # a binary file too, as the packaged digits are read
        assert np.array_equal(npz.read_arrays(handle)["x"], np.arange(5))


def test_a_bare_npy_is_refused_by_name(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.zeros(3))
    with pytest.raises(ValueError, match="a single array, not an .npz archive"):
        npz.read_arrays(str(path))


def test_an_object_array_is_not_unpickled(tmp_path):
    path = tmp_path / "a.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        npz.read_arrays(str(path))


def test_threads_reading_at_once_never_parse_headers_at_the_same_time(tmp_path, monkeypatch):
    """The race is CPython's (two threads in ast at once), too rare to provoke on demand, so the
    test watches the header parser: with the lock, it never has two callers at a time."""
    path = tmp_path / "a.npz"
    np.savez(path, **{f"x{i}": np.zeros(2) for i in range(4)})
    inside, most = [0], [0]
    guard = threading.Lock()
    parse = ast.literal_eval

    def slow_parse(text):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.002)  # long enough for another thread to arrive, were it let in
        try:
            return parse(text)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(ast, "literal_eval", slow_parse)
    threads = [threading.Thread(target=npz.read_arrays, args=(str(path),)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert most[0] == 1
