"""ShardedOptimizer's compute copies, bit by bit: after `publish()` every float16 parameter is its
float32 master rounded straight into float16, on one replica and gathered from two; stage 3's
chunks alike; stage 2's refusal of a gradient left out of the reduce-scatter; the whole slots
let go once cut into a rank's chunks; the step's first reduced chunk copied bit for bit; and no
gather buffer listed where nothing is all-gathered."""

import gc
import weakref

import numpy as np
import pytest

from minimp import nn
from minimp import distributed as dist
from minimp.distributed.ring import chunk_bounds
from minimp.optim import SGD, Adam
from minimp.parallel.zero.data_parallel import zero_data_parallel

# float32 bit patterns a detour through float64 would change: a signalling NaN (quiet bit clear)
# becomes quiet when widened, so its float16 rounding gains the quiet bit; with the NaN's top ten
# fraction bits (0x7D00) or the lowest one set (0x7C01: ten zero bits would read as infinity).
SIGNALLING_NANS = np.array([0x7F800001, 0x7FA00000, 0xFF800001], np.uint32).view(np.float32)
FINITE = np.array([1.0, 65519.0, 65520.0, 2.0**-25, -(2.0**-24) * 1.5], np.float32)


def _published(comm, stage):
    """(this rank's float16 weight bits after publish, the float32 masters it came from)."""
    layer = nn.Linear(4, 2, bias=False)
    layer.weight.data[...] = np.concatenate([SIGNALLING_NANS, FINITE]).reshape(2, 4)
    masters = layer.weight.data.copy()
    optimizer = SGD(layer.parameters(), lr=0.1)
    with np.errstate(over="ignore"):  # 65520 rounds to infinity on purpose
        layer.to(np.float16)
    sync = zero_data_parallel(stage, optimizer, [layer], comm)
    layer.weight.data[...] = 0  # publish must write every element
    with np.errstate(over="ignore"):
        sync.optimizer.publish()
    return layer.weight.data.view(np.uint16).copy(), masters


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_publish_rounds_each_master_straight_into_float16(ranks, stage):
    for bits, masters in dist.simulate(ranks, _published, stage):
        with np.errstate(invalid="ignore", over="ignore"):
            expected = masters.astype(np.float16).view(np.uint16)  # NumPy's own cast
        assert [hex(b) for b in bits.ravel()] == [hex(b) for b in expected.ravel()]


def _stage_3_published(comm):
    """(this rank's float16 compute chunk after publish, the float32 masters it came from)."""
    layer = nn.Linear(4, 2, bias=False)
    layer.weight.data[...] = np.concatenate([SIGNALLING_NANS, FINITE]).reshape(2, 4)
    masters = layer.weight.data.copy()
    optimizer = SGD(layer.parameters(), lr=0.1)
    with np.errstate(over="ignore"):  # stage 3 rounds its compute chunks when it is built
        layer.to(np.float16)
        sharded = zero_data_parallel(3, optimizer, [layer], comm).optimizer
    [chunk] = sharded.compute_chunks  # the weight is the one unit; stage 3 keeps only chunks
    chunk[...] = 0  # publish must write every element
    with np.errstate(over="ignore"):
        sharded.publish()
    return chunk.view(np.uint16).copy(), masters


@pytest.mark.parametrize("ranks", [1, 2])
def test_stage_3_publish_rounds_each_master_chunk_straight_into_float16(ranks):
    """Stage 3 gathers nothing in publish: each rank rounds its chunk of the masters (8 elements
    cut by chunk_bounds) into the float16 chunk the layers gather from."""
    for rank, (bits, masters) in enumerate(dist.simulate(ranks, _stage_3_published)):
        start, stop = chunk_bounds(masters.size, ranks)[rank]
        with np.errstate(invalid="ignore", over="ignore"):
            expected = masters.ravel()[start:stop].astype(np.float16).view(np.uint16)
        assert [hex(b) for b in bits] == [hex(b) for b in expected]


def _unreduced_gradient(comm):
    parameter = nn.Parameter(np.zeros(3, np.float32))
    sharded = zero_data_parallel(2, SGD([parameter], lr=0.1), [], comm).optimizer
    parameter.grad = np.ones(3, np.float32)  # no after_backward reduce-scattered it
    with pytest.raises(RuntimeError, match=r"ZeRO stage 2: parameter\(s\) \[0\] hold gradients"):
        sharded.accumulate_gradients()


def test_stage_2_refuses_to_step_past_a_gradient_that_was_never_reduce_scattered():
    """Stage 2 keeps only the reduced chunks: a whole gradient left in .grad would be lost."""
    dist.simulate(2, _unreduced_gradient)


def _slots_after_cutting(comm):
    """(this rank's exp_avg chunk, the whole exp_avg it came from, whether every whole slot
    array the wrapped optimizer held is gone) for a resumed Adam over Linear(4, 3)."""
    layer = nn.Linear(4, 3)
    optimizer = Adam(layer.parameters(), lr=0.1)
    saved = [{"exp_avg": p.data + 1, "exp_avg_sq": p.data * p.data} for p in layer.parameters()]
    optimizer.load_state_dict({"step_count": 1, "lr": 0.1, "slots": saved})  # copies them
    whole = [weakref.ref(array) for slots in optimizer.slots for array in slots.values()]
    sharded = zero_data_parallel(2, optimizer, [layer], comm).optimizer
    gc.collect()
    [pieces] = sharded.slots  # the weight and the bias are one unit
    chunk = np.concatenate([piece["exp_avg"] for piece in pieces])
    flat = np.concatenate([slots["exp_avg"].ravel() for slots in saved])
    return chunk, flat, [ref() is None for ref in whole]


def test_the_whole_slots_are_let_go_once_cut_into_this_rank_s_chunks():
    """Each rank keeps copies of its chunk (15 elements: [0, 8) and [8, 15)); a view would keep
    the whole slot alive behind it, and ZeRO would save none of the slots' memory."""
    for rank, (chunk, flat, freed) in enumerate(dist.simulate(2, _slots_after_cutting)):
        start, stop = chunk_bounds(flat.size, 2)[rank]
        assert chunk.tolist() == flat[start:stop].tolist()
        assert freed == [True] * 4


def _first_reduced_chunk(comm):
    """(the bits of this rank's gradient after the step's first reduced chunk, the chunk's)."""
    parameter = nn.Parameter(np.zeros(4, np.float32))
    sharded = zero_data_parallel(2, SGD([parameter], lr=0.1), [], comm).optimizer
    chunk = np.array([-0.0, 1.5, -0.0, -2.0], np.float32)  # one rank: the chunk is the unit
    sharded.add_reduced(0, chunk)
    return np.concatenate(sharded.gradient_pieces()).view(np.uint32), chunk.view(np.uint32)


def test_the_step_s_first_reduced_chunk_is_copied_bit_for_bit_not_added_to_zeros():
    """add_reduced copies the first chunk of a step, the first step included: added to the zeros
    the gradient sums start as, a -0.0 would come back +0.0 (0.0 + -0.0 is +0.0)."""
    [(gradient, chunk)] = dist.simulate(1, _first_reduced_chunk)
    assert [hex(b) for b in gradient] == [hex(b) for b in chunk]


def _buffers_listed(comm, stage):
    sharded = zero_data_parallel(stage, SGD(nn.Linear(3, 2).parameters(), lr=0.1), [], comm)
    return sharded.optimizer.arrays_by_kind()["buffers"], sharded.optimizer.gather_buffer


@pytest.mark.parametrize("ranks, stage", [(1, 1), (1, 2), (2, 3)])
def test_an_optimizer_that_all_gathers_nothing_lists_no_gather_buffer(ranks, stage):
    """One replica, and stage 3 (whose layers gather), hold no gather buffer: the buffers the
    optimizer lists are none, not a None."""
    for buffers, gather_buffer in dist.simulate(ranks, _buffers_listed, stage):
        assert gather_buffer is None and buffers == []


def test_two_replicas_in_stage_1_list_their_gather_buffer():
    for buffers, gather_buffer in dist.simulate(2, _buffers_listed, 1):
        assert len(buffers) == 1 and buffers[0] is gather_buffer
