"""minimp.dist: communicators (real MPI and a simulated world) and collectives written from
scratch."""

from minimp.dist.collectives import (
    ALGORITHMS,
    CollectiveMismatchError,
    all_gather,
    allreduce,
    choose_algorithm,
    naive_allreduce,
    recursive_doubling_allreduce,
    reduce_scatter,
    ring_allreduce,
)
from minimp.dist.comm import MPICommunicator, world
from minimp.dist.launch import run_or_abort
from minimp.dist.ring import chunk_bounds
from minimp.dist.simulated import (
    DeadlockError,
    Message,
    SimulatedCommunicator,
    SimulatedWorld,
    simulate,
)

__all__ = [
    "ALGORITHMS",
    "CollectiveMismatchError",
    "DeadlockError",
    "MPICommunicator",
    "Message",
    "SimulatedCommunicator",
    "SimulatedWorld",
    "all_gather",
    "allreduce",
    "choose_algorithm",
    "chunk_bounds",
    "naive_allreduce",
    "recursive_doubling_allreduce",
    "reduce_scatter",
    "ring_allreduce",
    "run_or_abort",
    "simulate",
    "world",
]
