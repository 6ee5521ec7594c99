"""Tensor parallelism's byte accounts by hand: what a block keeps for backward and what a GPT
step sends, on sizes small enough to add up in a docstring."""

import numpy as np

from minimp.measure.tensor_parallel_accounts import (
    block_activation_bytes_tp, gpt_tensor_parallel_bytes,
)  # fmt: skip


def test_block_bytes_by_hand_are_whole_ints_and_the_defaults_are_tp_with_dropout():
    """s = 4, b = 2, h = 8, a = 2, fp16 (d = 2), tp = 2: sbh = 64, the attention's a s s b = 64.
    tp: (4d + 2) sbh + 12 d sbh / 2 + (2d + 1) ass b / 2 + 2 * 2 * 4 sb = 640 + 768 + 160 + 128;
    tp + sp: 2 d sbh + 768 + (2d + 2) sbh / 2 + 160 + 128 / 2."""
    default = block_activation_bytes_tp(4, 2, 8, 2, np.float16, 2)
    sequence = block_activation_bytes_tp(4, 2, 8, 2, np.float16, 2, sequence_parallel=True)
    assert (default, sequence) == (640 + 768 + 160 + 128, 256 + 768 + 192 + 160 + 64)
    assert type(default) is int and type(sequence) is int  # bytes: no float division
    assert default == block_activation_bytes_tp(4, 2, 8, 2, np.float16, 2, False, True)


def test_gpt_bytes_default_to_tensor_parallelism_without_sequence_parallelism():
    """3 micro-batches x 2 blocks x 8 halves of a collective x (4 x 8 x 16 x 2 bytes), each rank
    sending (2 - 1)/2 of it."""
    sent = gpt_tensor_parallel_bytes(
        blocks=2, rows=4, context=8, width=16, tp=2, micro_batches=3, compute_bytes=2
    )
    assert sent == 3 * 2 * 8 * (4 * 8 * 16 * 2) // 2
