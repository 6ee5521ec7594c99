"""minimp.distributed.alltoall under real MPI: one mpirun subprocess with a timeout."""

import os
import subprocess

import pytest
from conftest import MPIRUN, PYTHON

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
PROGRAM = os.path.join(os.path.dirname(__file__), "mpi_programs", "check_alltoall.py")


def test_all_to_all_agrees_with_mpi4py_and_reports_a_disagreement_on_every_rank():
    command = [MPIRUN, "-n", "3", PYTHON, PROGRAM]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("12 all-to-alls agree with mpi4py's alltoall") == 3, result.stdout
    line = ("all_to_all: ranks disagree on the chunks (rank 0: float32 rows of (4,), sizes "
            "exchanged; rank 1: float32 rows of (3,), sizes exchanged; rank 2: float32 rows of "
            "(3,), sizes exchanged); every rank must send rows of one dtype and trailing shape, "
            "and all or none pass output_split_sizes")
    assert result.stdout.count(line) == 3, result.stdout
