"""Measure the terms of minimp.machinemodel on this machine, each on its own, with a communicator.

`calibrate(comm, sizes)` times, on every rank at once as the collectives run them: the agreement
all-reduce; each algorithm's Python with messages that cost nothing (a communicator that only
counts); one Sendrecv between pairs of ranks at each size; one in-place add of each size.
Small sizes are timed over many repetitions (a 4 KiB message is near the clock's noise floor).
Every time is the slowest rank's (what a collective waits for), the median of its repetitions.
"""

import itertools
import time
from typing import Any, Callable, Iterator, Sequence, cast

import numpy as np

from minimp.distributed.buffers import reduce_into
from minimp.distributed.protocol import Communicator
from minimp.distributed.collectives import ALGORITHMS
from minimp.machinemodel import ALGORITHMS as MODELLED
from minimp.machinemodel import MachineModel, fit_lines


def timed(comm: Communicator, function: Callable[[], Any], repeats: int) -> float:
    """The median over `repeats` runs of the slowest rank's seconds for function(), after one
    untimed run; the ranks start each run together (a barrier)."""
    function()
    samples = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        function()
        elapsed = time.perf_counter() - start
        samples.append(float(comm.allreduce_scalars([elapsed], op="max")[0]))
    return float(np.median(samples))


def repeats_for(nbytes: int, budget: float = 0.05) -> int:
    """More repetitions for smaller sizes: at least 50 below 1 MiB, at least 7 above."""
    # nbytes > 1 MiB in the second branch: no division by zero to guard against
    return 50 if nbytes <= 2**20 else max(7, int(budget * 2**30 / nbytes))


class _Silent:
    """A communicator whose messages cost nothing and carry nothing: an algorithm's Python alone."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def sendrecv(self, *args: Any, **kwargs: Any) -> None:
        pass

    send = recv = bcast = sendrecv

    def allreduce_scalars(self, values: Any, op: str = "max") -> np.ndarray:
        return np.asarray(values, np.float64)


def calibration_sizes(smallest: int, largest: int) -> list[int]:
    """3 x 2^k bytes (a multiple of 4) bracketing smallest..largest: between the powers of two a
    benchmark measures, so every power-of-two size is one the fit never saw."""
    nbytes = 12
    while nbytes * 2 <= smallest:
        nbytes *= 2
    sizes = [nbytes]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2)
    return sizes


def measure_terms(comm: Communicator, sizes: Sequence[int]) -> dict:
    """{term: measurement}: agree and each algorithm's Python (seconds), and message and reduce
    seconds at each of `sizes` (bytes, multiples of 4: float32 arrays)."""
    partner = comm.rank ^ 1 if (comm.rank ^ 1) < comm.size else comm.rank
    four = np.zeros(4)
    terms: dict = {
        # the agreement's MPI all-reduce; its Python runs with the silent communicator
        "agree": timed(comm, lambda: comm.allreduce_scalars(four, op="max"), 200),
        "python": {name: python_seconds(comm, name) for name in MODELLED},
        "sizes": list(sizes),
        "message": [],
        "reduce": [],
    }
    for nbytes in sizes:
        outgoing, incoming = rotating_chunks(nbytes, comm.size), rotating_chunks(nbytes, comm.size)
        repeats = repeats_for(nbytes)
        # pairs of ranks exchange at once, as in a ring step or a recursive-doubling round
        exchange = lambda: comm.sendrecv(next(outgoing), partner, next(incoming), partner)  # noqa: E731
        terms["message"].append(timed(comm, exchange, repeats))
        add = lambda: reduce_into(next(incoming), next(outgoing), "sum")  # noqa: E731
        terms["reduce"].append(timed(comm, add, repeats))
    return terms


def rotating_chunks(nbytes: int, chunks: int) -> Iterator[np.ndarray]:
    """Endless float32 chunks of nbytes, taken in turn from one array of `chunks` of them.

    A ring all-reduce of p chunks touches two arrays of p chunks (its input and its output) while
    it sends one chunk at a time; timing one chunk-sized buffer over and over would keep it in the
    cache and miss the knee where the ring's arrays stop fitting (L3 here: 32 MiB for both ranks,
    measured 1.6x slower messages past it). Taking the chunks in turn gives every timed message the
    ring's footprint.
    """
    whole = np.ones(chunks * (nbytes // 4), np.float32)
    views = np.split(whole, chunks)
    return itertools.cycle(views)


PRETENDED_RANKS = (2, 3, 4, 8, 16, 32)


def python_seconds(comm: Communicator, algorithm: str) -> list[float]:
    """The algorithm's Python alone on a silent communicator pretending to have each of
    PRETENDED_RANKS ranks (this rank's number kept where it fits)."""
    seconds = []
    for ranks in PRETENDED_RANKS:
        silent = cast(Communicator, _Silent(comm.rank % ranks, ranks))
        tiny = np.ones(ranks, np.float32)
        run = lambda: ALGORITHMS[algorithm](silent, tiny, out=tiny * 0)  # noqa: E731
        # nothing arrives, so the algorithm adds whatever its receive buffers held: garbage that
        # may overflow; only the time counts
        with np.errstate(all="ignore"):
            seconds.append(timed(comm, run, 100))
    return seconds


def calibrate(comm: Communicator, sizes: Sequence[int]) -> tuple[MachineModel, dict]:
    """The machine model fitted from terms measured at these message sizes, and the measurements."""
    terms = measure_terms(comm, sizes)
    model = MachineModel(
        ranks=comm.size,
        agree=terms["agree"],
        python={
            name: fit_lines(PRETENDED_RANKS, seconds) for name, seconds in terms["python"].items()
        },
        message=fit_lines(sizes, terms["message"]),
        reduce=fit_lines(sizes, terms["reduce"]),
        name="fitted in this run",
    )
    return model, terms
