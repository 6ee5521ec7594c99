"""`mpirun -n N python -m minimp.train --tp ...` for real: every grid with and without sequence
parallelism trains the GPT (dropout on) to the one-process weights, rank 0's bytes in the
tensor-parallel group are the formula's, bad grids are one line, the example of
docs/tensor-parallel.md measures what its formulas say."""

import json
import os
import subprocess

import numpy as np
import pytest
from conftest import MPIRUN, PYTHON, masters, run_train, slow_cases

from minimp.measure.tensor_parallel_accounts import gpt_tensor_parallel_bytes

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
GPT = dict(layers=2, hidden=32, heads=4, context=16, batch_size=8, steps=5)
FLAGS = ["--dataset", "shakespeare", "--eval-every", "0", "--log-every", "1000"]
FLAGS += ["--precision", "fp32", "--dropout", "0.1"]
FLAGS += [f"--{name.replace('_', '-')}={value}" for name, value in GPT.items()]


def train_command(ranks, *flags, timeout=180):
    return run_train(ranks, [*FLAGS, *flags], timeout)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "one.npz"
    result = train_command(1, "--save", str(path))
    assert result.returncode == 0, result.stderr
    return masters(path)


LAYOUTS = [
    (2, ["--tp", "2"]),
    (4, ["--tp", "4"]),
    (4, ["--tp", "2", "--dp", "2"]),
    (4, ["--tp", "2", "--pp", "2", "--micro-batches", "2"]),
]


GRIDS = [(ranks, layout, sp) for ranks, layout in LAYOUTS for sp in (False, True)]


@pytest.mark.parametrize(
    "ranks, layout, sequence_parallel",
    [GRIDS[0], *slow_cases(*GRIDS[1:])],  # the default tier: --tp 2 without sequence parallelism
    ids=[f"{' '.join(layout)}-{'tp+sp' if sp else 'tp'}" for _, layout, sp in GRIDS],
)
def test_every_grid_ends_with_the_one_process_weights(
    tmp_path, one_process, ranks, layout, sequence_parallel
):
    path, metrics = tmp_path / "tp.npz", tmp_path / "tp.jsonl"
    extra = ["--sequence-parallel"] if sequence_parallel else []
    result = train_command(ranks, *layout, *extra, "--save", str(path), "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr
    got = masters(path)
    assert got.keys() == one_process.keys()
    for name, array in one_process.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    options = dict(zip(layout[0::2], layout[1::2]))
    tp, dp, pp = (int(options.get(f"--{g}", 1)) for g in ("tp", "dp", "pp"))
    micro_batches = int(options.get("--micro-batches", 1))
    expected = gpt_tensor_parallel_bytes(  # rank 0: stage 0, the first GPT["layers"] / pp blocks
        blocks=GPT["layers"] // pp, rows=GPT["batch_size"] // dp // micro_batches,
        context=GPT["context"], width=GPT["hidden"], tp=tp, micro_batches=micro_batches,
        compute_bytes=4, sequence_parallel=sequence_parallel, last_stage=pp == 1,
    )  # fmt: skip
    records = [json.loads(line) for line in open(metrics)]
    steps = [record for record in records if "loss" in record]
    assert [r["bytes_by_group"]["tensor_parallel"] for r in steps] == [expected] * GPT["steps"]
    assert "layout: --dp" in result.stdout and f"rank {ranks - 1}: " in result.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "3"], "--tp 3 splits the attention heads across ranks, and --heads 4 does not"),
        *slow_cases((["--tp", "2", "--dp", "1"],
                     "--dp 1 does not match the 4 ranks of this job (use --dp 2")),
    ],  # fmt: skip
    ids=["heads", "grid"],
)
def test_a_grid_that_does_not_fit_is_one_error_from_rank_0_and_no_hang(flags, message):
    result = train_command(4, *flags, timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("minimp.train: error:") == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # 21 s: the example launches its own mpirun jobs
def test_the_example_measures_what_the_formulas_say():
    """One grid of docs/tensor-parallel.md's table (pipeline, tensor and sequence parallel, tied
    embedding), and its block memory table: every measured figure is the formula's."""
    example = os.path.join(os.path.dirname(__file__), "..", "mpirun_examples", "tensor_parallel.py")
    result = subprocess.run(
        [PYTHON, example, "--grids", "1x2x2+sp", "--steps", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    (row,) = report["rows"]
    assert row["measured"] == row["formula"] and row["formula"]["tensor_parallel"] > 0
    assert [m["tp"] for m in report["memory"]] == [1, 2, 2, 4, 4]
    for memory in report["memory"]:
        assert memory["measured"] == [memory["formula"]] * memory["tp"]
