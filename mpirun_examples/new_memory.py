"""What the first calls on newly allocated arrays cost, call by call, against the same arrays later.

    mpirun -bind-to core -n 2 python mpirun_examples/new_memory.py            # 1 MiB and 6 MiB
    mpirun -bind-to core -n 2 python mpirun_examples/new_memory.py --kib 256 --json

For each size, several times over: two new float32 arrays (input and output), then 12 calls of
ring.py's all-reduce on them between the two ranks, and the same with MPI's Allreduce, each call
timed on its own (slowest rank, ranks starting together). Printed: each call's time over the
median of calls 9-12 (the arrays' steady time), the median over the repetitions. A time kept from
the second call on new arrays is not the time of a training step's buckets, which are old
arrays; minimp/measure/calibrate.py runs FRESH_MEMORY_WARMUPS calls before it times.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from minimp import distributed as dist
from minimp.distributed.ring import ring_allreduce_into

CALLS = 12
STEADY = slice(8, 12)  # calls 9-12


def call_times(world, comm, nbytes, algorithm):
    """Seconds of each of CALLS calls on two arrays allocated just before, slowest rank."""
    x, out = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    seconds = []
    for _ in range(CALLS):
        world.Barrier()
        start = time.perf_counter()
        if algorithm == "mpi":
            world.Allreduce(x, out, op=MPI.SUM)
        else:
            ring_allreduce_into(comm, x, out)
        seconds.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, nargs="+", default=[1024, 6144], help="array sizes")
    parser.add_argument("--trials", type=int, default=5, help="new arrays per size")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    if world.size != 2 or args.trials < 1 or not all(1 <= kib <= 2**20 for kib in args.kib):
        if world.rank == 0:
            message = "run it on 2 ranks (mpirun -n 2) with --trials >= 1, 1 <= --kib <= 1048576"
            print(f"new_memory: {message}", file=sys.stderr)
        return 2
    comm = dist.world()
    report = {}
    for kib in args.kib:
        for algorithm in ("ring", "mpi"):
            ratios = []
            for _ in range(args.trials):
                seconds = np.array(call_times(world, comm, kib * 1024, algorithm))
                ratios.append(seconds / np.median(seconds[STEADY]))
            report[f"{algorithm} {kib} KiB"] = np.median(ratios, axis=0).round(3).tolist()
    if world.rank == 0:
        if args.json:
            print(json.dumps({"calls_over_steady": report}))
        else:
            print(f"each call's time / the median of calls 9-12, median of {args.trials} trials")
            for name, ratios in report.items():
                print(f"{name:>16}: " + " ".join(f"{r:5.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
