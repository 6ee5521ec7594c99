"""What minimp's all-reduces cost on a real machine, term by term: the textbook model, refined.

costmodel.py holds Hockney's alpha + n beta and Thakur, Rabenseifner & Gropp's (2005) all-reduce
formulas: right in form, but one straight line through every message size fits neither end on a
real machine. Measured on its own (minimp/measure/calibrate.py), each piece of an all-reduce
costs what these terms say:

  agree         the collective's agreement on length and dtype: one small MPI all-reduce
  python[alg]   the Python around the messages of one algorithm (chunk bounds, slices, calls),
                measured with a communicator whose messages cost nothing, which can pretend to
                have any number of ranks: a Line in p, not in bytes
  message(c)    one Sendrecv of c bytes with another rank, through minimp's wrapper and mpi4py:
                latency + c beta, in up to three straight pieces, because MPI switches protocol
                (up to its eager limit it copies a message through a buffer at once; above it,
                sender and receiver first agree, a rendezvous: more latency, another bandwidth)
                and because big messages leave the cache
  reduce(c)     adding c bytes into an array (NumPy, in place): c gamma, in pieces, since the
                adds become memory-bound when the arrays leave the cache
  ring_step(c)  one step of the ring's reduce-scatter and one of its all-gather between a pair of
                ranks, as ring.py runs them on chunks of c bytes: two Sendrecvs and one add. Its
                parts cannot be timed alone: the all-gather sends the sum the add wrote just
                before, into memory the partner's receive wrote the call before, and moving
                lines one core has just written to the other costs far more than message(c)
                does (mpirun_examples/coherence.py measures it). On this project's machine the
                terms summed missed the ring by up to 3.8x (2026-11-30). The step is timed
                whole, less its Python (timed on the silent communicator), which python counts
                already, and its sizes are joined by straight lines (interpolate_lines), not
                fitted: its time per byte is no straight line (at p = 2 here, per byte of
                chunk, a bump near 768 KiB, 0.44-0.50 ns; 0.35-0.40 ns at 6 MiB; 0.53-0.63 ns
                at 48 MiB as its arrays outgrow the caches), and fit_lines' up to three pieces
                missed it by 14-34% at the worst of the very sizes they were fitted on

  ring(n)                = agree + python + (p-1) ring_step(n/p)
  recursive_doubling(n)  = python + log2(p) (message(n) + adds(n))  [p a power of 2]
  naive(n)               = agree + python + (p-1) (message(n) + adds(n)) + ceil(log2 p) message(n)

Recursive doubling pays no agreement: its ranks check each other's length, dtype and op in a
48-byte header on their own messages (minimp/distributed/headers.py), which message(n) prices.

where adds(c) = reduce(c) - reduce(0) (the call's fixed cost is in python already). A model
without a ring_step term (one built by hand) prices the ring as 2(p-1) message(n/p) + (p-1)
adds(n/p), the textbook's count. The naive root receives one message after another; its
broadcast is MPI's, counted as a binomial tree.

On an oversubscribed machine (4 ranks on 2 cores) every term is measured under the same sharing,
so the fit carries it; what the terms cannot carry is ranks waiting for a core, which comes and
goes with the operating system's scheduling (lesson 8 says where that shows).

The models minimp ships (SHIPPED) are constants fitted on this project's machine, not a cache
fitted per run: a choice by them (`allreduce(comm, x, algorithm=FastestPredicted())`, below) must
pick the same algorithm on every rank, and a per-rank, per-run fit could disagree by a noisy
microsecond and deadlock the ranks in different algorithms.
"""

import dataclasses
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from minimp import distributed
from minimp.measure import costmodel
from minimp.measure.costmodel import Network, fit_alpha_beta


@dataclass(frozen=True)
class Line:
    """seconds = intercept + nbytes * slope, up to `limit` bytes, then `above` (a Line, or None
    for a single line)."""

    intercept: float
    slope: float
    limit: float = float("inf")
    above: "Line | None" = None

    def __call__(self, nbytes: float) -> float:
        if nbytes > self.limit and self.above is not None:
            return self.above(nbytes)
        return self.intercept + nbytes * self.slope

    def pieces(self) -> list["Line"]:
        """This line and the ones above it, lowest first (each with its own limit)."""
        return [self] + (self.above.pieces() if self.above is not None else [])

    @staticmethod
    def from_dict(fields: dict) -> "Line":
        above = Line.from_dict(fields["above"]) if fields.get("above") else None
        return Line(fields["intercept"], fields["slope"], fields.get("limit", float("inf")), above)


ALGORITHMS = ("ring", "recursive_doubling", "naive")


@dataclass(frozen=True)
class MachineModel:
    """The terms of minimp's all-reduces on one machine at one number of ranks (seconds)."""

    ranks: int
    agree: float
    python: dict = field(default_factory=dict)  # {algorithm: Line of its Python's seconds in p}
    message: Line = Line(0.0, 0.0)  # one Sendrecv of c bytes
    reduce: Line = Line(0.0, 0.0)  # adding c bytes in place
    name: str = ""
    ring_step: Line | None = None  # a reduce-scatter step and an all-gather step of c bytes

    def adds(self, nbytes: float) -> float:
        return max(self.reduce(nbytes) - self.reduce(0.0), 0.0)

    def allreduce_time(self, algorithm: str, nbytes: float) -> float:
        """Predicted seconds for one all-reduce of nbytes with the named algorithm."""
        p = self.ranks
        # a group of one rank runs only the Python, of any algorithm the model has a Line for
        if algorithm not in self.python or (p > 1 and algorithm not in ALGORITHMS):
            raise ValueError(f"no model of {algorithm!r}: use one of {ALGORITHMS}")
        fixed = self.python[algorithm](p)
        if p == 1:
            return fixed
        if algorithm == "ring":
            chunk = nbytes / p
            if self.ring_step is not None:
                steps = (p - 1) * self.ring_step(chunk)
            else:
                steps = 2 * (p - 1) * self.message(chunk) + (p - 1) * self.adds(chunk)
        elif algorithm == "recursive_doubling":
            rounds = p.bit_length() - 1  # rounds among the largest power of two <= p
            folded = 0 if p & (p - 1) == 0 else 2 * self.message(nbytes) + self.adds(nbytes)
            steps = rounds * (self.message(nbytes) + self.adds(nbytes)) + folded
        else:  # naive
            broadcast = math.ceil(math.log2(p)) * self.message(nbytes)
            steps = (p - 1) * (self.message(nbytes) + self.adds(nbytes)) + broadcast
        agreement = 0.0 if algorithm == "recursive_doubling" else self.agree  # see above
        return agreement + fixed + steps

    def ring_allreduce(self, nbytes: float) -> float:
        return self.allreduce_time("ring", nbytes)

    def fastest(self, nbytes: float, candidates: Sequence[str] = ALGORITHMS) -> str:
        """The candidate predicted fastest (ties go to the earlier name)."""
        return min(candidates, key=lambda name: self.allreduce_time(name, nbytes))

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(fields: dict) -> "MachineModel":
        return MachineModel(
            ranks=int(fields["ranks"]), agree=float(fields["agree"]), name=fields.get("name", ""),
            python={name: Line.from_dict(line) for name, line in fields["python"].items()},
            message=Line.from_dict(fields["message"]), reduce=Line.from_dict(fields["reduce"]),
            ring_step=Line.from_dict(fields["ring_step"]) if fields.get("ring_step") else None)


NOISE_FLOOR = 0.02  # the relative spread of repeated medians on a quiet machine, about


def fit_lines(nbytes: Sequence[float], seconds: Sequence[float], most: int = 3) -> Line:
    """Up to `most` straight pieces, each fitted by fit_alpha_beta (least squares on the relative
    error, so a 4 KiB time and a 16 MiB one count alike), split between measured sizes where the
    total squared relative error is least. Each extra piece must earn its place (cut the error by
    a quarter) and rest on at least two points; none is added once the root-mean-square relative
    error is within NOISE_FLOOR."""
    order = np.argsort(nbytes)
    sizes, times = np.asarray(nbytes, float)[order], np.asarray(seconds, float)[order]
    best = _pieces(sizes, times, [])
    best_error = _relative_error(best, sizes, times)
    for count in range(1, most):
        if best_error <= len(sizes) * NOISE_FLOOR**2:
            break  # already within the timer's noise: a split would fit the noise
        candidates = [_pieces(sizes, times, list(splits))
                      for splits in itertools.combinations(range(2, len(sizes) - 1), count)
                      if all(b - a >= 2 for a, b in zip(splits, splits[1:]))]
        if not candidates:
            break
        line = min(candidates, key=lambda c: _relative_error(c, sizes, times))
        error = _relative_error(line, sizes, times)
        if error > best_error * 0.75:
            break
        best, best_error = line, error
    return best


def interpolate_lines(nbytes: Sequence[float], seconds: Sequence[float]) -> Line:
    """Straight lines between neighbouring measured sizes: each size's own time, and between two
    sizes the time on the line joining theirs. Below the smallest size the smallest's time (all
    latency); above the largest, that size's time per byte (all bandwidth). For a term whose
    curve bends more than fit_lines' three pieces can follow (the ring step), at the price of
    carrying each point's noise."""
    order = np.argsort(nbytes)
    sizes, times = np.asarray(nbytes, float)[order], np.asarray(seconds, float)[order]
    line = Line(0.0, float(times[-1] / sizes[-1]))
    for i in reversed(range(len(sizes) - 1)):
        slope = float((times[i + 1] - times[i]) / (sizes[i + 1] - sizes[i]))
        line = Line(float(times[i] - slope * sizes[i]), slope, float(sizes[i + 1]), line)
    return Line(float(times[0]), 0.0, float(sizes[0]), line)


def _pieces(sizes: np.ndarray, times: np.ndarray, splits: list[int]) -> Line:
    """Lines through sizes[start:split] for consecutive splits, chained from the top down."""
    bounds = [0] + splits + [len(sizes)]
    line: Line | None = None
    for start, stop in reversed(list(zip(bounds, bounds[1:]))):
        intercept, slope = fit_alpha_beta(sizes[start:stop], times[start:stop])
        limit = float(sizes[stop - 1]) if line is not None else float("inf")
        line = Line(intercept, slope, limit, line)
    assert line is not None
    return line


def _relative_error(line: Line, sizes: np.ndarray, times: np.ndarray) -> float:
    return float(sum((line(n) / t - 1.0) ** 2 for n, t in zip(sizes, times)))


def relative_errors(model: MachineModel, nbytes: Sequence[int], measured: Sequence[float],
                    algorithm: str = "ring") -> dict:
    """model/measured - 1 at each size, with the median and the worst of their absolute values."""
    ratios = [model.allreduce_time(algorithm, n) / t - 1.0 for n, t in zip(nbytes, measured)]
    magnitudes = sorted(abs(r) for r in ratios)
    median = float(np.median(magnitudes)) if magnitudes else 0.0
    return {"errors": ratios, "median": median, "worst": magnitudes[-1] if magnitudes else 0.0}


SHIPPED_PATH = os.path.join(os.path.dirname(__file__), "machine_models.json")


def load_models(path: str = SHIPPED_PATH) -> dict[int, MachineModel]:
    """{ranks: model} from a file scripts/fit_machine_models.py wrote."""
    with open(path) as file:
        document = json.load(file)
    return {int(p): MachineModel.from_dict(fields) for p, fields in document["models"].items()}


SHIPPED = load_models()


def shipped_model(ranks: int) -> MachineModel:
    """The model minimp ships for this many ranks. For a count it was not fitted at, the terms
    measured at the nearest fitted count below it (or the smallest) with the Python of `ranks`
    ranks: the messages' and adds' cost under a different sharing of cores is a guess."""
    if ranks in SHIPPED:
        return SHIPPED[ranks]
    below = [p for p in SHIPPED if p <= ranks]
    nearest = max(below) if below else min(SHIPPED)
    name = f"{SHIPPED[nearest].name} (terms measured at {nearest} ranks, used at {ranks})"
    return dataclasses.replace(SHIPPED[nearest], ranks=ranks, name=name)


@dataclass(frozen=True)
class FastestPredicted:
    """An all-reduce policy (minimp.distributed.AlgorithmPolicy): the algorithm a model predicts
    fastest for each message. `model`: a MachineModel, a textbook Network (costmodel.py), or None
    for the model minimp ships for the job's number of ranks. Pass it as `algorithm=` to
    distributed.allreduce or PersistentAllreduce; every rank evaluates the same constants, so all
    pick alike. Ties go to the algorithm distributed.ALGORITHMS lists first."""

    model: MachineModel | Network | None = None

    def __call__(self, nbytes: int, world_size: int) -> str:
        candidates = tuple(distributed.ALGORITHMS)
        if self.model is None:
            return _shipped_choice(nbytes, world_size)
        if isinstance(self.model, Network):
            return costmodel.fastest_allreduce(nbytes, world_size, self.model, candidates)
        return self.model.fastest(nbytes, candidates)


@lru_cache(maxsize=4096)
def _shipped_choice(nbytes: int, world_size: int) -> str:
    # The shipped model is constants, so its answer per (size, ranks) never changes: evaluating
    # it costs ~5 us of Python per call, as much as a 4 KiB message, and a cache lookup ~0.1 us.
    return shipped_model(world_size).fastest(nbytes, tuple(distributed.ALGORITHMS))
