"""minimp/distributed/ring_nonblocking.py's RingAllreduce against the blocking ring it restates
(minimp/distributed/ring.py), on the simulated world: the same messages, each under the tag of
its half (reduce-scatter: tags[0], all-gather: tags[1]), and the same bits."""

import numpy as np
import pytest

from minimp import distributed as dist
from minimp.distributed.protocol import Tag
from minimp.distributed.ring import ring_allreduce_into
from minimp.distributed.ring_nonblocking import RingAllreduce

LENGTH = 11  # uneven chunks over 2, 3 and 4 ranks: each chunk's size shows in nbytes


def rank_data(rank):
    return np.random.default_rng(rank).standard_normal(LENGTH).astype(np.float32)


def messages(trace, renamed=None):
    """Each message as (source, sender's step, dest, tag, nbytes), tags renamed where asked."""
    renamed = renamed or {}
    return sorted(
        (m.source, m.step, m.dest, renamed.get(m.tag, m.tag), m.nbytes) for m in trace
    )


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("tags", [None, (7, 9)])
def test_the_non_blocking_ring_sends_the_blocking_ring_s_messages_under_its_tags(p, tags):
    """Step s < p - 1 of the reduce-scatter goes under tags[0], every all-gather step under
    tags[1]: the blocking ring's RING_REDUCE_SCATTER and RING_ALL_GATHER messages, renamed."""

    def blocking(comm):
        out = np.empty(LENGTH, np.float32)
        ring_allreduce_into(comm, rank_data(comm.rank), out)
        return out

    def non_blocking(comm):
        out = np.empty(LENGTH, np.float32)
        if tags is None:
            RingAllreduce(comm, rank_data(comm.rank), out).wait()
        else:
            RingAllreduce(comm, rank_data(comm.rank), out, tags=tags).wait()
        return out

    reference = dist.simulate(p, blocking, eager_limit=0)
    ring = dist.simulate(p, non_blocking, eager_limit=0)
    halves = (Tag.RING_REDUCE_SCATTER, Tag.RING_ALL_GATHER)
    renamed = {} if tags is None else dict(zip(halves, tags))
    assert messages(ring.trace) == messages(reference.trace, renamed)
    assert len(ring.trace) == 2 * p * (p - 1)
    for got, expected in zip(ring, reference):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("p", [1, 3])
@pytest.mark.parametrize(
    "out", [np.empty(LENGTH, np.float64), np.empty(LENGTH + 1, np.float32)], ids=["dtype", "size"]
)
def test_an_out_of_another_dtype_or_another_size_is_refused_before_any_message(p, out):
    """Either mismatch alone is refused, by name, at construction: no message is sent (on one rank
    out = x would cast silently; on three, float32 chunks would land in float64 slots)."""

    def body(comm):
        RingAllreduce(comm, rank_data(comm.rank), out.copy()).wait()

    with pytest.raises(ValueError, match="out must be a float32 array of 11 elements"):
        dist.simulate(p, body, timeout=5.0)
