"""The BLAS thread count of --threads 0 (minimp/train/threads.py): the rule on sizes, the largest
product it reads from the flags against the products a step really makes, and the choice the run
prints and records."""

import json
import threading

import numpy as np
import pytest
from conftest import run_train

from minimp import backend
from minimp import distributed as dist
from minimp.ops import linalg
from minimp.train import TrainConfig, threads
from minimp.train.loop import Run
from minimp.train.threads import GRAIN, ThreadChoice, choose_threads, largest_product

MLP = dict(hidden=16, layers=2, batch_size=32, steps=1, log_every=1000)
GPT = dict(dataset="shakespeare", layers=1, hidden=32, heads=2, context=16, batch_size=8, steps=1,
           eval_every=0, eval_batches=1, log_every=1000)


@pytest.mark.parametrize(
    "multiply_adds, allowed, expected",
    [(0, 8, 1), (GRAIN - 1, 8, 1), (GRAIN, 8, 1), (2 * GRAIN - 1, 8, 1), (2 * GRAIN, 8, 2),
     (5 * GRAIN, 8, 5), (100 * GRAIN, 8, 8), (100 * GRAIN, 1, 1)],
)
def test_a_thread_per_whole_grain_of_the_largest_product_within_the_allowed(
    multiply_adds, allowed, expected
):
    assert threads.threads_for_work(multiply_adds, allowed, GRAIN) == expected


def test_every_model_the_readme_runs_gets_one_thread_however_many_cores():
    """The digits MLP (64x128 @ 128x128) and the GPT (768x128 @ 128x512) are far below two
    grains; a GPT 1024 wide (768x1024 @ 1024x4096, 3.2G multiply-adds) gets 3 of 64 cores."""
    for settings in (dict(), dict(dataset="shakespeare")):
        config = TrainConfig(**settings)
        assert choose_threads(config, cores=64, ranks_on_this_node=1, world_size=1).threads == 1
        assert choose_threads(config, cores=64, ranks_on_this_node=4, world_size=4).threads == 1
    wide = TrainConfig(dataset="shakespeare", hidden=1024, heads=8)
    assert largest_product(wide, 1) == (768, 1024, 4096)
    assert choose_threads(wide, cores=64, ranks_on_this_node=1, world_size=1).threads == 3
    assert choose_threads(wide, cores=2, ranks_on_this_node=1, world_size=1).threads == 2
    assert choose_threads(wide, cores=2, ranks_on_this_node=2, world_size=2).threads == 1


def test_threads_given_are_kept_and_the_reason_says_how_the_rule_chose():
    forced = choose_threads(TrainConfig(threads=3), cores=2, ranks_on_this_node=2, world_size=2)
    assert forced == ThreadChoice(3, "--threads 3")
    assert threads.describe(forced) == "threads: 3 BLAS threads per rank (--threads 3)"
    chosen = choose_threads(TrainConfig(), cores=8, ranks_on_this_node=2, world_size=2)
    assert threads.describe(chosen) == (
        "threads: 1 BLAS thread per rank (--threads 0: largest product 32x128 @ 128x128, 0.5M "
        "multiply-adds; a thread per 2^30, up to 8 cores / 2 ranks)")


@pytest.mark.parametrize(
    "world_size, settings",
    [(1, MLP), (1, {**MLP, "layers": 1, "hidden": 128}),  # no 128 x 128: 64 -> 128 the largest
     (2, {**MLP, "micro_batches": 2}), (2, {**MLP, "tp": 2}),
     (1, GPT),  # 32 wide: the head (32 -> 65 characters) outgrows c_fc (32 -> 128)
     (1, {**GPT, "hidden": 16, "heads": 1}), (2, {**GPT, "tp": 2})],
    ids=["mlp", "mlp-1-layer", "mlp-dp-micro-batches", "mlp-tp", "gpt", "gpt-head", "gpt-tp"],
)
def test_the_largest_product_is_the_largest_a_step_makes(monkeypatch, world_size, settings):
    """The products of one step are recorded (every Linear's, forward and backward, and every
    MatMul's forward: attention's, one matrix of the batch at a time, and the head's, whose
    backward products multiply-add as often); the largest has the multiply-adds
    largest_product computes from the flags alone."""
    made, stepping = [], threading.local()  # the step's products, not the set-up's

    def recording(original):
        def product(*arrays):
            a, b = arrays[-2:]
            if getattr(stepping, "now", False):
                made.append(a.shape[-2] * a.shape[-1] * b.shape[-1])
            return original(*arrays)
        return product

    def step(comm):
        run = Run(config, comm, log=lambda line: None)
        stepping.now = True  # this rank's thread of the simulated world
        run.step(1)

    monkeypatch.setattr(linalg, "pooled_matmul", recording(linalg.pooled_matmul))
    monkeypatch.setattr(linalg.MatMul, "forward", staticmethod(recording(linalg.MatMul.forward)))
    config = TrainConfig(**settings)
    config.validate(world_size)
    dist.simulate(world_size, step)
    assert made and max(made) == np.prod(largest_product(config, world_size))


def test_the_command_prints_and_records_the_threads_it_chose(tmp_path):
    metrics = tmp_path / "m.jsonl"
    flags = ["--hidden", "16", "--layers", "1", "--batch-size", "32", "--steps", "1"]
    result = run_train(1, [*flags, "--threads", "0", "--metrics", str(metrics)])
    assert result.returncode == 0, result.stderr
    config = TrainConfig(hidden=16, layers=1, batch_size=32)
    choice = choose_threads(config, backend.available_cores(), 1, 1)
    assert result.stdout.splitlines()[2] == f"  {threads.describe(choice)}"
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert (final["threads"], final["threads_reason"]) == choice
