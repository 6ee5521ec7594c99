"""Run under mpirun: ranks pass different lengths; every rank must report the mismatch."""

import numpy as np

from minimp import distributed as dist


def main():
    comm = dist.world()
    try:
        dist.ring_allreduce(comm, np.ones(100 + comm.rank, np.float32))
    except dist.CollectiveMismatchError as error:
        print(f"rank {comm.rank}: {error}", flush=True)


if __name__ == "__main__":
    dist.run_or_abort(main)
