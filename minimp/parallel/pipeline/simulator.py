"""A discrete-event simulator of pipeline schedules: what a schedule would take, before running it.

`simulate_schedule(schedule, costs)` plays every rank's actions in order, on P virtual ranks with
given costs: a compute takes its cost once the rank is free and its input is there; a send costs
its sender nothing and arrives `message` seconds later (non-blocking sends, as MPI's Isend or an
eager message); a receive waits for its message. It returns the timeline (the same rows as the
training command's --timeline, so the same trace file and Gantt chart), the step's span, the bubble
and the peak of stored micro-batches per rank.

Bubble = idle time of all ranks / (P x span): with equal costs and free messages it is
(P - 1)/(M + P - 1) for GPipe and 1F1B, (P - 1)/(V M + P - 1) for interleaving over V chunks
(whose forward and backward each cost 1/V of a stage's), and (P - 1)/(3M + P - 1) for ZB-H1 with
T_F = T_B = T_W, M >= P (tests/test_simulator.py checks each against its formula).
"""

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minimp.measure.trace import OPS, trace_document
from minimp.parallel.pipeline.schedules import actions as s
from minimp.parallel.pipeline.schedules.actions import Schedule, peak_activations
from minimp.parallel.pipeline.schedules.dependencies import messages, virtual_stage


@dataclass
class Costs:
    """Seconds of one micro-batch's work on one chunk (a virtual stage): one number for all, or one
    per virtual stage: forward, backward (input and weight gradients together), and
    backward_input / backward_weight (zero bubble's B and W), which default to halves of backward;
    message: the seconds a message takes to arrive (0 by default)."""

    forward: float | Sequence[float]
    backward: float | Sequence[float]
    message: float = 0.0
    backward_input: float | Sequence[float] | None = None
    backward_weight: float | Sequence[float] | None = None

    def of(self, op: str, stage: int) -> float:
        """Seconds of `op` (forward, backward, backward_input, backward_weight) on a stage."""
        value = getattr(self, op)
        if value is None:  # a split backward without its own costs: half of backward each
            return self.of("backward", stage) / 2
        return value if isinstance(value, (int, float)) else value[stage]


@dataclass
class SimulatedStep:
    """What simulate_schedule found. span: seconds from the first action's start to the last one's
    end; bubble: idle time of all ranks / (ranks x span); busy: compute seconds of each rank;
    peak_stored: the most micro-batches a rank held at once (forward to last backward); rows: per
    rank, one [op index, step, micro-batch, start, end] per compute (the timeline)."""

    span: float
    bubble: float
    busy: list[float]
    peak_stored: list[int]
    rows: list[list] = field(default_factory=list)


def simulate_schedule(schedule: Schedule, costs: Costs) -> SimulatedStep:
    """Play the schedule (see the module docstring); raises RuntimeError on a deadlock."""
    stages = len(schedule)
    position, clock = [0] * stages, [0.0] * stages
    arrival: dict[tuple, float] = {}  # message key -> when it arrives
    rows: list[list] = [[] for _ in range(stages)]
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                sent, received = messages(action, rank, stages)
                start = clock[rank]
                for key in sent:  # a send leaves as soon as it is reached (a Sendrecv too)
                    arrival.setdefault(key, start + costs.message)
                if any(key not in arrival for key in received):
                    break  # its message has not been sent yet: another rank must move first
                start = max([start] + [arrival[key] for key in received])
                end = start
                if action.op in s.COMPUTE_LABELS:  # a compute (forward, backward, B or W)
                    end = start + costs.of(action.op, virtual_stage(rank, action.chunk, stages))
                    op_index = OPS.index(action.op)
                    rows[rank].append([op_index, 1, action.micro_batch, start, end])
                clock[rank] = end
                position[rank] += 1
                progress = True
    stuck = [rank for rank, actions in enumerate(schedule) if position[rank] < len(actions)]
    if stuck:
        raise RuntimeError(f"the schedule deadlocks: ranks {stuck} wait for messages never sent")
    span = max(clock)
    busy = [sum(end - start for *_, start, end in rank_rows) for rank_rows in rows]
    return SimulatedStep(span=span, bubble=1.0 - sum(busy) / (stages * span) if span else 0.0,
                         busy=busy, peak_stored=[peak_activations(actions) for actions in schedule],
                         rows=rows)


def simulated_trace(step: SimulatedStep, schedule_name: str, micro_batches: int) -> dict:
    """The simulated step as a trace document (the format of --timeline: minimp/measure/trace.py),
    each virtual rank a process of its own."""
    stages = len(step.rows)
    ranks = {rank: {"rows": np.array(rows, np.float64).reshape(-1, 5),
                    "name": f"stage {rank} (simulated)"} for rank, rows in enumerate(step.rows)}
    other = {
        "schedule": schedule_name,
        "stages": stages,
        "replicas": 1,
        "micro_batches": micro_batches,
        "peak_stored_micro_batches": step.peak_stored,
        "stage_of_rank": {str(rank): rank for rank in range(stages)},
        "replica_0_ranks": list(range(stages)),
        "simulated": True,
    }
    return trace_document(ranks, other)
