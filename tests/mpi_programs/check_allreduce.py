"""Run under mpirun by tests/test_distributed_mpi.py:
every algorithm against MPI.Allreduce on the same buffers."""

import hashlib
import sys

import ml_dtypes
import numpy as np
from mpi4py import MPI

from minimp import distributed as dist


def main():
    comm = dist.world()
    rng = np.random.default_rng(comm.rank)
    checked = 0
    for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        for length in (0, 1, 3, 17, 1000, 100_003):  # 100,003 float32 pass MPICH's eager limit
            x = rng.uniform(-1, 1, length).astype(dtype)
            exact = np.empty(length, np.float64)
            MPI.COMM_WORLD.Allreduce(x.astype(np.float64), exact, op=MPI.SUM)
            for algorithm in ("ring", "naive", "recursive_doubling", "auto"):
                result = dist.allreduce(comm, x, algorithm=algorithm)
                digests = MPI.COMM_WORLD.allgather(hashlib.sha1(result.tobytes()).hexdigest())
                assert len(set(digests)) == 1, f"{algorithm} {dtype} {length}: replicas differ"
                unit = {np.float16: 2.0**-11, ml_dtypes.bfloat16: 2.0**-8}.get(dtype, 2.0**-23)
                error = np.abs(result.astype(np.float64) - exact)
                assert np.all(error <= comm.size * unit * comm.size + 1e-12), (
                    algorithm,
                    dtype,
                    length,
                )
                if dtype in (np.float32, np.float64):
                    reference = np.empty_like(x)
                    MPI.COMM_WORLD.Allreduce(x, reference, op=MPI.SUM)
                    np.testing.assert_allclose(
                        result, reference, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6
                    )
                checked += 1
    print(f"rank {comm.rank}: {checked} all-reduces agree with MPI.Allreduce", flush=True)


if __name__ == "__main__":
    sys.exit(dist.run_or_abort(main))
