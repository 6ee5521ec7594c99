"""`mpirun -n N python -m minimp.train --cp ...` for real: the issue's small fp32 GPT ends at the
one-process weights (--cp 2, --cp 2 --tp 2 and --cp 2 --pp 2 in the default tier; --cp 4,
--cp 2 --dp 2, the contiguous layout and --cp-mode ulysses in the slow one), rank 0's context bytes
are ring_bytes' (ulysses_bytes') every step, on its stage's blocks and H/tp heads, the layout line
and the work balance are printed, and a refused flag is one line from rank 0 with no hang."""

import json

import numpy as np
import pytest
from conftest import MPIRUN, masters, run_train, slow_cases

from minimp.parallel.context import ring_bytes, ulysses_bytes
from minimp.train import TrainConfig
from minimp.train.sizes import stage_bounds

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')"),
]
GPT = dict(layers=2, hidden=32, heads=4, context=16, batch_size=8, steps=3)
FLAGS = ["--dataset", "shakespeare", "--eval-every", "0", "--log-every", "1000"]
FLAGS += ["--precision", "fp32", "--dropout", "0"]
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
    (2, ["--cp", "2"]),
    (4, ["--cp", "2", "--tp", "2"]),
    (4, ["--cp", "2", "--pp", "2"]),
    (4, ["--cp", "4"]),
    (4, ["--cp", "2", "--dp", "2"]),
    (2, ["--cp", "2", "--cp-layout", "contiguous"]),
    (2, ["--cp", "2", "--cp-layout", "contiguous", "--cp-mode", "ulysses"]),
]


@pytest.mark.parametrize(
    "ranks, layout", [*LAYOUTS[:1], *slow_cases(*LAYOUTS[1:])],
    ids=[" ".join(layout) for _, layout in LAYOUTS],
)  # fmt: skip
def test_every_layout_ends_with_the_one_process_weights(tmp_path, one_process, ranks, layout):
    path, metrics = tmp_path / "cp.npz", tmp_path / "cp.jsonl"
    result = train_command(ranks, *layout, "--save", str(path), "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr
    got = masters(path)
    assert got.keys() == one_process.keys()
    for name, array in one_process.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    options = dict(zip(layout[0::2], layout[1::2]))
    cp, dp = int(options["--cp"]), int(options.get("--dp", 1))
    tp, pp = int(options.get("--tp", 1)), int(options.get("--pp", 1))
    heads, width = GPT["heads"], GPT["hidden"]
    shape = (GPT["batch_size"] // dp, heads // tp, GPT["context"] // cp, width // heads)
    ulysses = options.get("--cp-mode") == "ulysses"
    formula = ulysses_bytes if ulysses else ring_bytes
    call = formula(shape, np.dtype(np.float32), cp)  # a block's attention, fp32
    start, stop = stage_bounds(TrainConfig(dataset="shakespeare", **GPT, pp=pp))[0]  # rank 0's
    blocks = sum(1 <= i <= GPT["layers"] for i in range(start, stop))
    expected = blocks * (call.forward + call.backward)
    steps = [json.loads(line) for line in open(metrics)][:-1]  # the last row is the summary
    assert [r["bytes_by_group"]["context_parallel"] for r in steps] == [expected] * GPT["steps"]
    contiguous_ring = options.get("--cp-layout") == "contiguous" and not ulysses
    balance = 2 * cp - 1 if contiguous_ring else 1  # Ulysses: every rank H/N heads, all of T
    assert [r["context_work_imbalance"] for r in steps] == [balance] * GPT["steps"]
    assert f"layout: --dp {dp} x --cp {cp} x --tp {tp} x --pp {pp} = {ranks} ranks" in result.stdout


@pytest.mark.slow  # 4 ranks started to hear one line
def test_a_refused_flag_is_one_error_from_rank_0_and_no_hang():
    result = train_command(4, "--cp", "2", "--dp", "2", "--dropout", "0.1", timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("minimp.train: error:") == 1
    assert "--cp 2 with --dropout 0.1: dropout masks are drawn per position" in result.stderr
    assert "Traceback" not in result.stderr
