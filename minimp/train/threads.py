"""How many BLAS threads each rank runs: one per grain of work in the step's largest product.

`--threads 0` (the default) gives a rank one thread per GRAIN multiply-adds of the largest matrix
product its step makes, at least one and at most this machine's cores divided by its ranks: the
idea of PyTorch's at::parallel_for, which gives a loop no more tasks than it has grain_size chunks
(rounded up; here down, so that every thread gets a whole grain). Why a grain this large:
OpenBLAS's threads wait for work by spinning, so where the cores are shared (other processes, or
ranks) a second thread steals the core the first one needs, and every product then waits for a
thread the scheduler has set aside. Small products lose to that: beside two busy processes, the
default digits run took 11-32 s with two threads, 1.8-2.0 s with one (docs/benchmarks.md,
"Threads that fit the work": `python benchmarks/threads_bench.py --busy 2`).

Why a rule and not a probe timing the model's product at start-up: BLAS results depend on the
thread count (OpenBLAS's sgemm of 64x64 @ 64x128 differs in its last bits between 1 and 2
threads), so a count chosen by a timing would let a rerun of the same command give other numbers,
by the load of the moment. The rule depends on the flags and the machine only, and every rank on
a machine reaches the same count by itself, with no message.
"""

import math
from typing import TYPE_CHECKING, NamedTuple

from minimp.train.sizes import DIGITS_SHAPE, SHAKESPEARE_VOCABULARY

if TYPE_CHECKING:  # config.py imports checks.py, which imports sizes.py
    from minimp.train.config import TrainConfig

# Multiply-adds of the largest product per BLAS thread: 2^30, about 17 ms of one core's sgemm on
# this project's 2-core machine. There, beside busy processes, a second thread cost 9-17x on the
# GPT's largest product (50M) and paid only from billions of multiply-adds (`python
# benchmarks/threads_bench.py --products --busy 2`; docs/benchmarks.md has the table): a second
# thread joins at 2 x 2^30.
GRAIN = 2**30  # a power of two: the reason says it as 2^30


class ThreadChoice(NamedTuple):
    """The BLAS threads a rank runs, and why (a phrase for the run's header and its metrics)."""

    threads: int
    reason: str


def threads_for_work(multiply_adds: int, allowed: int, grain: int) -> int:
    """One thread per whole grain of multiply-adds, at least 1 and at most `allowed`."""
    return max(1, min(allowed, multiply_adds // grain))


def largest_product(config: "TrainConfig", world_size: int) -> tuple[int, int, int]:
    """(rows, inner, columns) of the largest matrix product one rank's step makes: a Linear's
    forward, (rows, inner) @ (inner, columns), whose two backward products make as many
    multiply-adds; rows are one micro-batch of one replica (times --context / --cp for the GPT,
    the positions a context shard holds). --tp cuts every Linear but the last (the MLP's output,
    the GPT's head) to 1/tp of its columns.
    The GPT's attention products (context x head width x context) are smaller than its Linears'."""
    dp = config.data_parallel_size(world_size)
    positions = max(1, (config.context or 1) // config.cp)
    rows = max(1, config.batch_size // dp // config.micro_batches) * positions
    width = config.hidden
    if config.model == "gpt":  # c_fc, C -> 4C, the largest of a block's four Linears
        cut, last = [(width, 4 * width)], (width, SHAKESPEARE_VOCABULARY)
    else:
        features, classes = DIGITS_SHAPE
        cut = [(features, width)] + ([(width, width)] if config.layers > 1 else [])
        last = (width, classes)
    shapes = [(rows, inner, max(1, columns // config.tp)) for inner, columns in cut]
    return max(shapes + [(rows, *last)], key=math.prod)


def choose_threads(config: "TrainConfig", cores: int, ranks_on_this_node: int,
                   world_size: int) -> ThreadChoice:
    """--threads when given, else threads_for_work on the largest product, allowed this
    machine's cores / its ranks (never fewer than 1)."""
    if config.threads:
        return ThreadChoice(config.threads, f"--threads {config.threads}")
    rows, inner, columns = largest_product(config, world_size)
    allowed = max(1, cores // ranks_on_this_node)
    threads = threads_for_work(rows * inner * columns, allowed, GRAIN)
    ranks = f"{ranks_on_this_node} rank" + ("s" if ranks_on_this_node > 1 else "")
    reason = (f"--threads 0: largest product {rows}x{inner} @ {inner}x{columns}, "
              f"{rows * inner * columns / 1e6:,.1f}M multiply-adds; a thread per "
              f"2^{GRAIN.bit_length() - 1}, up to {cores} cores / {ranks}")
    return ThreadChoice(threads, reason)


def describe(choice: ThreadChoice) -> str:
    """`threads: 1 BLAS thread per rank (why)`: the line the run's header prints."""
    plural = "s" if choice.threads > 1 else ""
    return f"threads: {choice.threads} BLAS thread{plural} per rank ({choice.reason})"
