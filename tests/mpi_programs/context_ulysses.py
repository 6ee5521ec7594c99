"""Run under mpirun by tests/test_context_ulysses_mpi.py: Ulysses attention over real processes,
each rank's output and gradients equal to one process's attention bit for bit, and the bytes it
sent equal to the formula. On 2 ranks the default --tokens 1024 (4 heads of 32) makes every
message 128 KiB, past the 64 KiB eager limit the simulated world models on MPICH's example, so
the all-to-all's sends must not wait before their receives are posted."""

import argparse
import math
import sys

import numpy as np


def main():
    from threadpoolctl import threadpool_limits

    from minimp import Tensor, distributed
    from minimp import functional as F
    from minimp.parallel.context import ContextLayout, ulysses_attention, ulysses_bytes

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    arguments = parser.parse_args()
    threadpool_limits(1)  # ranks share the cores: BLAS threads spinning for one cost seconds
    comm = distributed.world()
    layout = ContextLayout(comm.size, "contiguous")
    rng = np.random.default_rng(0)  # every rank draws the whole sequence alike
    *qkv, grad_output = (rng.standard_normal((1, 2 * comm.size, arguments.tokens, 32))
                         .astype(np.float32) for _ in range(4))
    q, k, v = whole = [Tensor(a, requires_grad=True) for a in qkv]
    expected = F.scaled_masked_softmax(q @ k.transpose(0, 1, 3, 2), 1 / math.sqrt(32)) @ v
    expected.backward(grad_output)

    mine = [Tensor(layout.shard(a, comm.rank, axis=2), requires_grad=True) for a in qkv]
    output = ulysses_attention(*mine, comm, layout)
    forward = comm.bytes_sent
    output.backward(layout.shard(grad_output, comm.rank, axis=2))
    nbytes = ulysses_bytes(mine[0].shape, np.float32, comm.size)
    assert (forward, comm.bytes_sent - forward) == (nbytes.forward, nbytes.backward)
    assert np.array_equal(output.data, layout.shard(expected.data, comm.rank, axis=2))
    for tensor, reference in zip(mine, whole):
        assert np.array_equal(tensor.grad, layout.shard(reference.grad, comm.rank, axis=2))
    comm.barrier()
    print(f"rank {comm.rank}: ulysses attention ok, {nbytes.forward} + {nbytes.backward} bytes "
          "sent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
