"""Where the checked all-reduce's time goes at a small size: each piece of one call timed alone.

    mpirun -bind-to core -n 2 python mpirun_examples/allreduce_breakdown.py           # 4 KiB
    mpirun -bind-to core -n 2 python mpirun_examples/allreduce_breakdown.py --kib 64 --json

`distributed.allreduce(comm, x, algorithm="auto", out=out)` on float32 (recursive doubling below
512 KiB), beside MPI's Allreduce and two other ways to all-reduce the same buffers:

  checked call      allreduce as it is: the check carried in the messages' headers (headers.py)
  agree, then send  the call as it was: an agreement all-reduce first (now with the op too), then
                    the bare messages
  planned           a PersistentAllreduce, agreed once at construction

and the pieces the checked call is made of, each timed alone on the same arrays:

  python checks     the op checked, the algorithm chosen, the output and input as flat arrays
  buffers kept      the buffers for header and payload looked up on the communicator
  headed message    one exchange of header and array with the partner, the header compared
                    (up to 32 KiB the array is copied behind its header, one message; above,
                    the array follows the header in a second message)
  addition          the partner's array added to this rank's (reduce_into)

and the pieces of the call as it was that the checked call no longer has:

  agreement         the ranks agree on length, dtype and op: one MPI all-reduce of six scalars
  scratch           a fresh receive buffer (numpy.empty_like)
  message           one exchange of the bare array (the communicator's sendrecv)

At p = 2 recursive doubling is one exchange and one addition, so a call's pieces add up to about
the call. Every figure is the slowest rank's median microseconds over --rounds rounds of --calls
calls (each call timed alone), the pieces interleaved round by round so that a slow stretch of
the machine falls on all of them alike.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from minimp import distributed as dist
from minimp.distributed.buffers import agree_on_layout, checked_allreduce, contiguous_flat
from minimp.distributed.buffers import output_buffer, reduce_into
from minimp.distributed.collectives import recursive_doubling_into, resolve_algorithm
from minimp.distributed.headers import headed_buffers
from minimp.distributed.protocol import Tag, check_op


def pieces(comm, x, out):
    """{name: a function running that piece once}, for this rank's x and out."""
    world, partner = MPI.COMM_WORLD, comm.rank ^ 1
    incoming = x.copy()  # the partner's array once a message has come; numbers before
    kept = headed_buffers(comm, x, "sum")
    planned = dist.PersistentAllreduce(comm, x.shape, x.dtype)

    def python_checks():
        check_op("sum")
        resolve_algorithm("auto", x.size * x.dtype.itemsize, comm.size)
        output_buffer(x, out)
        contiguous_flat(x)

    return {
        "MPI Allreduce": lambda: world.Allreduce(x, out, op=MPI.SUM),
        "checked call": lambda: dist.allreduce(comm, x, algorithm="auto", out=out),
        "agree, then send": lambda: checked_allreduce(recursive_doubling_into, "breakdown", comm,
                                                      x, "sum", out),
        "planned": lambda: planned(x, out=out),
        "python checks": python_checks,
        "buffers kept": lambda: headed_buffers(comm, x, "sum"),
        "headed message": lambda: kept.exchange(comm, x, partner, Tag.DOUBLING_EXCHANGE),
        "addition": lambda: reduce_into(out, incoming, "sum", first=x),
        "agreement": lambda: agree_on_layout(comm, x.size, x.dtype, "breakdown", "sum"),
        "scratch": lambda: np.empty_like(x),
        "message": lambda: comm.sendrecv(x, partner, incoming, partner,
                                         tag=Tag.DOUBLING_EXCHANGE),
    }


def slowest_medians(functions, rounds, calls):
    """{name: the slowest rank's median seconds per call}, pieces interleaved round by round."""
    world = MPI.COMM_WORLD
    samples = {name: [] for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            world.Barrier()
            for _ in range(10):  # warm: caches, MPI's first-message paths
                function()
            world.Barrier()
            for _ in range(calls):
                start = time.perf_counter()
                function()
                samples[name].append(time.perf_counter() - start)
    medians = {name: float(np.median(times)) for name, times in samples.items()}
    return {name: world.allreduce(seconds, op=MPI.MAX) for name, seconds in medians.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=4, help="the array's size (float32)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per piece and round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    comm = dist.world()
    if comm.size != 2 or args.kib < 1 or args.rounds < 1 or args.calls < 1:
        if comm.rank == 0:
            print("allreduce_breakdown: run it on 2 ranks (mpirun -n 2) with --kib, --rounds "
                  "and --calls at least 1", file=sys.stderr)
        return 2
    x = np.random.default_rng(comm.rank).uniform(-1, 1, args.kib * 256).astype(np.float32)
    out = np.empty_like(x)
    seconds = slowest_medians(pieces(comm, x, out), args.rounds, args.calls)
    if comm.rank != 0:
        return 0
    micro = {name: value * 1e6 for name, value in seconds.items()}
    if args.json:
        print(json.dumps({"kib": args.kib, "ranks": comm.size, "microseconds": micro}))
        return 0
    mpi = micro["MPI Allreduce"]
    print(f"{args.kib} KiB float32, 2 ranks: slowest rank's median us per call "
          f"({args.rounds} rounds x {args.calls} calls)")
    for name, value in micro.items():
        print(f"{name:>16} {value:8.2f} us  {value / mpi:5.2f}x MPI's")
    return 0


if __name__ == "__main__":
    sys.exit(dist.run_or_abort(main))
