"""Every pipeline schedule by its `--schedule` name: how to build it and how the runner must send.

GPipe and 1F1B are written for blocking sends (a message past MPI's eager limit waits for its
receive, and 1F1B pairs its exchanges so neither neighbour waits on the other). The interleaved
and the zero-bubble schedules are not: their receives sit just before the compute that needs
them and their sends just after the compute that made them (`with_messages`), so with sends
that wait for their receives a rank can wait in a send for a neighbour that is itself waiting in
one (`check_schedule` finds such a deadlock at P = 2, M = 4, for example). They run with buffered
sends (MPI_Isend, completed at the end of the step). tests/test_schedule_choice.py checks both
ways at the sizes it tries.
"""

from dataclasses import dataclass
from typing import Callable

from minimp.parallel.pipeline.schedules.actions import Schedule, gpipe, one_f_one_b
from minimp.parallel.pipeline.schedules.interleaved import check_interleaving, interleaved
from minimp.parallel.pipeline.schedules.zero_bubble import zb_h1


@dataclass(frozen=True)
class ScheduleChoice:
    """One --schedule. build: (stages, micro-batches, virtual stages) -> Schedule; buffered_sends:
    whether its sends must be buffered; bubble: (the same sizes) -> its bubble (idle time of all
    stages / (P x span)) when every forward costs the same on every stage, every backward twice
    that (B and W one forward each), and messages nothing (tests/test_schedule_choice.py
    simulates it)."""

    build: Callable[[int, int, int], Schedule]
    buffered_sends: bool
    bubble: Callable[[int, int, int], float]


CHOICES = {
    "gpipe": ScheduleChoice(lambda p, m, v: gpipe(p, m), False,
                            lambda p, m, v: (p - 1) / (m + p - 1)),
    "1f1b": ScheduleChoice(lambda p, m, v: one_f_one_b(p, m), False,
                           lambda p, m, v: (p - 1) / (m + p - 1)),
    # Narayanan et al. 2021: (P - 1)/(V M) of the ideal compute time
    "interleaved": ScheduleChoice(interleaved, True, lambda p, m, v: (p - 1) / (v * m + p - 1)),
    # Qi et al. 2023: (P - 1)(T_F + T_B - T_W) per stage, a third of 1F1B's with equal F, B, W
    "zb-h1": ScheduleChoice(lambda p, m, v: zb_h1(p, m), True,
                            lambda p, m, v: (p - 1) / (3 * m + p - 1)),
}


def build_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Each pipeline rank's actions for one step of the named schedule."""
    return CHOICES[name].build(stages, micro_batches, virtual_stages)


def schedule_problem(name: str, stages: int, micro_batches: int, virtual_stages: int) -> str:
    """Why these sizes cannot run the named schedule, in words ("" when they can)."""
    if name not in CHOICES:
        return f"unknown schedule {name!r} (choose from {', '.join(CHOICES)})"
    if virtual_stages < 1:
        return f"--virtual-stages must be 1 or more, got {virtual_stages}"
    if virtual_stages > 1 and name != "interleaved":
        return f"--virtual-stages {virtual_stages} needs --schedule interleaved"
    if name == "interleaved":
        try:
            check_interleaving(stages, micro_batches, virtual_stages)
        except ValueError as error:
            return str(error)
    return ""
