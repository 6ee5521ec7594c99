"""Measure the terms of the machine model (machinemodel.py) on this machine, each on its own.

`calibrate(comm, sizes)` times, on every rank at once as the collectives run them: the agreement
all-reduce; each algorithm's Python with messages that cost nothing (a communicator that only
counts); one Sendrecv between pairs of ranks at each size; one in-place add of each size; and the
ring itself between pairs of ranks (one reduce-scatter step and one all-gather step), whose
messages carry bytes written just before and so cost more than the Sendrecv timed alone.
Small sizes are timed over many repetitions (a 4 KiB message is near the clock's noise floor).
Every time is the slowest rank's (what a collective waits for), the median of its repetitions.
A benchmark can time the terms in rounds, each with a share of the repetitions, between rounds
of its own measurements, and join them with `join_rounds`; `fit_model` fits the model to them.
"""

import itertools
import math
import time
from typing import Any, Callable, Iterator, Sequence, cast

import numpy as np

from minimp.backend import Array
from minimp.distributed.buffers import reduce_into
from minimp.distributed.collectives import ALGORITHMS
from minimp.distributed.protocol import Communicator
from minimp.distributed.ring import ring_allreduce_into
from minimp.measure.machinemodel import ALGORITHMS as MODELLED
from minimp.measure.machinemodel import Line, MachineModel, fit_lines, interpolate_lines

FRESH_MEMORY_WARMUPS = 3


def timed(comm: Communicator, function: Callable[[], object], repeats: int,
          warmups: int = 1) -> float:
    """The median over `repeats` runs of the slowest rank's seconds for function(), after
    `warmups` untimed runs; the ranks start each run together (a barrier)."""
    for _ in range(warmups):
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

    def sendrecv(self, *args: object, **kwargs: object) -> None:
        pass

    send = recv = bcast = sendrecv

    def allreduce_scalars(self, values: Sequence[float] | Array, op: str = "max") -> np.ndarray:
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


def per_round(repeats: int, rounds: int) -> int:
    """Repetitions in each of `rounds` rounds that together time about `repeats` runs (at least
    3 a round: the median of fewer is one sample's noise)."""
    return max(3, math.ceil(repeats / rounds))


def measure_terms(comm: Communicator, sizes: Sequence[int], rounds: int = 1) -> dict:
    """{term: measurement}: agree and each algorithm's Python (seconds), and message and reduce
    seconds at each of `sizes` (bytes, multiples of 4: float32 arrays). With rounds > 1, this is
    one of that many rounds: each time takes its share of the repetitions (join_rounds joins
    them)."""
    partner = comm.rank ^ 1 if (comm.rank ^ 1) < comm.size else comm.rank
    four = np.zeros(4)
    agreement = lambda: comm.allreduce_scalars(four, op="max")  # noqa: E731
    terms: dict = {
        # the agreement's MPI all-reduce; its Python runs with the silent communicator
        "agree": timed(comm, agreement, per_round(200, rounds)),
        "python": {name: python_seconds(comm, name, rounds) for name in MODELLED},
        "sizes": list(sizes), "message": [], "reduce": [], "ring_step": []}
    pair = cast(Communicator, _Pair(comm, partner))
    for nbytes in sizes:
        outgoing, incoming = rotating_chunks(nbytes, comm.size), rotating_chunks(nbytes, comm.size)
        repeats = per_round(repeats_for(nbytes), rounds)
        # pairs of ranks exchange at once, as in a ring step or a recursive-doubling round
        exchange = lambda: comm.sendrecv(  # noqa: E731
            next(outgoing), partner, next(incoming), partner)
        # arrays allocated just before run slower for more than one call (here the second call
        # took 0.99-1.59x the time of calls 9-12 on the same arrays, the fourth 0.98-1.23x:
        # mpirun_examples/new_memory.py); a training step's buckets are old arrays
        terms["message"].append(timed(comm, exchange, repeats, FRESH_MEMORY_WARMUPS))
        add = lambda: reduce_into(next(incoming), next(outgoing), "sum")  # noqa: E731
        terms["reduce"].append(timed(comm, add, repeats))
        # the ring on two chunks of nbytes, the same arrays every call, as a training step's
        # buckets are: what each of its p - 1 step pairs costs at p ranks
        x, out = np.ones(nbytes // 2, np.float32), np.zeros(nbytes // 2, np.float32)
        step = lambda: ring_allreduce_into(pair, x, out)  # noqa: E731
        repeats = per_round(repeats_for(2 * nbytes), rounds)
        terms["ring_step"].append(timed(comm, step, repeats, FRESH_MEMORY_WARMUPS))
    # the same step's Python alone, which python["ring"] counts already
    silent = cast(Communicator, _Pair(cast(Communicator, _Silent(comm.rank, comm.size)), partner))
    tiny = np.ones(2, np.float32)
    step = lambda: ring_allreduce_into(silent, tiny, tiny * 0)  # noqa: E731
    with np.errstate(all="ignore"):  # nothing arrives: the add sums whatever was there
        terms["ring_step_python"] = timed(comm, step, per_round(100, rounds))
    return terms


class _Pair:
    """This rank and its partner as a ring of two: what ring.py sends to the right and receives
    from the left both go to the partner (a rank without one sends to itself)."""

    def __init__(self, comm: Communicator, partner: int):
        self.comm, self.partner = comm, partner
        self.rank, self.size = comm.rank & 1, 2  # a rank without a partner is even: rank 0

    def sendrecv(self, outgoing: Array, dest: int, incoming: Array, source: int, tag: int = 0,
                 **tags: int) -> None:
        self.comm.sendrecv(outgoing, self.partner, incoming, self.partner, tag=tag, **tags)


def rotating_chunks(nbytes: int, chunks: int) -> Iterator[np.ndarray]:
    """Endless float32 chunks of nbytes, taken in turn from one array of `chunks` of them.

    A ring all-reduce of p chunks touches two arrays of p chunks (its input and its output) while
    it sends one chunk at a time; timing one chunk-sized buffer over and over would keep it in the
    cache and miss the knee where the ring's arrays stop fitting (L3 here: 32 MiB for both ranks,
    measured 1.6x slower messages past it). Taking the chunks in turn gives every timed message the
    ring's footprint.
    """
    return itertools.cycle(np.split(np.ones(chunks * (nbytes // 4), np.float32), chunks))


PRETENDED_RANKS = (2, 3, 4, 8, 16, 32)


def python_seconds(comm: Communicator, algorithm: str, rounds: int = 1) -> list[float]:
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
            seconds.append(timed(comm, run, per_round(100, rounds)))
    return seconds


def ring_step_line(sizes: Sequence[int], seconds: Sequence[float], python: float) -> Line:
    """The ring_step term: the steps' measured seconds less their Python, joined by straight
    lines. A Python timed at nine tenths of a step or more is noise, not the step: a tenth of
    the step stays (a step costs more than nothing)."""
    return interpolate_lines(sizes, [max(t - python, t / 10) for t in seconds])


def join_rounds(rounds: Sequence[Any], statistic: Callable = np.mean) -> Any:
    """Measurements of several rounds (or runs) joined: `statistic` of each number across them,
    in dicts and lists alike; values all of them agree on (sizes, names) kept as they are."""
    first = rounds[0]
    if isinstance(first, dict):
        return {key: join_rounds([one[key] for one in rounds], statistic) for key in first}
    if isinstance(first, list):
        return [join_rounds(list(column), statistic) for column in zip(*rounds)]
    if all(one == first for one in rounds):
        return first
    return float(statistic(rounds))


def fit_model(ranks: int, terms: dict, name: str = "fitted in this run") -> MachineModel:
    """The machine model of terms measured by measure_terms (or their median over runs)."""
    sizes, python = terms["sizes"], terms["python"]
    return MachineModel(
        ranks=ranks, agree=terms["agree"],
        python={name: fit_lines(PRETENDED_RANKS, seconds) for name, seconds in python.items()},
        message=fit_lines(sizes, terms["message"]), reduce=fit_lines(sizes, terms["reduce"]),
        ring_step=ring_step_line(sizes, terms["ring_step"], terms["ring_step_python"]), name=name)


def calibrate(comm: Communicator, sizes: Sequence[int]) -> tuple[MachineModel, dict]:
    """The machine model fitted from terms measured at these message sizes, and the measurements."""
    terms = measure_terms(comm, sizes)
    return fit_model(comm.size, terms), terms
