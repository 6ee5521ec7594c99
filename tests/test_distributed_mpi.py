"""minimp.distributed under real MPI: mpirun subprocesses, each with a timeout."""

import json
import os
import subprocess
import time

import pytest
from conftest import MPIRUN, PYTHON

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
PROGRAMS = os.path.join(os.path.dirname(__file__), "mpi_programs")


def mpirun(ranks, program, *args, timeout=120):
    command = [MPIRUN, "-n", str(ranks), PYTHON, os.path.join(PROGRAMS, program), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_algorithm_agrees_with_mpi_allreduce(ranks):
    result = mpirun(ranks, "check_allreduce.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("agree with MPI.Allreduce") == ranks


def test_a_rank_that_raises_aborts_the_job_within_seconds():
    start = time.monotonic()
    result = mpirun(3, "one_rank_raises.py", timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stdout + result.stderr
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert "injected failure on rank 1" in result.stderr, result.stderr


def test_mismatched_lengths_are_reported_on_every_rank():
    result = mpirun(3, "mismatched_lengths.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ranks disagree on the array") == 3


def test_the_examples_run(tmp_path):
    examples = os.path.join(os.path.dirname(__file__), "..", "mpirun_examples")
    ring = subprocess.run(
        [MPIRUN, "-n", "3", PYTHON, os.path.join(examples, "ring_allreduce.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ring.returncode == 0 and ring.stdout.count("-> [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]") == 3
    bench = subprocess.run(
        [
            MPIRUN,
            "-n",
            "2",
            PYTHON,
            os.path.join(examples, "allreduce_bench.py"),
            "--max-mib",
            "1",
            "--repeats",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bench.returncode == 0, bench.stderr[-2000:]
    report = json.loads(bench.stdout)
    assert report["ranks"] == 2
    assert set(report["held_out"]) == {"ring", "recursive_doubling", "naive"}
    # every measured size is a power of two; the model was fitted at 3 x 2^k bytes only
    assert all(row["bytes"] not in report["terms"]["sizes"] for row in report["rows"])
    assert all(row["predicted"]["ring"] > 0 for row in report["rows"])
    # auto planned once (PersistentAllreduce) is timed beside the checked call
    assert all(row["planned"] > 0 and row["auto"] > 0 for row in report["rows"])
    fresh = subprocess.run(
        [MPIRUN, "-n", "2", PYTHON, os.path.join(examples, "allreduce_bench.py"), "--max-mib", "1",
         "--no-calibration", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    uncalibrated = json.loads(fresh.stdout)
    assert uncalibrated["terms"] is None and "shipped" in uncalibrated["model"]["name"]
    coherence = subprocess.run(
        [MPIRUN, "-n", "2", PYTHON, os.path.join(examples, "coherence.py"), "--kib", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert coherence.returncode == 0, coherence.stderr[-2000:]
    seconds = json.loads(coherence.stdout)["seconds"]
    assert set(seconds) == {"unchanged", "add", "add then send", "ring step"}
    assert all(value > 0 for value in seconds.values())
    refused = subprocess.run(
        [MPIRUN, "-n", "1", PYTHON, os.path.join(examples, "coherence.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "run it on 2 ranks" in refused.stderr


def test_cuda_awareness_query_answers_and_can_be_overridden(monkeypatch):
    from minimp.distributed.mpi import mpi_is_cuda_aware, world

    world()  # MPI (and so libmpi) is loaded
    assert mpi_is_cuda_aware() in (True, False)
    monkeypatch.setenv("MINIMP_CUDA_AWARE_MPI", "1")
    assert mpi_is_cuda_aware() is True
    monkeypatch.setenv("MINIMP_CUDA_AWARE_MPI", "0")
    assert mpi_is_cuda_aware() is False


def test_the_watchdog_ends_a_job_whose_rank_froze():
    start = time.monotonic()
    result = mpirun(2, "frozen_rank.py", "2", timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 20, f"the job took {elapsed:.1f} s to end"
    assert "[rank 0] minimp: waited 2 s to receive from rank 1" in result.stderr, result.stderr
    assert "--timeout 2 s" in result.stderr


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_isend_and_irecv_exchange_past_the_eager_limit_in_any_order(ranks):
    result = mpirun(ranks, "nonblocking.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("nonblocking exchange ok") == ranks
    if ranks > 1:  # a message shorter than its buffer is named, as with blocking receives
        assert "rank 1: received 12 bytes from rank 0 into a 20-byte buffer" in result.stdout
