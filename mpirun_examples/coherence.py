"""What a message of freshly written bytes costs: the two cores' cache-coherence traffic, measured.

    mpirun -bind-to core -n 2 python mpirun_examples/coherence.py            # 512 KiB
    mpirun -bind-to core -n 2 python mpirun_examples/coherence.py --kib 64 --json

Two ranks exchange float32 chunks four ways, each the median of many runs, slowest rank:

  unchanged       Sendrecv of the same bytes again and again (what a benchmark that never rewrites
                  its buffer times: the other core may still hold them)
  add             an add into a chunk nobody else reads
  add then send   an add into a chunk, then that chunk sent; the partner read it the time before,
                  as in a ring all-reduce's steps (the partial sum it sends was written just now)
  ring step       receive, add into what was received, send it on (the ring's reduce-scatter)

On this project's machine, whose two cores come from a virtual machine's host, "add then send"
costs about what "add" plus "unchanged" cost in some stretches of time and several times more in
others, while "unchanged" stays put: the regime docs/benchmarks.md's all-reduce benchmark describes.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI


def timed(function, repeats=60):
    """Median seconds of function() over repeats, slowest rank, ranks starting together."""
    world = MPI.COMM_WORLD
    function()
    samples = []
    for _ in range(repeats):
        world.Barrier()
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return world.allreduce(float(np.median(samples)), op=MPI.MAX)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=512, help="chunk size")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    if world.size != 2 or not 1 <= args.kib <= 2**20:
        if world.rank == 0:
            message = "run it on 2 ranks (mpirun -n 2) with 1 <= --kib <= 1048576 (1 GiB)"
            print(f"coherence: {message}", file=sys.stderr)
        return 2
    partner = world.rank ^ 1
    n = args.kib * 1024 // 4
    a, b, ones = np.ones(n, np.float32), np.empty(n, np.float32), np.ones(n, np.float32)

    def add_then_send():
        np.add(a, ones, out=a)
        world.Sendrecv(a, partner, 0, b, partner, 0)

    def ring_step():
        world.Sendrecv(a, partner, 0, b, partner, 0)
        np.add(b, ones, out=b)
        world.Sendrecv(b, partner, 1, a, partner, 1)

    with np.errstate(over="ignore"):  # the chunks grow by one per call; only the time counts
        seconds = {
            "unchanged": timed(lambda: world.Sendrecv(a, partner, 0, b, partner, 0)),
            "add": timed(lambda: np.add(b, ones, out=b)),
            "add then send": timed(add_then_send),
            "ring step": timed(ring_step),
        }
    if world.rank == 0:
        if args.json:
            print(json.dumps({"kib": args.kib, "seconds": seconds}))
        else:
            parts = [f"{name} {value * 1e6:.0f} us" for name, value in seconds.items()]
            print(f"{args.kib} KiB: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
