"""What a step costs this rank, for the metrics: its seconds, bytes, scalar all-reduces and memory.

The training loop calls `start` before the step, `recorder` for the runner's timings,
`straggler_barrier` after backward, `exposed` around the optimizer's step (which calls the timed
`sync`), `timed` around the collectives it makes itself, and `finish`, which returns the step's
metrics row; at the end, `model_state` gives the final row's memory fields.
Per step (every row): `bytes_sent` (every group but the scalar all-reduces), `compute_seconds`,
`communication_seconds`, `exposed_communication_seconds` and, with --straggler-barrier,
`straggler_seconds`; `bytes_by_group` (tensor_parallel, context_parallel, data_parallel, pipeline,
tied), `bytes_by_collective` (all_reduce for --zero 0, reduce_scatter and all_gather for ZeRO, tied
for the GPT's embedding across stages, pipeline for activations, tensor_parallel for --tp's
activations and partial gradients, context_parallel for --cp's attention, whose formula is
parallel/context/ring.py's ring_bytes, or ulysses.py's ulysses_bytes with --cp-mode ulysses, per
block of the stage and micro-batch, on q's (B/(dp M), H/tp, T/cp, D), the forward part twice with
--recompute: the recomputed block runs its attention's forward again in backward),
`seconds_by_collective` (ZeRO's run inside backward and the update, where `communication_seconds`
does not look), `scalar_allreduces` (calls: the overflow flags, the norm, the loss) and
`peak_activation_bytes` (the most bytes kept for backward at once, the largest over the ranks).
With --cp, measured by this rank's attention (the AttentionStats of parallel/context/models.py's
Attention calls, reset as each step starts), each per attention call (the step's total over its
calls, layers x micro-batches): `context_work`, every rank's causal blocks of the 2N-chunk grid
computed, rank by rank (gathered with the loss; layout.py's causal_work: 2N each zig-zag, 4r + 2
contiguous, 2N each for Ulysses) and `context_work_imbalance`, their max over their min (1 zig-zag
and Ulysses, 2N-1 contiguous); `attention_saved_bytes`, what this rank's attention keeps for
backward (1/N of one process's attention: ring.py's ring_memory saved, ulysses.py's
ulysses_memory); with the ring, `attention_buffer_bytes`, the most bytes its in-flight buffers held
in one call (its backward's k, v and float32 dK, dV: ring_memory's backward_buffers). In the final
row: `model_state_bytes`, one total per rank, held at the end of the last step, with
`model_state_by_kind` and `peak_model_state_bytes` beside it (minimp/parallel/zero/formulas.py has
the formulas they are checked against), and rank 0's BLAS `threads` with their `threads_reason`
(minimp/train/threads.py). After a skipped step, `overflowed_ranks` names the ranks whose own
check found the non-finite gradient. With --timeline every timed call also goes into this rank's
trace (minimp/measure/trace.py).
With --experts, per step, each over the global batch (every replica and micro-batch):
`expert_load`, the (token, choice) pairs each expert was chosen for before dropping, summed over
the blocks' mixtures (E numbers; a token counts top-k times), `expert_load_by_block` (the same,
L x E, block by block), `expert_load_imbalance`, each block's max over its mean, the worst
block's (1 when every block is balanced; a sum over the blocks would hide a block whose
overload another block's offsets), `dropped_tokens`, the (token, choice) pairs the capacity
dropped, and `aux_loss`, the load-balancing loss summed over the blocks, as a mean over the
batch's samples: what --aux-loss-coef multiplies (the row's `loss` stays the cross-entropy).
With --pp each rank counts its stage's mixtures, and the sums run over the whole job. A step's
routing counts once with --recompute: the counters skip forwards without a graph (the first of a
recomputed block, and the evaluations').
With --ep, bytes_by_group (and bytes_by_collective) has `expert_parallel`, the dispatch's and
combine's all-to-alls, equal every step to parallel/expert/dispatch.py's dispatch_bytes of this
rank's `expert_dispatches` (the training forwards of its mixtures that built a graph),
`expert_rows_sent` and `expert_rows_received` (its rows to and from the other ranks of its ep
group, forward) and, with --recompute, the `expert_forward_only_dispatches`,
`expert_forward_only_rows_sent` and `expert_forward_only_rows_received` of the forwards without a
graph; with dp/ep > 1 also `expert_data_parallel`, the expert gradients' all-reduce
(bytes_by_collective's expert_all_reduce).
"""

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from minimp.distributed.protocol import Communicator
from minimp.measure.accounts import KINDS
from minimp.measure.trace import TraceRecorder, common_origin
from minimp.models.moe import MoE
from minimp.parallel.context.models import attention_stats
from minimp.parallel.context.ring import AttentionStats
from minimp.parallel.data.data_parallel import DataParallel
from minimp.parallel.expert import ExpertParallelDispatch
from minimp.parallel.pipeline.stage import PipelineStage
from minimp.parallel.topology import Topology
from minimp.parallel.zero.data_parallel import ZeroDataParallel
from minimp.train.config import TrainConfig


class Stopwatch:
    """Seconds spent inside wrapped calls, summed (the communication time of a step's metrics);
    `listener(name, start, end)`, when set, hears of every call (the --timeline trace)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.listener: Callable[[str, float, float], None] | None = None

    def wrap(self, function: Callable, name: str = "") -> Callable:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                end = time.perf_counter()
                self.seconds += end - start
                if self.listener is not None:
                    self.listener(name or function.__name__, start, end)

        return timed


class TimedCalls:
    """Stands in for an object and adds the seconds spent in each of its method calls to a
    Stopwatch (the trainer times its GradientSync this way: that is the step's communication)."""

    def __init__(self, target: object, stopwatch: Stopwatch):
        self._target, self._stopwatch = target, stopwatch

    def __getattr__(self, name: str) -> Any:
        return self._stopwatch.wrap(getattr(self._target, name), name)


class OverflowWitness:
    """Stands in for the step's GradientSync and remembers whether this rank's own checks found a
    non-finite gradient: the flag it hands to `any_rank`, before the ranks agree (the agreed
    decision says only that some rank did)."""

    def __init__(self, sync: TimedCalls):
        self._sync, self.found = sync, False

    def any_rank(self, found_inf: bool) -> bool:
        self.found = self.found or found_inf
        return self._sync.any_rank(found_inf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sync, name)


class Meter:
    """One rank's measurements of its steps (the module's docstring)."""

    def __init__(self, config: TrainConfig, comm: Communicator, topology: Topology,
                 sync: DataParallel | ZeroDataParallel, runner: PipelineStage):
        self.config, self.comm, self.topology, self.runner = config, comm, topology, runner
        self.stopwatch = Stopwatch()
        self.plain_sync = sync
        # The GradientSync the step calls, timed: its calls are the step's communication; the
        # witness keeps this rank's own overflow flag for the line a skipped step prints.
        self.sync = OverflowWitness(TimedCalls(sync, self.stopwatch))
        # The groups whose bytes a step counts; the scalar all-reduces are counted on every
        # communicator of this rank.
        # (The gradients' group is the replicas', with --cp their context shards' too.)
        self.groups = {"data_parallel": topology.dp_cp_group, "pipeline": topology.pp_group}
        if topology.tp > 1:
            self.groups["tensor_parallel"] = topology.tp_group
        if topology.cp > 1:
            self.groups["context_parallel"] = topology.cp_group
        if topology.ep_group is not None and topology.expert_dp_group is not None:
            self.groups["expert_parallel"] = topology.ep_group
            if topology.expert_dp_group.size > 1:
                self.groups["expert_data_parallel"] = topology.expert_dp_group
        if sync.tied is not None:
            self.groups["tied"] = sync.tied.comm
        self.communicators = [comm, *self.groups.values()]
        self.in_backward_before = sync.backward_communication_seconds()
        self.trace = TraceRecorder(common_origin(comm)) if config.timeline else None
        if self.trace is not None:  # the sync's collectives go into the trace's communication lane
            self.stopwatch.listener = self._record_communication
        self.current_step, self.exposed_seconds = 0, 0.0
        self.straggler: float | None = None
        self.held: dict[str, int] | None = None  # after a step: the bytes kept until the next
        # With --cp, the counters this rank's attention adds to (reset as each step starts); a
        # stage with no block counts nothing, but every rank brings its slots to the all-reduce.
        self.attention = ((attention_stats(runner.layers) or AttentionStats())
                          if topology.cp > 1 else None)
        self.bytes_per_step: list[float] = []  # after model_state: each rank's mean bytes sent
        mixtures = [module for layer in runner.layers for module in layer.modules()
                    if isinstance(module, MoE)]
        self.experts = [module.stats for module in mixtures]
        self.dispatch = next((module.dispatch for module in mixtures
                              if isinstance(module.dispatch, ExpertParallelDispatch)), None)

    def start(self, step: int) -> None:
        """The step's clock and counters start; with --timeline all ranks start it together, so
        the stages' clocks line up."""
        if self.config.timeline:
            self.comm.barrier()
        self.current_step, self.straggler = step, None
        self.sync.found = False
        self.stopwatch.seconds = 0.0
        self.counts_before = self._counts()
        if self.attention is not None:
            self.attention.reset()
        for stats in self.experts:
            stats.reset()
        if self.dispatch is not None:
            self.dispatch.reset()
        self.step_start = time.perf_counter()

    def recorder(self) -> Callable[[str, int, float, float], None] | None:
        """With --timeline, what the runner calls for each action of the step (None without)."""
        if self.trace is None:
            return None
        trace, step = self.trace, self.current_step
        return lambda op, micro_batch, start, end: trace.record(op, step, micro_batch, start, end)

    def timed(self, function: Callable, name: str = "") -> Callable:
        """function, its seconds counted as the step's communication (a collective)."""
        return self.stopwatch.wrap(function, name)

    def straggler_barrier(self) -> None:
        """--straggler-barrier: seconds this replica waits for the slowest to end its backward:
        time overlap cannot hide, kept out of the exposed seconds."""
        if self.config.straggler_barrier:
            started = time.perf_counter()
            self.topology.dp_cp_group.barrier()
            self.straggler = time.perf_counter() - started

    @contextmanager
    def exposed(self) -> Iterator[None]:
        """Around the optimizer's step: the communication from the end of the last backward until
        the optimizer may step, which nothing overlaps; then the bytes this rank keeps until the
        next step (and the peak inside it)."""
        before = self.stopwatch.seconds
        yield
        self.exposed_seconds = self.stopwatch.seconds - before
        self.held = self.plain_sync.held()
        self.plain_sync.peak.sample(self.held)

    def overflowed_ranks(self) -> list[int]:
        """After a skipped step, on every rank: the ranks whose own check found a non-finite
        gradient. One more scalar all-reduce (a MAX over one flag per rank), taken only on a skip
        and then by every rank (all of them share the skip decision, so none waits in vain);
        counted, as the step's others, in its scalar_allreduces, and sending no counted bytes."""
        flags = np.zeros(self.comm.size)
        flags[self.comm.rank] = float(self.sync.found)
        flags = self.timed(self.comm.allreduce_scalars, "overflowed_ranks")(flags, "max")
        return [rank for rank, flag in enumerate(flags) if flag]

    def finish(self, step: int, decisions: dict[str, Any], loss_sum: float,
               fp8: dict) -> dict[str, Any]:
        """The step's metrics row: the step, the batch's mean loss, the step's `decisions` (lr,
        loss scale, skipped), every measurement above, and the fp8 statistics."""
        stats = self.attention
        calls = max(stats.calls, 1) if stats is not None else 1  # (per call)
        loss, activation_bytes, work = self._mean_loss_and_peak(
            loss_sum, stats.blocks / calls if stats is not None else 0.0)
        row = {"step": step, "loss": loss, **decisions, **self._seconds(), **self._communication(),
               "peak_activation_bytes": activation_bytes, **fp8}
        if stats is not None:
            measured = [blocks for blocks in work if blocks]  # (ranks that ran attention)
            row["context_work"] = work
            row["context_work_imbalance"] = max(measured) / min(measured) if measured else 0.0
            row["attention_saved_bytes"] = stats.saved_bytes // calls
            if self.config.cp_mode == "ring":
                row["attention_buffer_bytes"] = max(stats.buffer_bytes,
                                                    stats.backward_buffer_bytes)
        if self.config.experts:  # every rank: a stage without a block brings zeros
            row.update(self._expert_metrics())
        if self.dispatch is not None:
            graph, forward_only = self.dispatch.with_graph, self.dispatch.without_graph
            row.update(expert_dispatches=graph.calls, expert_rows_sent=graph.rows_sent,
                       expert_rows_received=graph.rows_received)
            if self.config.recompute:
                row.update(expert_forward_only_dispatches=forward_only.calls,
                           expert_forward_only_rows_sent=forward_only.rows_sent,
                           expert_forward_only_rows_received=forward_only.rows_received)
        return row

    def _expert_metrics(self) -> dict[str, Any]:
        """expert_load, expert_load_imbalance, dropped_tokens, aux_loss (the module's docstring),
        over every replica and stage: one SUM all-reduce of (load, dropped, aux) from each rank,
        each counting the mixtures of its stage's blocks (its replica's samples), so the sum
        over the job counts every block and every sample once; the aux losses' sum is then over
        the dp replicas, and divided by dp is their mean."""
        load = np.zeros((self.config.layers, self.config.experts))  # (L, E): this stage's rows
        for stats in self.experts:
            load[stats.block] += stats.load
        aux = sum(stats.aux_loss / max(stats.forwards, 1) for stats in self.experts)
        values = np.array([*load.ravel(), sum(stats.dropped for stats in self.experts), aux])
        total = self.timed(self.comm.allreduce_scalars, "expert_load")(values, "sum")
        by_block = total[:-2].reshape(load.shape)
        worst = max(row.max() / row.mean() for row in by_block)
        return {"expert_load": [int(count) for count in by_block.sum(axis=0)],
                "expert_load_by_block": by_block.astype(np.int64).tolist(),
                "expert_load_imbalance": float(worst),
                "dropped_tokens": int(total[-2]), "aux_loss": float(total[-1]) / self.topology.dp}

    def _counts(self) -> tuple[dict, dict, dict, int]:
        """This rank's counters now: bytes sent by group, the sync's bytes and seconds by
        collective, and the scalar all-reduces."""
        sent = {name: comm.bytes_sent for name, comm in self.groups.items()}
        counter = self.plain_sync.sent
        calls = sum(comm.scalar_allreduces for comm in self.communicators)
        return sent, dict(counter.by_collective), dict(counter.seconds), calls

    def _communication(self) -> dict[str, Any]:
        """{bytes_sent, bytes_by_group, bytes_by_collective, seconds_by_collective,
        scalar_allreduces} since `start`."""
        sent0, bytes0, seconds0, calls0 = self.counts_before
        sent1, bytes1, seconds1, calls1 = self._counts()
        by_collective = {name: bytes1[name] - bytes0.get(name, 0) for name in bytes1}
        by_group = {name: sent1[name] - sent0[name] for name in sent1}
        for name in ("pipeline", "tied", "tensor_parallel", "context_parallel", "expert_parallel"):
            if name in sent1:
                by_collective[name] = by_group[name]
        return {"bytes_sent": sum(by_group.values()), "bytes_by_group": by_group,
                "bytes_by_collective": by_collective,
                "seconds_by_collective": {n: seconds1[n] - seconds0.get(n, 0.0) for n in seconds1},
                "scalar_allreduces": calls1 - calls0}

    def _seconds(self) -> dict[str, float]:
        """Where the step's time went: `communication_seconds` in all (inside backward too), its
        `exposed_communication_seconds`, `straggler_seconds` (the barrier's wait, with
        --straggler-barrier; in neither of the others) and the rest, `compute_seconds`."""
        in_backward = self.plain_sync.backward_communication_seconds()
        communication = self.stopwatch.seconds + in_backward - self.in_backward_before
        self.in_backward_before = in_backward
        elapsed = time.perf_counter() - self.step_start
        seconds = {"compute_seconds": elapsed - communication - (self.straggler or 0.0),
                   "communication_seconds": communication,
                   "exposed_communication_seconds": self.exposed_seconds}
        if self.straggler is not None:
            seconds["straggler_seconds"] = self.straggler
        return seconds

    def _mean_loss_and_peak(self, loss_sum: float,
                            work: float) -> tuple[float, int, list[float]]:
        """(the batch's mean loss, the most activation bytes any rank kept, every rank's context
        work) on every rank, from one SUM all-reduce: the last stages' loss shares, and each
        rank's peak and work in its own slots (the work only with --cp)."""
        topology, config, size, rank = self.topology, self.config, self.comm.size, self.comm.rank
        values = np.zeros(1 + (2 if self.attention is not None else 1) * size)
        if topology.is_last_stage and topology.tp_rank == 0:  # the shards share one loss
            # each context shard's mean is over its equal share of the replica's tokens
            values[0] = loss_sum / config.micro_batches / topology.dp / topology.cp
        values[1 + rank] = self.runner.peak_activation_bytes
        if self.attention is not None:
            values[1 + size + rank] = work
        total = self.timed(self.comm.allreduce_scalars, "mean_loss")(values, "sum")
        return (float(total[0]), int(total[1 : 1 + size].max()),
                [float(blocks) for blocks in total[1 + size :]])

    def model_state(self, records: list[dict]) -> dict[str, Any]:
        """The final row's memory fields: every rank's held bytes (total and by kind) at the end
        of its last step and its peak inside a step, gathered with one SUM all-reduce of a (ranks
        x kinds) table; nothing when no step ran. The table also brings every rank's mean
        bytes_sent over `records` (this rank's steps) into `bytes_per_step`, for the summary."""
        if self.held is None:
            return {}
        kinds = len(KINDS)
        table = np.zeros((self.comm.size, kinds + 2))
        table[self.comm.rank, :kinds] = [self.held[kind] for kind in KINDS]
        table[self.comm.rank, kinds] = self.plain_sync.peak.total
        # The same all-reduce brings each rank's mean bytes sent per step, for the run's summary.
        table[self.comm.rank, kinds + 1] = np.mean([row["bytes_sent"] for row in records])
        table = self.comm.allreduce_scalars(table.reshape(-1), "sum").reshape(table.shape)
        self.bytes_per_step = [float(row[kinds + 1]) for row in table]
        return {"model_state_bytes": [int(row[:kinds].sum()) for row in table],
                "model_state_by_kind": [{kind: int(value) for kind, value in zip(KINDS, row)}
                                        for row in table],
                "peak_model_state_bytes": [int(row[kinds]) for row in table]}

    def _record_communication(self, op: str, start: float, end: float) -> None:
        assert self.trace is not None  # the listener is set only with a trace
        self.trace.record(op, self.current_step, -1, start, end)
