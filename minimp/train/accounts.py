"""What a step costs this rank, for the metrics: its seconds, bytes sent by collective, scalar
all-reduces, the bytes of model state it holds (by kind, and at the peak inside a step),
activations kept.

Per step (every metrics row): `bytes_sent` (every group but the scalar all-reduces),
`compute_seconds`, `communication_seconds`, `exposed_communication_seconds` and, with
--straggler-barrier, `straggler_seconds` (`step_seconds`), `bytes_by_group` (the bytes sent by
group: tensor_parallel, data_parallel, pipeline, tied), `bytes_by_collective` (all_reduce for
--zero 0, reduce_scatter and all_gather for ZeRO, tied for the GPT's embedding across stages,
pipeline for activations, tensor_parallel for --tp's activations and partial gradients),
`seconds_by_collective` (ZeRO's run inside backward and the update, where
`communication_seconds` does not look),
`scalar_allreduces` (calls: the overflow flags, the norm, the loss) and `peak_activation_bytes`
(the most bytes kept for backward at once, the largest over the ranks). In the final row:
`model_state_bytes`, one total per rank, held at the end of the last step, with
`model_state_by_kind` and `peak_model_state_bytes` beside it (minimp/measure/accounts.py has
the formulas they are checked against).
"""

import time
from typing import Any

import numpy as np

from minimp.measure.accounts import KINDS


class StepCounters:
    """Snapshots of this rank's communicators at the start of a step, and the differences."""

    def __init__(self, run: Any):
        self.run = run
        sync, topology = run.data_parallel, run.topology
        self.groups = {"data_parallel": topology.dp_group, "pipeline": topology.pp_group}
        if topology.tp > 1:
            self.groups["tensor_parallel"] = topology.tp_group
        if sync.tied is not None:
            self.groups["tied"] = sync.tied.comm
        self.every = [run.comm, *self.groups.values()]
        self.start()

    def _snapshot(self) -> tuple[dict, dict, dict, int]:
        sent = {name: comm.bytes_sent for name, comm in self.groups.items()}
        counter = self.run.data_parallel.sent
        calls = sum(comm.scalar_allreduces for comm in self.every)
        return sent, dict(counter.by_collective), dict(counter.seconds), calls

    def start(self) -> None:
        self.before = self._snapshot()

    def finish(self) -> dict[str, Any]:
        """{bytes_sent, bytes_by_group, bytes_by_collective, seconds_by_collective,
        scalar_allreduces} since `start`."""
        sent0, bytes0, seconds0, calls0 = self.before
        sent1, bytes1, seconds1, calls1 = self._snapshot()
        by_collective = {name: bytes1[name] - bytes0.get(name, 0) for name in bytes1}
        by_group = {name: sent1[name] - sent0[name] for name in sent1}
        for name in ("pipeline", "tied", "tensor_parallel"):
            if name in sent1:
                by_collective[name] = by_group[name]
        return {
            "bytes_sent": sum(by_group.values()),
            "bytes_by_group": by_group,
            "bytes_by_collective": by_collective,
            "seconds_by_collective": {n: seconds1[n] - seconds0.get(n, 0.0) for n in seconds1},
            "scalar_allreduces": calls1 - calls0,
        }


def straggler_barrier(run: Any) -> float | None:
    """--straggler-barrier: seconds this replica waits for the slowest to end its backward
    (None without the flag): time overlap cannot hide, kept out of the exposed seconds."""
    if not run.config.straggler_barrier:
        return None
    started = time.perf_counter()
    run.topology.dp_group.barrier()
    return time.perf_counter() - started


def step_seconds(run: Any, step_start: float, exposed: float, straggler: float | None) -> dict:
    """Where the step's time went: `communication_seconds` in all (inside backward too), its
    `exposed_communication_seconds` (from the end of the last backward until the optimizer may
    step), `straggler_seconds` (the barrier's wait, with --straggler-barrier; in neither of the
    others) and the rest, `compute_seconds`."""
    in_backward = run.data_parallel.backward_communication_seconds()
    communication = run.communication.seconds + in_backward - run.in_backward_before
    run.in_backward_before = in_backward
    seconds = {
        "compute_seconds": time.perf_counter() - step_start - communication - (straggler or 0.0),
        "communication_seconds": communication,
        "exposed_communication_seconds": exposed,
    }
    if straggler is not None:
        seconds["straggler_seconds"] = straggler
    return seconds


def step_scalars(run: Any, loss_sum: float) -> tuple[float, int]:
    """(the batch's mean loss, the most activation bytes any rank kept) on every rank, from one
    SUM all-reduce: the last stages' loss shares, and each rank's peak in its own slot."""
    values = np.zeros(1 + run.comm.size)
    if run.topology.is_last_stage and run.topology.tp_rank == 0:  # the shards share one loss
        values[0] = loss_sum / run.config.micro_batches / run.dp
    values[1 + run.comm.rank] = run.stage.peak_activation_bytes
    total = run.communication.wrap(run.comm.allreduce_scalars, "mean_loss")(values, "sum")
    return float(total[0]), int(total[1:].max())


def model_state(run: Any, held: dict[str, int]) -> dict[str, Any]:
    """The final row's memory fields: every rank's held bytes (total and by kind) and its peak
    inside a step, gathered with one SUM all-reduce of a (ranks x kinds) table."""
    peak = run.data_parallel.peak
    table = np.zeros((run.comm.size, len(KINDS) + 1))
    table[run.comm.rank, :-1] = [held[kind] for kind in KINDS]
    table[run.comm.rank, -1] = peak.total
    table = run.comm.allreduce_scalars(table.reshape(-1), "sum").reshape(table.shape)
    return {
        "model_state_bytes": [int(row[:-1].sum()) for row in table],
        "model_state_by_kind": [
            {kind: int(value) for kind, value in zip(KINDS, row[:-1])} for row in table
        ],
        "peak_model_state_bytes": [int(row[-1]) for row in table],
    }
