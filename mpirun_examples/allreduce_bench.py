"""Benchmark: minimp's all-reduce algorithms against MPI.Allreduce, same buffers, same run.

    mpirun -n 4 python mpirun_examples/allreduce_bench.py            # table, 4 KiB .. 64 MiB
    mpirun -n 2 python mpirun_examples/allreduce_bench.py --json     # one JSON object for machines
    mpirun -n 4 python mpirun_examples/allreduce_bench.py --max-mib 4 --repeats 5
    mpirun -n 2 python mpirun_examples/allreduce_bench.py --device gpu --json   # CuPy, NCCL

Each time is the slowest rank's, median of --repeats runs after a warm-up. It also fits the cost
model's alpha and beta from timed Sendrecv steps and gamma from timed reductions on this machine,
then prints the model's ring prediction beside the measured ring time.
"""

import argparse
import json
import statistics
import sys

import numpy as np
from mpi4py import MPI

from minimp import backend, costmodel
from minimp import distributed as dist
from minimp.distributed.buffers import reduce_into

ALGORITHMS = ("ring", "naive", "recursive_doubling", "auto")


def timed(comm, function, repeats):
    """Median over repeats of the slowest rank's seconds for function()."""
    function()
    samples = []
    for _ in range(repeats):
        MPI.COMM_WORLD.Barrier()
        start = MPI.Wtime()
        function()
        elapsed = MPI.Wtime() - start
        samples.append(comm.allreduce_scalars([elapsed], op="max")[0])
    return statistics.median(samples)


def fit_network(comm, sizes, repeats):
    """alpha and beta from ring-neighbour Sendrecv steps, gamma from in-place float32
    reductions, both timed at the chunk sizes (bytes / p) that the ring all-reduce moves
    for the benchmark's sizes."""
    chunks = sorted({max(nbytes // comm.size // 4 * 4, 4) for nbytes in sizes})
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    message_seconds, reduce_seconds = [], []
    for nbytes in chunks:
        outgoing, incoming = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        message_seconds.append(
            timed(comm, lambda: comm.sendrecv(outgoing, right, incoming, left), repeats)
        )
        reduce_seconds.append(timed(comm, lambda: reduce_into(incoming, outgoing, "sum"), repeats))
    alpha, beta = costmodel.fit_alpha_beta(chunks, message_seconds)
    reduce_overhead, gamma = costmodel.fit_alpha_beta(chunks, reduce_seconds)
    # The ring reduces in half of its 2(p - 1) steps: that fixed cost joins the per-message latency.
    return costmodel.Network(
        alpha=alpha + reduce_overhead / 2, beta=beta, gamma=gamma, name="fitted in this run"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description="minimp all-reduce vs MPI.Allreduce")
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    args = parser.parse_args(argv)
    comm = dist.world()
    p = comm.size
    if args.device == "gpu":
        return gpu_main(comm, args)
    sizes, nbytes = [], args.min_kib * 1024
    while nbytes <= args.max_mib * 2**20:
        sizes.append(nbytes)
        nbytes *= 4
    network = fit_network(comm, sizes, args.repeats) if p > 1 else costmodel.THIS_MACHINE
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).uniform(-1, 1, nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        repeats = max(3, args.repeats if nbytes <= 2**22 else args.repeats // 2)
        row = {
            "bytes": nbytes,
            "mpi": timed(comm, lambda: MPI.COMM_WORLD.Allreduce(x, out, op=MPI.SUM), repeats),
        }
        for algorithm in ALGORITHMS:  # the same reused output buffer that MPI gets
            row[algorithm] = timed(
                comm, lambda: dist.allreduce(comm, x, algorithm=algorithm, out=out), repeats
            )
        row["auto_choice"] = dist.choose_algorithm(nbytes, p)
        row["ring_predicted"] = costmodel.ring_allreduce_time(nbytes, p, network)
        row["ring_predicted_default"] = costmodel.ring_allreduce_time(
            nbytes, p, costmodel.THIS_MACHINE
        )
        rows.append(row)
    if comm.rank != 0:
        return 0
    report = {"ranks": p, "network": vars(network), "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"all-reduce of float32 on {p} ranks (slowest rank, median); "
        "times in ms; ratio = time / MPI's"
    )
    print(
        f"fitted: alpha {network.alpha * 1e6:.1f} us, "
        f"1/beta {1 / max(network.beta, 1e-30) / 1e9:.2f} GB/s, "
        f"1/gamma {1 / max(network.gamma, 1e-30) / 1e9:.2f} GB/s"
    )
    header = f"{'size':>9} {'MPI':>8}" + "".join(f" {a:>19}" for a in ALGORITHMS)
    print(header + f" {'busbw ring':>11} {'model/ring':>10}")
    for row in rows:
        size = (
            f"{row['bytes'] // 1024} KiB"
            if row["bytes"] < 2**20
            else f"{row['bytes'] // 2**20} MiB"
        )
        cells = "".join(f" {row[a] * 1e3:8.3f} ({row[a] / row['mpi']:5.2f}x)" for a in ALGORITHMS)
        busbw = (
            costmodel.bus_bandwidth(row["bytes"], row["ring"], p) / 1e9 if p > 1 else float("nan")
        )
        print(
            f"{size:>9} {row['mpi'] * 1e3:8.3f}{cells} {busbw:8.2f} GB/s "
            f"{row['ring_predicted'] / row['ring']:9.2f}  auto={row['auto_choice']}"
        )
    return 0


def nccl_allreduce(comm):
    """A function running NCCL's all-reduce on CuPy float32 arrays, or the reason there is none
    (no NCCL in this CuPy; or NCCL refusing several ranks on one GPU, which it does)."""
    try:
        import cupy
        from cupy.cuda import nccl

        if not nccl.available:
            return None, "this CuPy has no NCCL"
        ranks_here = comm.node_rank_and_size()[1]
        if ranks_here > cupy.cuda.runtime.getDeviceCount():
            # NCCL needs a GPU of its own for every rank of a communicator; asked to share one, it
            # fails or waits in its bootstrap, so it is not asked.
            return None, (
                f"NCCL needs one GPU per rank: {ranks_here} ranks share "
                f"{cupy.cuda.runtime.getDeviceCount()} GPU(s) here"
            )
        unique_id = np.zeros(128, np.int8)
        if comm.rank == 0:
            unique_id[:] = np.array(nccl.get_unique_id(), np.int8)
        comm.bcast(unique_id, root=0)
        communicator = nccl.NcclCommunicator(comm.size, tuple(int(v) for v in unique_id), comm.rank)
    except Exception as error:  # NCCL's own error types; the benchmark reports them
        return None, f"{type(error).__name__}: {error}"

    def run(x, out):
        stream = cupy.cuda.get_current_stream()
        communicator.allReduce(
            x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr
        )
        stream.synchronize()

    return run, None


def gpu_main(comm, args):
    """The ring on device arrays (staged through the host unless MPI is CUDA-aware) against MPI's
    Allreduce on host copies and, where NCCL takes these ranks, against NCCL."""
    import cupy

    backend.use_device("gpu", comm.node_rank_and_size()[0])
    nccl_run, nccl_problem = nccl_allreduce(comm) if comm.size > 1 else (None, "one rank")
    rows, nbytes = [], args.min_kib * 1024
    while nbytes <= args.max_mib * 2**20:
        x = cupy.random.default_rng(comm.rank).random(nbytes // 4, dtype=cupy.float32)
        out, host = cupy.empty_like(x), np.empty(nbytes // 4, np.float32)

        def mpi_host_staged():
            MPI.COMM_WORLD.Allreduce(x.get(), host, op=MPI.SUM)
            out.set(host)

        row = {
            "bytes": nbytes,
            "mpi_host_staged": timed(comm, mpi_host_staged, args.repeats),
            "ring": timed(comm, lambda: dist.ring_allreduce(comm, x, out=out), args.repeats),
        }
        if nccl_run is not None:
            row["nccl"] = timed(comm, lambda: nccl_run(x, out), args.repeats)
        rows.append(row)
        if comm.rank == 0:
            print(f"allreduce_bench: {nbytes} bytes done", file=sys.stderr, flush=True)
        nbytes *= 4
    if comm.rank == 0:
        report = {
            "ranks": comm.size,
            "device": "gpu",
            "cuda_aware_mpi": dist.mpi.mpi_is_cuda_aware(),
            "nccl": "used" if nccl_run else nccl_problem,
            "rows": rows,
        }
        print(json.dumps(report) if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(dist.run_or_abort(main))
