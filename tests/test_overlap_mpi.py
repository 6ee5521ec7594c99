"""Overlap under `mpirun` for real: the same bits as without it, and the benchmark's report."""

import os
import subprocess

import pytest
from conftest import MPIRUN, PYTHON, masters, slow_cases

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
SMALL = ["--hidden", "64", "--layers", "3", "--batch-size", "32", "--log-every", "1000"]


@pytest.mark.parametrize(
    "precision, zero",
    [("fp16", "0"), *slow_cases(("fp32", "0"), ("fp16", "1"), ("fp16", "2"), ("fp32", "3"))],
)
def test_overlap_under_mpirun_ends_with_the_bits_of_no_overlap(tmp_path, precision, zero):
    weights = {}
    for mode in ("--overlap", "--no-overlap"):
        path = tmp_path / f"{mode}.npz"
        result = subprocess.run(
            [MPIRUN, "-n", "2", PYTHON, "-m", "minimp.train", *SMALL, mode, "--steps", "8",
             "--precision", precision, "--micro-batches", "2", "--bucket-mb", "0.01",
             "--zero", zero, "--save", str(path)],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        weights[mode] = masters(path)
    assert weights["--overlap"] and weights["--overlap"].keys() == weights["--no-overlap"].keys()
    for name, array in weights["--overlap"].items():
        assert array.tobytes() == weights["--no-overlap"][name].tobytes(), name


@pytest.mark.slow
def test_the_overlap_benchmark_reports_both_modes_and_their_ratio():
    example = os.path.join(os.path.dirname(__file__), "..", "mpirun_examples", "overlap_bench.py")
    result = subprocess.run(
        [MPIRUN, "-n", "2", PYTHON, example, "--steps", "3",
         "--rounds", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("p = 2, 7 buckets"), result.stdout
    assert [line.split()[0] for line in lines[1:3]] == ["no_overlap", "overlap"]
    assert "exposed(overlap) / exposed(no overlap) = " in lines[3]
