"""Ulysses attention under `mpirun` for real: equal to one process, the bytes equal to the
formula."""

import os
import subprocess

import pytest
from conftest import MPIRUN, PYTHON

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
PROGRAM = os.path.join(os.path.dirname(__file__), "mpi_programs", "context_ulysses.py")


def test_ulysses_attention_under_mpirun_equals_one_process_past_the_eager_limit():
    result = subprocess.run([MPIRUN, "-n", "2", PYTHON, PROGRAM], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ulysses attention ok") == 2, result.stdout
