"""minimp.distributed under real MPI: mpirun subprocesses, each with a timeout."""

import json
import os
import subprocess
import time

import pytest
from conftest import MPIRUN, PYTHON, slow_cases

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
PROGRAMS = os.path.join(os.path.dirname(__file__), "mpi_programs")


def mpirun(ranks, program, *args, timeout=120):
    command = [MPIRUN, "-n", str(ranks), PYTHON, os.path.join(PROGRAMS, program), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("ranks", [3, *slow_cases(1, 2, 4)])  # 3: no power of two
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


@pytest.mark.parametrize("ranks", [2, 3])  # 3: the last rank folds into rank 0
def test_ranks_that_disagree_fail_in_the_same_line_on_every_rank_in_the_headed_call(ranks):
    result = mpirun(ranks, "mismatched_headers.py", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    for case, ranges in (
        ("length 8", "lengths 8..11, dtype codes 3..3, ops sum..sum"),
        ("length 100000", "lengths 100000..100003, dtype codes 3..3, ops sum..sum"),  # truncated
        ("length 8192", "lengths 8192..8195, dtype codes 3..3, ops sum..sum"),  # two ways
        ("dtype 8", "lengths 8..8, dtype codes 1..3, ops sum..sum"),
        ("dtype 8193", "lengths 8193..8193, dtype codes 1..3, ops sum..sum"),  # two ways
        ("op 8", "lengths 8..8, dtype codes 3..3, ops sum..max"),
    ):
        line = (f"{case}: recursive_doubling_allreduce: ranks disagree on the array ({ranges}); "
                "every rank must pass the same length, dtype and op")
        assert result.stdout.count(line) == ranks, result.stdout
    assert result.stdout.count("the same bits") == ranks


def run_example(ranks, name, *args):
    """mpirun -n ranks python mpirun_examples/name args..., its output captured."""
    examples = os.path.join(os.path.dirname(__file__), "..", "mpirun_examples")
    command = [MPIRUN, "-n", str(ranks), PYTHON, os.path.join(examples, name), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_breakdown_times_each_piece_and_refuses_other_than_two_ranks_in_one_line():
    result = run_example(2, "allreduce_breakdown.py", "--rounds", "1", "--calls", "3", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert (report["kib"], report["ranks"]) == (4, 2)
    assert set(report["microseconds"]) == {
        "MPI Allreduce", "checked call", "agree, then send", "planned", "python checks",
        "buffers kept", "headed message", "addition", "agreement", "scratch", "message"}
    assert all(value > 0 for value in report["microseconds"].values())
    alone = run_example(1, "allreduce_breakdown.py")
    assert alone.returncode == 2 and alone.stderr == (
        "allreduce_breakdown: run it on 2 ranks (mpirun -n 2) with --kib, --rounds and --calls "
        "at least 1\n")


@pytest.mark.slow
def test_the_examples_run(tmp_path):
    ring = run_example(3, "ring_allreduce.py")
    assert ring.returncode == 0 and ring.stdout.count("-> [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]") == 3
    bench = run_example(
        2, "allreduce_bench.py", "--max-mib", "1", "--repeats", "3", "--rounds", "2", "--json"
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
    # two rounds, each timing the terms and then every size; reported: their means
    rounds = report["rounds"]
    assert len(rounds["terms"]) == len(rounds["rows"]) == 2
    first, second = (r[0]["ring"] for r in rounds["rows"])
    assert report["rows"][0]["ring"] == pytest.approx((first + second) / 2, rel=1e-12)
    first, second = (t["agree"] for t in rounds["terms"])
    assert report["terms"]["agree"] == pytest.approx((first + second) / 2, rel=1e-12)
    assert report["rows"][0]["repeats"] == 2 * 25  # 50 calls at 4 KiB, 25 in each round
    fresh = run_example(2, "allreduce_bench.py", "--max-mib", "1", "--no-calibration", "--json")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    uncalibrated = json.loads(fresh.stdout)
    assert uncalibrated["terms"] is None and "shipped" in uncalibrated["model"]["name"]
    assert uncalibrated["rounds"]["terms"] == [] and len(uncalibrated["rounds"]["rows"]) == 10
    no_rounds = run_example(1, "allreduce_bench.py", "--rounds", "0")
    assert no_rounds.returncode == 2 and "--rounds must be at least 1 (got 0)" in no_rounds.stderr
    coherence = run_example(2, "coherence.py", "--kib", "4", "--json")
    assert coherence.returncode == 0, coherence.stderr[-2000:]
    seconds = json.loads(coherence.stdout)["seconds"]
    assert set(seconds) == {"unchanged", "add", "add then send", "ring step"}
    assert all(value > 0 for value in seconds.values())
    refused = run_example(1, "coherence.py")
    assert refused.returncode != 0 and "run it on 2 ranks" in refused.stderr
    new_arrays = run_example(2, "new_memory.py", "--kib", "4", "64", "--trials", "1", "--json")
    assert new_arrays.returncode == 0, new_arrays.stderr[-2000:]
    ratios = json.loads(new_arrays.stdout)["calls_over_steady"]
    assert set(ratios) == {"ring 4 KiB", "mpi 4 KiB", "ring 64 KiB", "mpi 64 KiB"}
    # twelve calls each, over the median of the last four (one trial: its own), which straddle 1
    for calls in ratios.values():
        assert len(calls) == 12 and all(r > 0 for r in calls)
        assert min(calls[8:]) <= 1.0 <= max(calls[8:])
    refused = run_example(2, "new_memory.py", "--trials", "0")
    assert refused.returncode == 2 and "--trials >= 1" in refused.stderr


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


@pytest.mark.parametrize("ranks", [3, *slow_cases(1, 2)])
def test_isend_and_irecv_exchange_past_the_eager_limit_in_any_order(ranks):
    result = mpirun(ranks, "nonblocking.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("nonblocking exchange ok") == ranks
    if ranks > 1:  # a message shorter than its buffer is named, as with blocking receives
        assert "rank 1: received 12 bytes from rank 0 into a 20-byte buffer" in result.stdout


@pytest.mark.parametrize("script, flags, said", [
    ("tensor_parallel.py", ["--grids", "1x2x1+sp"], "dp x tp x pp must make the 4 ranks"),
    ("data_parallel_scaling.py", ["--steps", "5"], "at least 7 are needed for a median"),
    ("pipeline_timeline.py", ["--steps", "2"], "at least 3 are needed to measure one"),
], ids=["tensor_parallel", "data_parallel_scaling", "pipeline_timeline"])
def test_an_example_refuses_flags_it_cannot_run_in_one_line_before_launching(script, flags, said):
    path = os.path.join(os.path.dirname(__file__), "..", "mpirun_examples", script)
    result = subprocess.run([PYTHON, path, *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
