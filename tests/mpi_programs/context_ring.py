"""Run under mpirun by tests/test_context_ring_mpi.py: ring attention over real processes, each
rank's forward equal to one process's tiled attention in the ring's order bit for bit, its
gradients within rounding, and the bytes it sent equal to the formula. On 2 ranks the default
--tokens 2048 makes every message 256 KiB, past the 64 KiB eager limit the simulated world models
on MPICH's example, so the sends must not wait before their receives are posted."""

import argparse
import sys

import numpy as np


def main():
    from threadpoolctl import threadpool_limits

    from minimp import Tensor, distributed
    from minimp import functional as F
    from minimp.parallel.context import ContextLayout, ring_attention, ring_bytes, ring_order

    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--tokens", type=int, default=2048)
    arguments = parser.parse_args()
    threadpool_limits(1)  # ranks share the cores: BLAS threads spinning for one cost seconds
    comm = distributed.world()
    layout = ContextLayout(comm.size, arguments.layout)
    rng = np.random.default_rng(0)  # every rank draws the whole sequence alike
    *qkv, grad_output = (rng.standard_normal((1, 2, arguments.tokens, 16)).astype(np.float32)
                         for _ in range(4))
    order = [[] for _ in range(layout.chunks)]  # each chunk's order: its owner's ring's
    for rank in range(comm.size):
        for i, keys in ring_order(layout, rank).items():
            order[i] = list(keys)
    whole = [Tensor(a, requires_grad=True) for a in qkv]
    expected = F.tiled_attention(*whole, arguments.tokens // layout.chunks, order=order)
    expected.backward(grad_output)

    mine = [Tensor(layout.shard(a, comm.rank, axis=2), requires_grad=True) for a in qkv]
    output = ring_attention(*mine, comm, layout)
    forward = comm.bytes_sent
    output.backward(layout.shard(grad_output, comm.rank, axis=2))
    nbytes = ring_bytes(mine[0].shape, np.float32, comm.size)
    assert (forward, comm.bytes_sent - forward) == (nbytes.forward, nbytes.backward)
    assert np.array_equal(output.data, layout.shard(expected.data, comm.rank, axis=2))
    for tensor, reference in zip(mine, whole):
        np.testing.assert_allclose(tensor.grad, layout.shard(reference.grad, comm.rank, axis=2),
                                   rtol=1e-5, atol=1e-7)
    comm.barrier()
    print(f"rank {comm.rank}: ring attention ok, {nbytes.forward} + {nbytes.backward} bytes sent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
