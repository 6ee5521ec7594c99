"""Shared fixtures: a seeded generator, and the venv's interpreter path for subprocess tests."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

# Subprocesses (python -m minimp.train, mpirun) must use this interpreter and its mpirun.
PYTHON = sys.executable
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")


def run_train(ranks, flags, timeout=180):
    """`python -m minimp.train FLAGS`, under `mpirun -n RANKS` when ranks > 1; its output kept."""
    launcher = [MPIRUN, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run(
        [*launcher, PYTHON, "-m", "minimp.train", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def masters(path):
    """The float32 master weights a checkpoint holds, by name."""
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files if name.startswith("master/")}


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _gpu_available():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or CuPy without a driver or device
        return False


HAS_GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a CUDA device")
