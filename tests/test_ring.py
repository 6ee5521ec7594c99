"""minimp/distributed/ring.py's two halves as collectives of their own, pinned on the simulated
world: reduce_scatter's `op`, all_gather's default length and chunk shapes, and the names their
(and the whole ring all-reduce's) mismatch errors carry."""

import numpy as np
import pytest

from minimp import distributed as dist


def test_reduce_scatter_applies_the_op_it_is_given():
    inputs = [np.array([r, -r, 3 * r, 7, -2 * r], np.float32) for r in range(3)]
    bounds = dist.chunk_bounds(5, 3)  # (0, 2), (2, 4), (4, 5)
    for op, reduce in (("max", np.maximum), ("min", np.minimum), ("sum", np.add)):
        chunks = dist.simulate(3, lambda comm: dist.reduce_scatter(comm, inputs[comm.rank], op=op))
        exact = reduce.reduce(np.array(inputs), axis=0)
        for rank, chunk in enumerate(chunks):
            start, stop = bounds[rank]
            np.testing.assert_array_equal(chunk, exact[start:stop])


def test_all_gather_without_a_length_concatenates_equal_chunks_of_any_shape():
    def gather(comm):
        chunk = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * comm.rank
        return dist.all_gather(comm, chunk)

    expected = np.concatenate([np.arange(6, dtype=np.float32) + 10 * rank for rank in range(3)])
    for gathered in dist.simulate(3, gather):
        assert gathered.shape == (18,)
        np.testing.assert_array_equal(gathered, expected)
    alone = dist.all_gather(dist.world(), np.ones((2, 2), np.float16))
    assert alone.shape == (4,) and alone.dtype == np.float16


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather", "ring_allreduce"])
def test_a_mismatch_names_the_collective(collective):
    def mismatched(comm):
        length = 4 + 2 * comm.rank  # 4 on rank 0, 6 on rank 1
        with pytest.raises(dist.CollectiveMismatchError) as caught:
            if collective == "reduce_scatter":
                dist.reduce_scatter(comm, np.ones(length, np.float32))
            elif collective == "ring_allreduce":
                dist.ring_allreduce(comm, np.ones(length, np.float32))
            else:  # each rank's chunk fits its own length: chunk 0 of 4 is 2, chunk 1 of 6 is 3
                dist.all_gather(comm, np.ones(length // 2, np.float32), length=length)
        return str(caught.value)

    for message in dist.simulate(2, mismatched):
        assert message.startswith(f"{collective}: ranks disagree on the array (lengths 4..6")
