"""--cp's attention measured in the trainer's metrics rows, in the simulated world: every step, on
every rank, the causal blocks each rank computed per attention call are layout.py's causal work
(so their max/min is 1 zig-zag and Ulysses, 2N-1 contiguous), and the bytes attention keeps for
backward are ring_memory's (ulysses_memory's) and 1/N of what one process's attention keeps on the
whole sequence, measured here; the ring's in-flight buffers are ring_memory's; and the memory
check's activations (sizes.py: a rank's T/cp positions, the ring's buffers) bound the measured
peak plus those buffers."""

import math

import numpy as np
import pytest

from minimp import Tensor, backend
from minimp import distributed as dist
from minimp import functional as F
from minimp.parallel.context import ContextLayout, ring_memory, ulysses_memory
from minimp.tensor import saved_bytes
from minimp.train import TrainConfig
from minimp.train.loop import train
from minimp.train.sizes import memory_parts

# The small fp32 GPT, 2 steps (dropout 0: --cp refuses dropout).
GPT = dict(
    dataset="shakespeare", layers=2, hidden=32, heads=4, context=16, batch_size=8, steps=2,
    eval_every=0, log_every=1000, precision="fp32",
)  # fmt: skip


def history(world_size, printed=None, **flags):
    """Every rank's metrics rows of a run on the simulated world; rank 0's lines go to printed."""
    config = TrainConfig(**{**GPT, **flags})
    config.validate(world_size)

    def body(comm):
        return train(config, printed.append if printed is not None and comm.rank == 0 else
                     lambda line: None, comm)

    with backend.limit_cpu_threads(1):
        results = dist.simulate(world_size, body)
    return [result["history"] for result in results]


def one_process_saved_bytes(shape, mode):
    """What one process's attention keeps for backward on the whole sequence's q, k, v (B, H, T,
    D): tiled attention's (the ring's algorithm) or today's (Ulysses' local attention), measured
    on its graph."""
    q, k, v = (Tensor(np.zeros(shape, np.float32), requires_grad=True) for _ in range(3))
    if mode == "ring":
        return saved_bytes(F.tiled_attention(q, k, v, chunk_size=shape[2] // 2))
    scores = q @ k.transpose(0, 1, 3, 2)
    return saved_bytes(F.scaled_masked_softmax(scores, 1 / math.sqrt(shape[-1])) @ v)


CASES = [
    pytest.param(2, dict(cp=2), marks=pytest.mark.slow),  # (the --recompute case is zig-zag)
    (4, dict(cp=4, cp_layout="contiguous")),  # work 2, 6, 10, 14: max/min 7
    pytest.param(4, dict(cp=2, dp=2), marks=pytest.mark.slow),  # each replica attends B/2 rows
    (2, dict(cp=2, cp_mode="ulysses", cp_layout="contiguous")),
    # --recompute: a block's first forward runs without a graph and is not counted
    (2, dict(cp=2, recompute=True)),
    pytest.param(2, dict(cp=2, cp_mode="ulysses", cp_layout="contiguous", recompute=True),
                 marks=pytest.mark.slow),
    pytest.param(4, dict(cp=2, tp=2), marks=pytest.mark.slow),  # H/tp heads a rank
]


@pytest.mark.parametrize("world_size, flags", CASES, ids=str)
def test_measured_work_and_attention_bytes_equal_their_formulas_every_step(world_size, flags):
    cp, mode = flags["cp"], flags.get("cp_mode", "ring")
    layout = ContextLayout(cp, flags.get("cp_layout", "zigzag"))
    rows = GPT["batch_size"] // flags.get("dp", 1)
    tp = flags.get("tp", 1)
    heads, width, tokens = GPT["heads"] // tp, GPT["hidden"] // GPT["heads"], GPT["context"]
    shape = (rows, heads, tokens // cp, width)  # a rank's q
    memory = ring_memory(shape, np.dtype(np.float32), cp)
    saved = memory.saved if mode == "ring" else ulysses_memory(shape, np.float32, cp)
    one_process = one_process_saved_bytes((rows, heads, tokens, width), mode)
    assert saved * cp == one_process  # 1/N of one process's, to the byte
    work = [layout.causal_work(rank // tp % cp) if mode == "ring" else 2 * cp
            for rank in range(world_size)]
    imbalance = 2 * cp - 1 if layout.kind == "contiguous" and mode == "ring" else 1.0
    estimate = dict((what, size) for what, size, _ in memory_parts(
        TrainConfig(**{**GPT, **flags}), world_size))["activations"]
    printed = []
    for records in history(world_size, printed, **flags):
        assert len(records) == GPT["steps"]
        for record in records:
            assert record["context_work"] == work
            assert record["context_work_imbalance"] == imbalance
            assert record["attention_saved_bytes"] == saved
            if mode == "ring":
                assert record["attention_buffer_bytes"] == memory.backward_buffers
            else:  # Ulysses' all-to-all buffers live inside AllToAll, not counted here
                assert "attention_buffer_bytes" not in record
            measured = record["peak_activation_bytes"] + record.get("attention_buffer_bytes", 0)
            assert measured <= estimate  # (fp32 ring: 1.02 times the measured)
    # The summary's last line: the measured work, beside the other layout's formula
    other = {"zigzag": f"contiguous shards: {2 * cp - 1:.2f}",
             "contiguous": "zig-zag shards: 1.00"}[layout.kind]
    if mode == "ulysses":
        other = "Ulysses: every rank all T positions of H/N heads"
    assert printed[-1].splitlines()[-1] == (
        f"  attention     blocks per call by rank {', '.join(f'{w:g}' for w in work)}: max/min "
        f"{imbalance:.2f} ({other})")


def test_without_cp_the_rows_have_no_attention_fields():
    (records,) = history(1, steps=1)
    assert not {"context_work", "context_work_imbalance", "attention_saved_bytes",
                "attention_buffer_bytes"} & records[0].keys()
