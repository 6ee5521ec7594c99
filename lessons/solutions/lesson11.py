"""Reference solutions to lesson 11's exercises (who holds what). Try them yourself first."""

import numpy as np

from minimp import distributed as dist


def chunk(size, rank, world_size):
    """Elements of a unit of `size` that rank holds: the ring's cut (the first size % N ranks
    get one more)."""
    start, stop = dist.chunk_bounds(size, world_size)[rank]
    return stop - start


def bytes_held(stage, unit_sizes, rank, world_size):
    """fp16 compute copies (2 bytes), fp32 accumulators, masters and Adam's two slots (4 + 4 + 8),
    fp32 wire buffers: stage 1 shards masters and slots, stage 2 the accumulators too, stage 3
    the compute copy too; each sharded kind holds this rank's chunk of every unit."""
    whole = sum(unit_sizes)
    shard = sum(chunk(size, rank, world_size) for size in unit_sizes)
    largest = max(unit_sizes)
    if world_size == 1:
        buffers = 0
    elif stage == 0:
        buffers = 2 * 4 * whole  # send and receive, fp32, the whole model
    elif stage < 3:
        buffers = (2 * 4 + 2) * largest  # send and receive of a unit, and its fp16 all-gather
    else:
        buffers = 2 * 4 * largest  # stage 3 gathers into arrays it frees after each layer
    return {
        "parameters": 2 * (shard if stage == 3 else whole),
        "accumulators": 4 * (shard if stage >= 2 else whole),
        "masters": 4 * (shard if stage >= 1 else whole),
        "optimizer_state": 8 * (shard if stage >= 1 else whole),
        "buffers": buffers,
    }


def zero1_step(comm, weights, master, grad, lr):
    """The all-reduce cut at its seam: reduce-scatter the gradient (scaled by 1/N first, as the
    all-reduce of data parallelism does), update this rank's chunk, all-gather the weights."""
    mean = dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))  # this rank's chunk
    master -= lr * mean
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def bytes_sent(stage, unit_sizes, rank, world_size, micro_batches):
    """Ring halves over each unit: a reduce-scatter sends every chunk but the rank's own, an
    all-gather every chunk but its right neighbour's. fp32 gradients (4 bytes), fp16 weights
    (2 bytes); stage 0 is one all-reduce of one bucket holding every unit."""
    if world_size == 1:
        return 0
    right = (rank + 1) % world_size
    sizes = [sum(unit_sizes)] if stage == 0 else unit_sizes
    scatter = sum(size - chunk(size, rank, world_size) for size in sizes)
    gather = sum(size - chunk(size, right, world_size) for size in sizes)
    if stage == 0:
        return 4 * (scatter + gather)
    if stage == 1:
        return 4 * scatter + 2 * gather
    if stage == 2:
        return 4 * micro_batches * scatter + 2 * gather
    return micro_batches * (4 * scatter + 2 * 2 * gather)  # forward and backward gathers
