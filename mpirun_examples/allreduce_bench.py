"""Benchmark: minimp's all-reduce algorithms against MPI.Allreduce, same buffers, same run.

    mpirun -n 4 python mpirun_examples/allreduce_bench.py            # table, 4 KiB .. 64 MiB
    mpirun -n 2 python mpirun_examples/allreduce_bench.py --json     # one JSON object for machines
    mpirun -n 4 python mpirun_examples/allreduce_bench.py --max-mib 4
    mpirun -n 2 python mpirun_examples/allreduce_bench.py --max-mib 1 --no-calibration
    mpirun -n 2 python mpirun_examples/allreduce_bench.py --device gpu --json   # CuPy, NCCL

It measures the machine model's terms (minimp/measure/machinemodel.py) at sizes of 3 x 2^k bytes,
then every size, in --rounds rounds (10), each with a share of the repetitions (at least 50 calls in
all up to 1 MiB, 3 per round); then it prints the model's prediction of each algorithm beside its
measured time: every size measured here is a power of two, one the fit never saw (held out). Each
time is the slowest rank's: in a round, the median of its calls after a warm-up; reported, the mean
of the rounds' medians. Why rounds and a mean: this machine runs some stretches of a launch 1.3-1.7x
slower than others, for seconds at a time; timing the terms first and the sizes after, a model
fitted in a slow stretch was checked against a fast one. Rounds spread the terms and the sizes over
the same stretches; the model adds terms, and the mean of a sum is the sum of the means (the median
of a sum is not the sum of the medians). With --shipped the prediction is that of the model minimp
ships for this many ranks (minimp.measure.machinemodel.SHIPPED, the one FastestPredicted() chooses
by) instead of the one fitted in this run; --no-calibration skips the terms. "auto" is the
transport's own rule (distributed.choose_algorithm) in the checked call (recursive doubling,
below 512 KiB, carries the ranks' check in its messages; the ring agrees first), "planned" is
auto again as a PersistentAllreduce (the ranks agree once, not at every call). Where a small
call's time goes: mpirun_examples/allreduce_breakdown.py.
"""

import argparse
import json
import sys

import numpy as np
from mpi4py import MPI

from minimp import backend
from minimp.measure import costmodel
from minimp import distributed as dist
from minimp.measure.calibrate import (
    FRESH_MEMORY_WARMUPS,
    calibration_sizes,
    fit_model,
    measure_terms,
    join_rounds,
    per_round,
    repeats_for,
    timed,
)
from minimp.measure.machinemodel import ALGORITHMS as MODELLED
from minimp.measure.machinemodel import Line, relative_errors, shipped_model

ALGORITHMS = ("ring", "naive", "recursive_doubling", "auto")


def sizes_from(min_kib, max_mib):
    """4 KiB, 8 KiB, ... up to max_mib: every power of two between."""
    sizes, nbytes = [], min_kib * 1024
    while nbytes <= max_mib * 2**20:
        sizes.append(nbytes)
        nbytes *= 2
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description="minimp all-reduce vs MPI.Allreduce")
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--shipped", action="store_true", help="predict with the shipped model, not this run's fit"
    )
    parser.add_argument(
        "--no-calibration",
        action="store_true",
        help="measure no terms first (implies --shipped): the all-reduces on a fresh process",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--repeats", type=int, default=5, help="repetitions per size (GPU)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="rounds, each timing the terms and then every size with a share of the repetitions",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    comm = dist.world()
    if args.device == "gpu":
        return gpu_main(comm, args)
    sizes, p = sizes_from(args.min_kib, args.max_mib), comm.size
    terms_sizes = calibration_sizes(sizes[0] // p, sizes[-1])
    calibrated, measured = [], []
    for _ in range(args.rounds):  # a machine that drifts drifts under the terms and the sizes alike
        if not args.no_calibration:
            calibrated.append(measure_terms(comm, terms_sizes, args.rounds))
        measured.append([measure_size(comm, nbytes, args.rounds) for nbytes in sizes])
    rows = join_rounds(measured)
    terms = join_rounds(calibrated) if calibrated else None
    model = shipped_model(p) if terms is None or args.shipped else fit_model(p, terms)
    if comm.rank != 0:
        return 0
    for row in rows:
        row["predicted"] = {a: model.allreduce_time(a, row["bytes"]) for a in MODELLED}
    errors = {a: held_out_errors(model, rows, a) for a in MODELLED}
    report = {"ranks": p, "model": model.as_dict(), "terms": terms, "held_out": errors}
    report["rows"] = rows
    report["rounds"] = {"terms": calibrated, "rows": measured}  # each round's own medians
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


def measure_size(comm, nbytes, rounds=1):
    """MPI's Allreduce and each of minimp's algorithms on the same buffers, slowest rank (one of
    `rounds` rounds: a share of the repetitions)."""
    x = np.random.default_rng(comm.rank).uniform(-1, 1, nbytes // 4).astype(np.float32)
    out = np.empty_like(x)
    repeats = per_round(repeats_for(nbytes), rounds)
    row = {"bytes": nbytes, "repeats": repeats * rounds}
    mpi = lambda: MPI.COMM_WORLD.Allreduce(x, out, op=MPI.SUM)  # noqa: E731
    row["mpi"] = timed(comm, mpi, repeats, FRESH_MEMORY_WARMUPS)  # x and out: new memory
    for algorithm in ALGORITHMS:  # the same reused output buffer that MPI gets
        run = lambda: dist.allreduce(comm, x, algorithm=algorithm, out=out)  # noqa: E731
        row[algorithm] = timed(comm, run, repeats)
    # auto again, planned once (agreement and choice at construction) as DataParallel's buckets run
    planned = dist.PersistentAllreduce(comm, x.shape, x.dtype)
    row["planned"] = timed(comm, lambda: planned(x, out=out), repeats)
    row["auto_choice"] = dist.choose_algorithm(nbytes, comm.size)
    return row


def best_own(row):
    """The fastest of minimp's own algorithms at this size, measured (what auto should pick)."""
    return min(row[a] for a in ALGORITHMS if a != "auto")


def held_out_errors(model, rows, algorithm):
    """model/measured - 1 of one algorithm on the benchmark's sizes (none of which the fit saw)."""
    sizes, measured = [r["bytes"] for r in rows], [r[algorithm] for r in rows]
    found = relative_errors(model, sizes, measured, algorithm)
    return {"median": found["median"], "worst": found["worst"]}


def print_table(report):
    p, model = report["ranks"], report["model"]
    print(f"all-reduce of float32 on {p} ranks (slowest rank; the mean of the rounds' medians); "
          "ratio = time / MPI's")  # fmt: skip
    python = {name: Line.from_dict(line)(p) for name, line in model["python"].items()}
    print(f"model: {model['name']}; agree {model['agree'] * 1e6:.1f} us; Python " + ", ".join(
        f"{name} {seconds * 1e6:.1f} us" for name, seconds in python.items()
    ))  # fmt: skip
    for term in ("message", "reduce"):
        pieces = Line.from_dict(model[term]).pieces()
        print(f"{term}: " + "; ".join(
            f"{line.intercept * 1e6:.1f} us + n / {1 / max(line.slope, 1e-30) / 1e9:.2f} GB/s"
            + (f" up to {line.limit:.0f} B" if line.above else "") for line in pieces
        ))  # fmt: skip
    if model.get("ring_step") is not None:  # straight lines between its measured sizes
        step = Line.from_dict(model["ring_step"])
        chunks = [line.limit for line in step.pieces()[:-1]]
        print(f"ring_step: {len(chunks)} sizes, {step(chunks[0]) * 1e6:.1f} us at "
              f"{chunks[0]:.0f} B .. {step(chunks[-1]) * 1e6:.0f} us at {chunks[-1] / 2**20:g} MiB,"
              f" joined by straight lines")  # fmt: skip
    shown = ALGORITHMS + ("planned",)
    header = f"{'size':>9} {'MPI':>8}" + "".join(f" {a:>19}" for a in shown)
    print(header + f" {'busbw ring':>11}   model/measured: " + " ".join(MODELLED))
    for row in report["rows"]:
        nbytes = row["bytes"]
        size = f"{nbytes // 1024} KiB" if nbytes < 2**20 else f"{nbytes // 2**20} MiB"
        cells = "".join(f" {row[a] * 1e3:8.3f} ({row[a] / row['mpi']:5.2f}x)" for a in shown)
        busbw = costmodel.bus_bandwidth(nbytes, row["ring"], p) / 1e9 if p > 1 else float("nan")
        ratios = " ".join(f"{row['predicted'][a] / row[a]:5.2f}" for a in MODELLED)
        print(
            f"{size:>9} {row['mpi'] * 1e3:8.3f}{cells} {busbw:8.2f} GB/s   {ratios}"
            f"  auto={row['auto_choice']} ({row['auto'] / best_own(row):.2f}x the best of ours)"
        )
    for algorithm, errors in report["held_out"].items():
        print(
            f"model vs measured {algorithm} (held-out sizes): median |error| "
            f"{errors['median']:.1%}, worst {errors['worst']:.1%}"
        )


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
