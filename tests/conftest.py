"""Shared fixtures: a seeded generator, and the path of the venv's interpreter for subprocess tests."""

import os
import shutil
import sys

import numpy as np
import pytest

# Subprocesses (python -m minimp.train, mpirun) must use this interpreter and its mpirun.
PYTHON = sys.executable
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
