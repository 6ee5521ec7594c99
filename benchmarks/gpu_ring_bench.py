"""Benchmark: the ring all-reduce of GPU arrays staged once per collective, against MPI on host.

    mpirun -n 2 python benchmarks/gpu_ring_bench.py [--max-mib 64] [--repeats 5] [--json]

Three ways to all-reduce a float32 CuPy array over the ranks, timed side by side in this run
(median of the repeats, the slowest rank's):
  staged ring     minimp's ring_allreduce: one pinned host copy each way per collective when MPI
                  is not CUDA-aware (minimp/distributed/staging.py)
  per-message     the same ring's two halves handed the device arrays, so every Sendrecv copies
                  to and from the host (the path before staging)
  MPI host copies x.get(), MPI_Allreduce on the host, out.set(): the baseline
All ranks share one GPU when the machine has one (NCCL would need a GPU per rank). Exits with
status 2 and one line, before any work, when CuPy or a GPU is missing.
"""

import argparse
import json
import statistics
import sys
import time

from minimp import backend
from minimp import distributed as dist
from minimp.checkpoints.errors import ConfigError
from minimp.checkpoints.files import atomic_write, check_output
from minimp.distributed.ring import chunk_bounds, ring_all_gather_inplace, ring_reduce_scatter_into


def timed(comm, function, repeats):
    """Median seconds of function over repeats (synchronised), the slowest rank's."""
    function()  # warm-up: kernels compiled, pinned pool filled
    samples = []
    for _ in range(repeats):
        comm.barrier()
        began = time.perf_counter()
        function()
        backend.synchronize()
        samples.append(time.perf_counter() - began)
    return float(comm.allreduce_scalars([statistics.median(samples)], op="max")[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object, nothing else")
    parser.add_argument("--save", metavar="PATH", help="also write the JSON object to PATH")
    args = parser.parse_args(argv)
    try:  # before any work: the file can be written and replaces no other kind
        if args.save:
            check_output("--save", args.save, "json", force=None)
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    comm = dist.world()
    try:
        backend.use_device("gpu", comm.node_rank_and_size()[0])
    except backend.DeviceError as error:
        if comm.rank == 0:
            print(f"gpu_ring_bench: {error}", file=sys.stderr)
        return 2
    import cupy
    from mpi4py import MPI  # the baseline only; minimp's own messages go through its communicator

    rows, nbytes = [], args.min_kib * 1024
    while nbytes <= args.max_mib * 2**20:
        x = cupy.random.default_rng(comm.rank).random(nbytes // 4, dtype=cupy.float32)
        out, host_in, host_out = cupy.empty_like(x), x.get(), x.get()
        bounds = chunk_bounds(x.size, comm.size)

        def per_message():
            ring_reduce_scatter_into(comm, x, out, bounds)
            ring_all_gather_inplace(comm, out, bounds)

        def mpi_host_copies():
            x.get(out=host_in)
            MPI.COMM_WORLD.Allreduce(host_in, host_out, op=MPI.SUM)
            out.set(host_out)

        row = {
            "bytes": nbytes,
            "staged_ring": timed(comm, lambda: dist.ring_allreduce(comm, x, out=out), args.repeats),
            "per_message_ring": timed(comm, per_message, args.repeats),
            "mpi_host_copies": timed(comm, mpi_host_copies, args.repeats),
        }
        row["staged_over_mpi"] = row["staged_ring"] / row["mpi_host_copies"]
        row["per_message_over_mpi"] = row["per_message_ring"] / row["mpi_host_copies"]
        rows.append(row)
        nbytes *= 4
    if comm.rank == 0:
        staged = getattr(comm, "stages_device_arrays", False)
        report = {"ranks": comm.size, "staged_through_host": staged, "rows": rows}
        if args.save:
            text = json.dumps(report)
            atomic_write(args.save, lambda file: file.write(text.encode()))
        if args.json:
            print(json.dumps(report))
        else:
            print(f"ring all-reduce of float32 CuPy arrays, {comm.size} ranks (ms, /MPI)")
            for r in rows:
                print(f"  {r['bytes']:>9} B: staged {r['staged_ring'] * 1e3:8.3f} "
                      f"({r['staged_over_mpi']:.2f}x), per-message "
                      f"{r['per_message_ring'] * 1e3:8.3f} ({r['per_message_over_mpi']:.2f}x), "
                      f"MPI on host copies {r['mpi_host_copies'] * 1e3:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(dist.run_or_abort(main))
