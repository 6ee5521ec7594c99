"""The array-module choice: NumPy by default, clear errors when a GPU is asked for and not there."""

import importlib.util
import subprocess

import numpy as np
import pytest
from conftest import PYTHON

from minimp import backend

HAS_CUPY = importlib.util.find_spec("cupy") is not None


def test_numpy_is_the_default():
    assert backend.array_module(np.zeros(2)) is np
    assert isinstance(backend.to_numpy(np.zeros(2)), np.ndarray)


def test_unknown_device_is_a_clear_error():
    with pytest.raises(backend.DeviceError, match="unknown device 'tpu'"):
        backend.use_device("tpu")


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here, so asking for the GPU does not fail")
def test_gpu_without_cupy_names_the_extra_to_install():
    result = subprocess.run(
        [PYTHON, "-m", "minimp.train", "--device", "gpu", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "pip install 'minimp[gpu]'" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUPY, reason="needs CuPy and a CUDA device")
def test_gpu_arrays_follow_their_inputs():
    import cupy

    assert backend.array_module(cupy.zeros(2)) is cupy
