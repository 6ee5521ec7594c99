"""minimp/distributed/buffers.py pinned directly: the flat copy a one-rank collective returns goes
into the caller's `out` when given (the buffer reused step after step), and x is only read."""

import numpy as np

from minimp import distributed as dist
from minimp.distributed.buffers import flat_copy


def test_flat_copy_copies_x_into_the_out_it_is_given():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = np.zeros((2, 3), np.float32)
    flat = flat_copy(x, out)
    assert flat.shape == (6,) and np.shares_memory(flat, out)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_flat_copy_without_out_is_a_new_flat_array():
    x = np.arange(6, dtype=np.float16).reshape(3, 2)
    flat = flat_copy(x)
    assert flat.shape == (6,) and flat.dtype == np.float16 and not np.shares_memory(flat, x)
    np.testing.assert_array_equal(flat, x.reshape(-1))


def test_a_one_rank_ring_allreduce_writes_into_out():
    # one rank: no messages, the ring returns flat_copy(x, out) in x's shape
    def into_buffer(comm):
        x = np.array([[1.5, -2.0], [3.0, 4.25]], np.float32)
        out = np.full((2, 2), np.nan, np.float32)
        result = dist.ring_allreduce(comm, x, out=out)
        return result, out

    ((result, out),) = dist.simulate(1, into_buffer)
    assert result.shape == (2, 2) and np.shares_memory(result, out)
    np.testing.assert_array_equal(out, [[1.5, -2.0], [3.0, 4.25]])
