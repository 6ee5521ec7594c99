"""One idea: the ring all-reduce, run on real MPI ranks, with every message it sends printed.

    mpirun -n 4 python mpirun_examples/ring_allreduce.py
    python mpirun_examples/ring_allreduce.py --simulate 4     # the same function, in-process

Each rank starts with [rank, rank, ..., rank] (p * 2 elements);
all end with the sum 0 + 1 + ... + p-1.
"""

import argparse

import numpy as np

from minimp import distributed as dist


def show_ring(comm):
    x = np.full(comm.size * 2, float(comm.rank), np.float32)
    result = dist.ring_allreduce(comm, x)
    return (
        f"rank {comm.rank}: {x.tolist()} -> {result.tolist()} ({comm.messages_sent} messages, "
        f"{comm.bytes_sent} bytes sent)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--simulate", type=int, default=0, help="run on this many simulated ranks instead"
    )
    args = parser.parse_args()
    if args.simulate:
        results = dist.simulate(args.simulate, show_ring)
        print("\n".join(results))
        for message in results.trace:
            print(
                f"  step {message.step}: rank {message.source} -> rank {message.dest}, "
                f"{message.nbytes} bytes"
            )
        return
    comm = dist.world()
    line = show_ring(comm)
    for rank in range(comm.size):  # print in rank order
        if rank == comm.rank:
            print(line, flush=True)
        comm.barrier()


if __name__ == "__main__":
    dist.run_or_abort(main)
