"""Measure the terms of minimp.machinemodel on this machine, each on its own, with a communicator.

`calibrate(comm, sizes)` times, on every rank at once as the collectives run them: the agreement
all-reduce; each algorithm's Python with messages that cost nothing (a communicator that only
counts); one Sendrecv between pairs of ranks at each size; one in-place add of each size; and the
ring itself between pairs of ranks (one reduce-scatter step and one all-gather step), whose
messages carry bytes written just before and so cost more than the Sendrecv timed alone.
Small sizes are timed over many repetitions (a 4 KiB message is near the clock's noise floor).
Every time is the slowest rank's (what a collective waits for), the median of its repetitions.
"""

import itertools
import time
from typing import Any, Callable, Iterator, Sequence, cast

import numpy as np

from minimp.distributed.buffers import reduce_into
from minimp.distributed.protocol import Communicator
from minimp.distributed.ring import ring_allreduce_into
from minimp.distributed.collectives import ALGORITHMS
from minimp.machinemodel import ALGORITHMS as MODELLED
from minimp.machinemodel import Line, MachineModel, fit_lines


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
        "ring_step": [],
    }
    pair = cast(Communicator, _Pair(comm, partner))
    for nbytes in sizes:
        outgoing, incoming = rotating_chunks(nbytes, comm.size), rotating_chunks(nbytes, comm.size)
        repeats = repeats_for(nbytes)
        # pairs of ranks exchange at once, as in a ring step or a recursive-doubling round
        exchange = lambda: comm.sendrecv(next(outgoing), partner, next(incoming), partner)  # noqa: E731
        terms["message"].append(timed(comm, exchange, repeats))
        add = lambda: reduce_into(next(incoming), next(outgoing), "sum")  # noqa: E731
        terms["reduce"].append(timed(comm, add, repeats))
        # the ring on two chunks of nbytes, the same arrays every call, as a training step's
        # buckets are: what each of its p - 1 step pairs costs at p ranks
        x, out = np.ones(nbytes // 2, np.float32), np.zeros(nbytes // 2, np.float32)
        step = lambda: ring_allreduce_into(pair, x, out)  # noqa: E731
        terms["ring_step"].append(timed(comm, step, repeats_for(2 * nbytes)))
    # the same step's Python alone, which python["ring"] counts already
    silent = cast(Communicator, _Pair(cast(Communicator, _Silent(comm.rank, comm.size)), partner))
    tiny = np.ones(2, np.float32)
    step = lambda: ring_allreduce_into(silent, tiny, tiny * 0)  # noqa: E731
    with np.errstate(all="ignore"):  # nothing arrives: the add sums whatever was there
        terms["ring_step_python"] = timed(comm, step, 100)
    return terms


class _Pair:
    """This rank and its partner as a ring of two: what ring.py sends to the right and receives
    from the left both go to the partner (a rank without one sends to itself)."""

    def __init__(self, comm: Communicator, partner: int):
        self.comm, self.partner = comm, partner
        self.rank, self.size = comm.rank & 1, 2  # a rank without a partner is even: rank 0

    def sendrecv(
        self, outgoing: Any, dest: int, incoming: Any, source: int, tag: int = 0, **tags: Any
    ) -> None:
        self.comm.sendrecv(outgoing, self.partner, incoming, self.partner, tag=tag, **tags)


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


def ring_step_line(sizes: Sequence[int], seconds: Sequence[float], python: float) -> Line:
    """The ring_step term: the steps' measured seconds less their Python. A Python timed at
    nine tenths of a step or more is noise, not the step: a tenth of the step stays (the fit
    weighs relative errors and cannot take a zero)."""
    return fit_lines(sizes, [max(t - python, t / 10) for t in seconds])


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
        ring_step=ring_step_line(sizes, terms["ring_step"], terms["ring_step_python"]),
        name="fitted in this run",
    )
    return model, terms
