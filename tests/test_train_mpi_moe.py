"""`mpirun -n D python -m minimp.train --experts 4 --dp D --ep N` for real (the issue's --dp 2
--ep 2, --dp 4 --ep 4, --dp 4 --ep 2, and --dp 2 --pp 2 --ep 2 on 4 ranks): the issue's small fp32
MoE GPT routes every step's tokens as one process (asserted first), drops the same pairs at
capacity 1.0, ends at its weights after 3 steps, and rank 0's expert_parallel bytes equal
dispatch_bytes of its rows every step. In fp8 the replicas stay identical and the rows travel in
bf16. With --zero 1 (--dp 2 --ep 2) it ends at the same weights, its data_parallel bytes those of
zero_bytes_sent."""

import json

import numpy as np
import pytest
from conftest import MPIRUN, masters, run_train
from test_train_moe_zero import units

from minimp.parallel.expert import dispatch_bytes, zero_bytes_sent

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.slow,  # about 55 s (eight launches, 4 ranks on 2 cores); the simulated world
    # covers --ep in the default tier
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
    """One process's run at a capacity factor, each run once, shared by the layouts."""
    runs: dict[str, tuple] = {}

    def get(capacity_factor):
        if capacity_factor not in runs:
            runs[capacity_factor] = run(tmp_path_factory.mktemp("one"), 1,
                                        "--capacity-factor", capacity_factor)
        return runs[capacity_factor]

    return get


# (dp, pp, ep, capacity factor)
LAYOUTS = [(2, 1, 2, "0"), (4, 1, 4, "0"), (4, 1, 2, "0"), (4, 1, 2, "1.0"), (2, 2, 2, "0")]


@pytest.mark.parametrize("dp, pp, ep, capacity_factor", LAYOUTS,
                         ids=[f"dp{d}-pp{p}-ep{e}-capacity{c}" for d, p, e, c in LAYOUTS])
def test_the_layout_routes_and_ends_as_one_process(tmp_path, one_process, dp, pp, ep,
                                                   capacity_factor):
    """SGD, as tests/test_train_moe.py says why. --dp 4 --ep 2: two copies of each expert
    group, whose expert gradients sum over the copies and divide by 4; capacity 1.0: the same
    pairs dropped as one process drops; --pp 2: the auxiliary losses' gradient on each stage,
    rank 0's stage dispatching its blocks only, the routing counted over every stage."""
    one, one_rows = one_process(capacity_factor)
    got, rows = run(tmp_path, dp * pp, "--dp", str(dp), "--pp", str(pp), "--ep", str(ep),
                    "--capacity-factor", capacity_factor)
    for first, second in zip(one_rows, rows, strict=True):  # routing first
        assert first["expert_load_by_block"] == second["expert_load_by_block"]
        assert first["dropped_tokens"] == second["dropped_tokens"]
    assert (sum(row["dropped_tokens"] for row in rows) > 0) == (capacity_factor != "0")
    assert got.keys() == one.keys()
    for name, array in one.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    for row in rows:
        assert row["expert_dispatches"] == GPT["layers"] // pp
        assert row["bytes_by_group"]["expert_parallel"] == dispatch_bytes(
            row["expert_dispatches"], row["expert_rows_sent"], row["expert_rows_received"],
            GPT["experts"], ep, GPT["hidden"] * 4)


def test_dp_2_ep_2_in_fp8_keeps_the_replicas_identical_and_sends_bf16_rows(tmp_path):
    """--precision fp8 (delayed) under mpirun: --check-replicas 1 ends the run on any drift of the
    masters or the fp8 state (every rank keeps every expert's); the rows travel in bf16."""
    _, rows = run(tmp_path, 2, "--dp", "2", "--ep", "2", "--precision", "fp8",
                  "--check-replicas", "1")
    for row in rows:
        assert row["bytes_by_group"]["expert_parallel"] == dispatch_bytes(
            row["expert_dispatches"], row["expert_rows_sent"], row["expert_rows_received"],
            GPT["experts"], 2, GPT["hidden"] * 2)


def test_dp_2_ep_2_zero_1_routes_and_ends_as_one_process(one_process, tmp_path):
    """The dense parameters sharded over both ranks, each rank's experts its own (ep = dp: the
    expert group is the rank alone, and sends nothing): routing first, then the weights, then
    rank 0's bytes, the dense units' reduce-scatter and all-gather alone."""
    (one, one_rows), (got, rows) = one_process("0"), run(tmp_path, 2, "--dp", "2", "--ep", "2",
                                                         "--zero", "1")
    for first, second in zip(one_rows, rows, strict=True):
        assert first["expert_load_by_block"] == second["expert_load_by_block"]
        assert first["dropped_tokens"] == second["dropped_tokens"]
    assert got.keys() == one.keys()
    for name, array in one.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    dense, experts, _ = units(2, GPT)
    sent = zero_bytes_sent(1, dense, experts, 2, 2, 0, micro_batches=1, compute_bytes=4,
                           wire_bytes=4)
    assert set(sent) == {"reduce_scatter", "all_gather"}
    for row in rows:
        assert {name: row["bytes_by_collective"][name] for name in sent} == sent
        assert row["bytes_by_group"]["data_parallel"] == sum(sent.values())
