"""`mpirun -n 2 python -m minimp.train --experts 4 --dp 2 --ep 2` for real, and `mpirun -n 4 ...
--dp 2 --pp 2 --ep 2`: the issue's small fp32 MoE GPT routes every step's tokens as one process
(asserted first), ends at its weights after 3 steps, and rank 0's expert_parallel bytes equal
dispatch_bytes of its rows every step."""

import json

import numpy as np
import pytest
from conftest import MPIRUN, masters, run_train

from minimp.parallel.expert import dispatch_bytes

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.slow,  # about 20 s (three launches): the simulated world covers --ep by default
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
GPT = dict(layers=2, hidden=32, heads=4, context=16, batch_size=8, steps=3, experts=4, top_k=2)
FLAGS = ["--dataset", "shakespeare", "--eval-every", "0", "--log-every", "1000"]
FLAGS += ["--precision", "fp32", "--dropout", "0", "--optimizer", "sgd", "--lr", "0.5"]
FLAGS += [f"--{name.replace('_', '-')}={value}" for name, value in GPT.items()]


def run(tmp_path, ranks, *flags):
    """(the saved masters, the metrics rows of the steps) of a run."""
    path, metrics = tmp_path / f"{ranks}.npz", tmp_path / f"{ranks}.jsonl"
    result = run_train(ranks, [*FLAGS, *flags, "--save", str(path), "--metrics", str(metrics)],
                       180)
    assert result.returncode == 0, result.stderr
    return masters(path), [json.loads(line) for line in open(metrics)][:-1]  # less the summary


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process's run, shared by the layouts."""
    return run(tmp_path_factory.mktemp("one"), 1)


@pytest.mark.parametrize("ranks, flags", [
    (2, ["--dp", "2", "--ep", "2"]),
    (4, ["--dp", "2", "--pp", "2", "--ep", "2"]),  # the auxiliary losses' gradient on each stage
], ids=["dp 2 ep 2", "dp 2 pp 2 ep 2"])
def test_ep_routes_and_ends_as_one_process(tmp_path, one_process, ranks, flags):
    """SGD, as tests/test_train_moe.py says why. Rank 0's metrics rows: its stage's blocks
    dispatch (all of them without --pp), the routing counted over every stage."""
    one, one_rows = one_process
    got, rows = run(tmp_path, ranks, *flags)
    for first, second in zip(one_rows, rows, strict=True):  # routing first
        assert first["expert_load"] == second["expert_load"]
        assert first["dropped_tokens"] == second["dropped_tokens"]
    assert got.keys() == one.keys()
    for name, array in one.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    for row in rows:
        assert row["expert_dispatches"] == GPT["layers"] // (ranks // 2)
        assert row["bytes_by_group"]["expert_parallel"] == dispatch_bytes(
            row["expert_dispatches"], row["expert_rows_sent"], row["expert_rows_received"],
            GPT["experts"], 2, GPT["hidden"] * 4)
