"""Run under mpirun by tests/test_distributed_alltoall_mpi.py: minimp's all-to-all against
mpi4py's (pickled) alltoall of the same chunks, its bytes against the formula, past MPICH's eager
limit, AllToAll's backward, and a disagreement reported in one line on every rank."""

import sys

import ml_dtypes
import numpy as np
from mpi4py import MPI

from minimp import Tensor
from minimp import distributed as dist


def main():
    comm = dist.world()
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(r)
    checked = 0
    for dtype in (np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.int64):
        for most in (0, 3, 70_000):  # 70,000 rows of 3 float32: 840 kB, past the eager limit
            counts = [int(n) for n in rng.integers(0, most + 1, p)]
            bits = rng.integers(0, 256, sum(counts) * 3 * np.dtype(dtype).itemsize, np.uint8)
            x = bits.view(dtype).reshape(-1, 3)
            chunks = np.split(x, np.cumsum(counts)[:-1])
            before = comm.bytes_sent
            received = dist.all_to_all(comm, chunks)
            sent = comm.bytes_sent - before
            reference = MPI.COMM_WORLD.alltoall(chunks)  # pickled: the obvious gather
            assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() and a.shape == b.shape
                       for a, b in zip(received, reference)), (dtype, most)
            row_bytes = 3 * np.dtype(dtype).itemsize
            assert sent == dist.all_to_all_bytes(counts, row_bytes, r, counts_exchanged=True)
            checked += 1
    x = Tensor(rng.standard_normal((2 * p, 4)).astype(np.float32), requires_grad=True)
    y = dist.AllToAll.apply(x, comm=comm)
    y.backward(y.data * 2)  # every row goes back where it came from, doubled
    assert np.array_equal(x.grad, x.data * 2)
    try:
        dist.all_to_all(comm, [np.zeros((2, 3 if r else 4), np.float32)] * p)
    except dist.CollectiveMismatchError as error:
        print(f"rank {r}: {error}", flush=True)
    print(f"rank {r}: {checked} all-to-alls agree with mpi4py's alltoall", flush=True)


if __name__ == "__main__":
    sys.exit(dist.run_or_abort(main))
