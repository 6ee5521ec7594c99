"""Run under mpirun: rank 1 raises while the rest wait in a collective; the job must end at once."""

import numpy as np

from minimp import distributed as dist


def main():
    comm = dist.world()
    if comm.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    dist.ring_allreduce(comm, np.ones(10, np.float32))  # would wait forever for rank 1


if __name__ == "__main__":
    dist.run_or_abort(main)
