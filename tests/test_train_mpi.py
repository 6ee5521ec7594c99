"""`mpirun -n N python -m minimp.train` for real: data parallelism against one process, one overflow
decision for all, faults that end the job, and bad input that cannot hang."""

import json
import subprocess
import time

import numpy as np
import pytest
from conftest import MPIRUN, PYTHON

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')")]
SMALL = ["--hidden", "32", "--layers", "2", "--batch-size", "32", "--log-every", "1000"]


def train_command(ranks, *flags, timeout=180):
    launcher = [MPIRUN, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run([*launcher, PYTHON, "-m", "minimp.train", *SMALL, *flags], capture_output=True,
                          text=True, timeout=timeout)


def masters(path):
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files if name.startswith("master/")}


def last_loss(path):
    records = [json.loads(line) for line in open(path)]
    return [r for r in records if "loss" in r][-1]["loss"], records


@pytest.fixture(scope="module")
def one_process_fp32(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    result = train_command(1, "--precision", "fp32", "--steps", "20", "--save", str(folder / "one.npz"))
    assert result.returncode == 0, result.stderr
    return masters(folder / "one.npz")


@pytest.mark.parametrize("ranks", [2, 4])
def test_fp32_data_parallel_ends_with_the_one_process_weights(tmp_path, one_process_fp32, ranks):
    result = train_command(ranks, "--precision", "fp32", "--steps", "20", "--save", str(tmp_path / "dp.npz"))
    assert result.returncode == 0, result.stderr
    for name, array in masters(tmp_path / "dp.npz").items():
        np.testing.assert_allclose(array, one_process_fp32[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_fp16_data_parallel_final_loss_within_one_percent(tmp_path):
    assert train_command(1, "--steps", "60", "--metrics", str(tmp_path / "one.jsonl")).returncode == 0
    result = train_command(4, "--steps", "60", "--grad-comm-dtype", "fp16",
                           "--metrics", str(tmp_path / "dp.jsonl"))
    assert result.returncode == 0, result.stderr
    one, _ = last_loss(tmp_path / "one.jsonl")
    four, _ = last_loss(tmp_path / "dp.jsonl")
    assert abs(four - one) <= 0.01 * one


def test_one_rank_overflow_makes_every_rank_skip_and_replicas_stay_identical(tmp_path):
    result = train_command(4, "--steps", "8", "--inject-overflow", "5:2", "--check-replicas", "1",
                           "--metrics", str(tmp_path / "m.jsonl"))
    assert result.returncode == 0, result.stderr
    _, records = last_loss(tmp_path / "m.jsonl")
    assert [r["skipped"] for r in records[:8]] == [False] * 4 + [True] + [False] * 3
    assert records[5]["loss_scale"] == records[4]["loss_scale"] / 2
    assert all(r["bytes_sent"] > 0 for r in records[:8] if not r["skipped"])


def test_an_injected_fault_ends_the_job_fast_with_that_rank_s_message():
    start = time.monotonic()
    result = train_command(4, "--steps", "50", "--inject-fault", "3:1", timeout=60)
    assert result.returncode != 0
    assert time.monotonic() - start < 30
    assert "injected fault at step 3 on rank 1" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--dp", "3"], "--dp 3 does not match the 4 ranks of this job"),
    (["--batch-size", "66"], "--batch-size 66 is not divisible by the 4 data-parallel replicas"),
    (["--steps", "0"], "--steps must be a positive integer"),
])
def test_bad_input_is_one_error_from_rank_0_and_no_hang(flags, message):
    result = train_command(4, *flags, timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("minimp.train: error:") == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_checkpoint_resumes_with_another_number_of_replicas(tmp_path):
    common = ["--precision", "fp32"]
    assert train_command(2, *common, "--steps", "20", "--save", str(tmp_path / "straight.npz")).returncode == 0
    assert train_command(2, *common, "--steps", "10", "--save", str(tmp_path / "half.npz")).returncode == 0
    resumed = train_command(1, *common, "--steps", "20", "--resume", str(tmp_path / "half.npz"),
                            "--save", str(tmp_path / "resumed.npz"))
    assert resumed.returncode == 0, resumed.stderr
    straight = masters(tmp_path / "straight.npz")
    for name, array in masters(tmp_path / "resumed.npz").items():
        np.testing.assert_allclose(array, straight[name], rtol=1e-5, atol=1e-7, err_msg=name)
