"""Activation recomputation: the same bits as without it, one input kept per block, one more
forward of every block."""

import numpy as np
import pytest
from test_train_gpt import TINY
from test_zero import run_steps

from minimp.models import block_activation_bytes
from minimp.ops.linalg import Linear


def run(world_size=1, **overrides):
    return run_steps(world_size, **overrides)[0]


# The digits MLP over TINY's GPT settings: none of the GPT's own flags (the MLP refuses them).
MLP = dict(dataset="digits", heads=0, context=0, dropout=0.0, eval_every=0, eval_batches=0)


def same_bits(a, b):
    return all(a[name].tobytes() == b[name].tobytes() for name in a)


@pytest.mark.parametrize(
    "flags, world_size",
    [
        (dict(MLP, layers=3, hidden=32, batch_size=32), 1),
        (dict(precision="fp16", dropout=0.2, pp=2, micro_batches=2, schedule="1f1b"), 2),
    ],
    ids=["mlp-fp32", "gpt-fp16-dropout-1f1b"],
)
def test_recomputation_gives_the_same_bits(flags, world_size):
    """With 1F1B the second micro-batch's forward sets the dropout states before the first one's
    backward reruns its blocks: the masks replay because recomputation restores the states."""
    flags = {**flags, "steps": 4}
    plain, again = run(world_size, **flags), run(world_size, recompute=True, **flags)
    assert same_bits(again["master_weights"], plain["master_weights"])
    assert [r["loss"] for r in again["history"]] == [r["loss"] for r in plain["history"]]


@pytest.mark.parametrize("precision, dropout", [("fp32", 0.0), ("fp16", 0.1)])
def test_a_recomputed_gpt_block_keeps_only_its_input(precision, dropout):
    """Kept for backward: each block's 34 sbh + 5 as^2 b (+ 16 sb; models/gpt.py) becomes one
    input, d sbh; the embeddings and the head keep what they kept."""
    flags = dict(precision=precision, dropout=dropout, steps=1, micro_batches=2)
    plain = run(**flags)["history"][0]["peak_activation_bytes"]
    kept = run(recompute=True, **flags)["history"][0]["peak_activation_bytes"]
    s, b, h, a = TINY["context"], TINY["batch_size"] // 2, TINY["hidden"], TINY["heads"]
    dtype = np.float32 if precision == "fp32" else np.float16
    block = block_activation_bytes(s, b, h, a, dtype, dropout=dropout > 0)
    one_input = np.dtype(dtype).itemsize * s * b * h
    assert plain - kept == TINY["layers"] * (block - one_input)


def test_the_mlp_block_already_keeps_only_its_input():
    """Linear keeps its input and ReLU its output, which is the next block's input: the MLP keeps
    nothing that recomputation could drop, and pays the forward all the same."""
    flags = dict(MLP, layers=3, hidden=32, batch_size=32, steps=1)
    plain = run(**flags)["history"][0]["peak_activation_bytes"]
    assert run(recompute=True, **flags)["history"][0]["peak_activation_bytes"] == plain


def test_recomputation_costs_one_more_forward_of_every_block(monkeypatch):
    """Counted, not timed: every Linear of every block runs twice a micro-batch, nothing else."""
    calls = []
    forward = Linear.forward
    counted = lambda *args, **options: calls.append(1) or forward(*args, **options)  # noqa: E731
    monkeypatch.setattr(Linear, "forward", counted)
    flags = dict(steps=2, micro_batches=2)
    run(**flags)
    plain, calls[:] = len(calls), []
    run(recompute=True, **flags)
    per_block = 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    steps, micro_batches = 2, 2
    assert len(calls) - plain == TINY["layers"] * per_block * micro_batches * steps
