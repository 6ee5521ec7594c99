"""What a run leaves behind, and how it is scored: its stages gathered onto rank 0, checkpoints (at
the end and every --save-every steps), the evaluation (test accuracy or validation loss), the
timeline and the plot.

Every function here is called by every rank of the job (the gathers are collectives); only rank 0
writes files. Checkpoints are gathered into the one-process format (the same array names whatever
the layout), so any layout resumes any other.
"""

import json
import time
from typing import TYPE_CHECKING

import numpy as np

from minimp.checkpoints import checkpoint, files
from minimp.checkpoints.errors import agree_on_error
from minimp.distributed import gather_named_arrays
from minimp.measure import trace
from minimp.parallel.tensor.checkpoint import gather_shards
from minimp.parallel.zero.optimizer import ShardedOptimizer
from minimp.parallel.zero.stages import zero_stage
from minimp.train import plot, progress

if TYPE_CHECKING:  # loop.py imports this module
    from minimp.train.loop import Run


def gather_state(run: "Run") -> dict | None:
    """Replica 0's stages send their masters, optimizer slots and fp8 scaling state to rank 0
    (replicas are identical, so replica 0 speaks for all; with ZeRO each replica first sends its
    chunks to replica 0, which stitches them whole; with --tp each stage's shards are joined on
    its tensor-parallel rank 0 first; with --ep replica 0's ep group sends its experts to
    replica 0, with ZeRO each expert group stitching its experts on that group first); None on
    every other rank."""
    topology = run.topology
    if isinstance(run.optimizer, ShardedOptimizer):
        state = run.optimizer.gather_state(run.names)  # a collective of the replicas
    elif topology.dp_rank < topology.ep:  # replica 0's ep group holds every expert between them
        state = checkpoint.state_arrays(run.names, run.share.optimizer)
    if topology.ep_group is not None and topology.dp_rank < topology.ep:
        # (with ZeRO too: each of these ranks has stitched its own experts whole)
        state = gather_named_arrays(topology.ep_group, state or {})
    if topology.dp_rank != 0 or topology.cp_rank != 0:  # context shards hold replica 0's weights
        return None
    if run.fp8 is not None:  # each stage's scaling state, as "fp8/<quantizer>/<field>"
        state.update(run.fp8.state_arrays())
    plan = run.share.plan
    if plan is not None:
        state = gather_shards(topology.tp_group, state, plan.partitions)
        if state is None:  # not tensor-parallel rank 0
            return None
    return gather_named_arrays(topology.pp_group, state)


class _Gather:
    """The default of `merged` below: gather the stages' state first."""


GATHER = _Gather()
Merged = dict | None | _Gather  # what gather_state returned on this rank, or GATHER


def save_checkpoint(run: "Run", step: int, merged: dict | None) -> None:
    """Write --save as of `step` (all ranks call this; `merged`: what gather_state returned on
    this rank)."""
    def write() -> None:  # refuses non-finite masters, says a full disk: rank 0 alone writes
        if run.comm.rank == 0:
            checkpoint.save(
                run.config.save, step=step, flags=run.resume_flags,
                optimizer=run.share.optimizer,  # the rule's (ZeRO's own wraps it)
                scaler=run.scaler, arrays=merged, schedule={"lr_decay_steps": run.lr_decay_steps})

    agree_on_error(run.comm, write)  # a file that cannot be saved ends every rank together
    run.log(f"saved checkpoint {run.config.save} after step {step}")


def finish(run: "Run") -> dict:
    """Gather every stage onto rank 0; evaluate, save the checkpoint, the timeline and the plot
    there; returns the run's summary (history, skipped count, the final score, rank 0's masters,
    the memory fields, the BLAS threads and why)."""
    config = run.config
    run.guards.stop_if_nothing_to_keep(run.history.records)  # before any save
    merged = gather_state(run)
    traces = _gather_traces(run)
    score = evaluate(run, batches=None, merged=merged)  # the whole test or validation set
    metric = run.task.final_metric
    held = run.meter.model_state(run.history.records)
    threads = {"threads": run.threads.threads, "threads_reason": run.threads.reason}
    run.history.close({metric: score, **held, **threads})
    skipped = run.history.skipped
    if config.save:
        save_checkpoint(run, config.steps, merged)
    failed = _write_reports(run, traces) if run.comm.rank == 0 else {}
    if run.history.write_error:
        failed["--metrics"] = run.history.write_error
    what, wall = metric.replace("_", " "), time.perf_counter() - run.started
    run.log(f"done: {config.steps} steps, {skipped} skipped, {what} {score:.4f}\n"
            + progress.summary(run.history, wall, run.meter.bytes_per_step, held,
                               run.share.context, config.cp_mode))
    run.comm.barrier()  # nobody leaves before the files are complete
    masters = checkpoint.strip_prefix(merged or {}, "master/")
    return {"history": run.history.records, "skipped": skipped, metric: score,
            "master_weights": masters, "failed_outputs": failed, **held, **threads}


def _gather_traces(run: "Run") -> dict | None:
    """With --timeline: every rank's trace rows and its peak of stored micro-batches, on rank 0
    (None elsewhere, and without --timeline)."""
    if run.meter.trace is None:
        return None
    rank = run.comm.rank
    mine = {f"rows{rank}": run.meter.trace.array(),
            f"peak{rank}": np.array([run.runner.peak_stored], np.int64)}
    return gather_named_arrays(run.comm, mine)


def evaluate(run: "Run", batches: int | None, merged: Merged = GATHER) -> float:
    """The task's score of the current weights (every rank calls this; every rank returns it):
    replica 0's stages send their masters to rank 0 (when the pipeline splits the model, or ZeRO
    stage 3 shards it), rank 0 loads them into its whole model and evaluates it, one all-reduce
    shares the number. `merged`: what gather_state returned on this rank, when the caller has
    gathered already. The model only borrows the gathered weights: its parameters get their own
    arrays back afterwards (the other stages' and ZeRO stage 3's stay freed, a float32 master
    stays its parameter)."""
    if isinstance(merged, _Gather):
        topology = run.topology  # does rank 0 hold every weight?
        sharded = zero_stage(run.config.zero).shards_parameters
        whole = topology.pp == 1 and topology.tp == 1 and topology.ep == 1 and not sharded
        merged = None if whole else gather_state(run)
    score = 0.0
    if run.comm.rank == 0:
        parameters = dict(run.model.named_parameters())
        own = {name: parameter.data for name, parameter in parameters.items()}
        if merged is not None:
            run.model.load_state_dict({n: merged[f"master/{n}"] for n in parameters})
            if run.fp8 is not None:  # the other stages' scales, for the layers they own
                run.fp8.load_whole_model(merged)
        score = run.task.evaluate(run.model, batches)
        for name, parameter in parameters.items():
            parameter.data = own[name]
    return float(run.comm.allreduce_scalars([score], "sum")[0])


def _write_reports(run: "Run", traces: dict | None) -> dict[str, str]:
    """Write --timeline and --plot (after the checkpoint: a report that cannot be written must
    not cost the weights); returns {flag: why} of those whose write failed, each said in a line."""
    config, history, failed = run.config, run.history, {}
    reports = [("--timeline", config.timeline, "timeline", lambda: _write_trace(run, traces)),
               ("--plot", config.plot, "plot", lambda: plot.plot_history(
                   config.plot, history.records, history.units_per_step, history.unit))]
    for flag, path, what, write in reports:
        if not path:
            continue
        try:
            write()
        except OSError as error:  # a full disk, a lost mount: the file stays as it was
            failed[flag] = error.strerror or str(error)
            run.log(f"{flag} {path}: the write failed ({failed[flag]}); nothing was written there")
            continue
        where = " (open it in https://ui.perfetto.dev)" if flag == "--timeline" else ""
        run.log(f"saved {what} {path}{where}")
    return failed


def _write_trace(run: "Run", traces: dict) -> None:
    """The Chrome trace of every rank (minimp/measure/trace.py), named by its place in the grid
    (minimp/parallel/topology.py); replica 0's shard 0 is the pipeline a reader draws."""
    config, topology = run.config, run.topology
    ranks = {rank: {"rows": traces[f"rows{rank}"],
                    "name": f"rank {rank}: {topology.describe_rank(rank)}"}
             for rank in range(run.comm.size)}
    coordinates = [topology.coordinates(rank) for rank in range(run.comm.size)]
    first = [r for r, (_, dp_rank, cp_rank, tp_rank) in enumerate(coordinates)
             if dp_rank == cp_rank == tp_rank == 0]
    other = {"schedule": config.schedule, "stages": config.pp, "replicas": run.dp,
             "tensor_parallel": config.tp, "micro_batches": config.micro_batches,
             "virtual_stages": config.virtual_stages,
             "peak_stored_micro_batches": [int(traces[f"peak{rank}"][0]) for rank in first],
             "stage_of_rank": {str(rank): place[0] for rank, place in enumerate(coordinates)},
             "replica_0_ranks": first}
    counters = trace.expert_counters(run.history.records, traces["rows0"])  # with --experts
    document = json.dumps(trace.trace_document(ranks, other, counters)).encode()
    files.atomic_write(config.timeline, lambda file: file.write(document))
