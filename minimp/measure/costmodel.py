"""The alpha-beta(-gamma) cost model of collectives and pipelines: predict before you measure.

A message of n bytes costs alpha + n * beta (Hockney's model: alpha is the latency, 1/beta
the bandwidth); reducing n bytes costs n * gamma. The all-reduce formulas are those of
Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005), with p ranks:

  ring                2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
  naive (to root)     2(p-1) (alpha + n beta) + (p-1) n gamma
  binomial tree       2 ceil(log2 p) (alpha + n beta) + ceil(log2 p) n gamma  (reduce, broadcast)
  recursive doubling  floor(log2 p) (alpha + n beta + n gamma), + 2 (alpha + n beta) + n gamma
                      unless p = 2^k (fold in and out)
  Rabenseifner        2 log2(p) alpha + 2(p-1)/p n beta + (p-1)/p n gamma

An all-to-all of a rank's n bytes, chunk j to rank j and its own chunk kept home (minimp's
distributed/alltoall.py; Ulysses' four a pass, --ep's dispatch and combine), by pairwise
exchange (the algorithm MPICH uses for long messages, Thakur et al. 2005): p - 1 messages of n/p
bytes, one to and one from each other rank,

  all-to-all          (p-1) alpha + (p-1)/p n beta                     (nothing is reduced)

A message that travels while a block is computed (the ring attention's hops: each hop's key/value
block is sent before the block in hand is computed) costs max(compute, alpha + n beta) a hop, so
of h hops

  exposed behind compute   h max(0, alpha + n beta - compute)            (the rest is hidden)

Bus bandwidth is nccl-tests' figure of merit: busbw = algbw * 2(p-1)/p with algbw = n / time, so a
bandwidth-optimal all-reduce shows the link's speed whatever p is.
"""

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Network:
    alpha: float  # seconds per message
    beta: float  # seconds per byte on the wire
    gamma: float = 0.0  # seconds per byte reduced
    name: str = ""


# Fitted on this project's 2-core machine (MPICH wheel, shared memory, minimp's Python
# collectives) with `mpirun -n 2 python mpirun_examples/allreduce_bench.py` (its "fitted:"
# line), at p = 2 where each rank has a core of its own; alpha includes Python's per-message
# overhead (~10 us here). At p = 4 the ranks are oversubscribed and every term is slower
# (that run fits alpha ~50 us, 1/beta ~4 GB/s).
THIS_MACHINE = Network(alpha=15e-6, beta=1 / 8.7e9, gamma=1 / 12.9e9,
                       name="2-core VM, MPICH shared memory")
# A stated network for predictions at scale:
# 200 Gb/s InfiniBand-class links, 5 us latency, GPU reduce.
DATACENTER = Network(alpha=5e-6, beta=1 / 25e9, gamma=1 / 1e12, name="200 Gb/s links, 5 us latency")


def _bandwidth_optimal(latencies: float, nbytes: float, p: int, net: Network) -> float:
    """`latencies` alpha, plus what a reduce-scatter and an all-gather move and add: each rank
    sends 2(p-1)/p n bytes and reduces (p-1)/p n (the ring's and Rabenseifner's; 0 for p = 1)."""
    if p == 1:
        return 0.0
    share = (p - 1) / p
    return latencies * net.alpha + 2 * share * nbytes * net.beta + share * nbytes * net.gamma


def ring_allreduce_time(nbytes: float, p: int, net: Network) -> float:
    return _bandwidth_optimal(2 * (p - 1), nbytes, p, net)


def naive_allreduce_time(nbytes: float, p: int, net: Network) -> float:
    return 2 * (p - 1) * (net.alpha + nbytes * net.beta) + (p - 1) * nbytes * net.gamma


def binomial_tree_allreduce_time(nbytes: float, p: int, net: Network) -> float:
    rounds = math.ceil(math.log2(p)) if p > 1 else 0
    return 2 * rounds * (net.alpha + nbytes * net.beta) + rounds * nbytes * net.gamma


def recursive_doubling_allreduce_time(nbytes: float, p: int, net: Network) -> float:
    rounds = int(math.floor(math.log2(p))) if p > 1 else 0
    fold = 0.0 if p & (p - 1) == 0 else 2 * (net.alpha + nbytes * net.beta) + nbytes * net.gamma
    return rounds * (net.alpha + nbytes * (net.beta + net.gamma)) + fold


def rabenseifner_allreduce_time(nbytes: float, p: int, net: Network) -> float:
    return _bandwidth_optimal(2 * math.log2(p), nbytes, p, net)


ALLREDUCE_MODELS = {
    "ring": ring_allreduce_time,
    "naive": naive_allreduce_time,
    "binomial_tree": binomial_tree_allreduce_time,
    "recursive_doubling": recursive_doubling_allreduce_time,
    "rabenseifner": rabenseifner_allreduce_time}


def allreduce_time(algorithm: str, nbytes: float, p: int, network: Network | None = None) -> float:
    """Predicted seconds for one all-reduce of nbytes over p ranks."""
    return ALLREDUCE_MODELS[algorithm](nbytes, p, network or THIS_MACHINE)


def fastest_allreduce(nbytes: float, p: int, network: Network | None = None,
                      candidates: Sequence[str] | None = None) -> str:
    """The candidate with the smallest predicted time (ties go to the earlier name)."""
    names = candidates or tuple(ALLREDUCE_MODELS)
    return min(names, key=lambda name: allreduce_time(name, nbytes, p, network))


def bus_bandwidth(nbytes: float, seconds: float, p: int) -> float:
    """busbw = algbw * 2(p-1)/p, as nccl-tests define it for all-reduce, with algbw the bytes of
    the array divided by the time of the collective."""
    return nbytes / seconds * 2 * (p - 1) / p


def fit_alpha_beta(nbytes: Sequence[float] | np.ndarray,
                   seconds: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """(alpha, beta) of seconds = alpha + nbytes * beta by least squares on the *relative* error, so
    a 1 KiB message and a 16 MiB one count alike; both are clipped at 0."""
    seconds = np.asarray(seconds, float)
    design = np.stack([np.ones(len(nbytes)), np.asarray(nbytes, float)], axis=1) / seconds[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones(len(seconds)), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def alltoall_time(nbytes: float, p: int, net: Network) -> float:
    """Predicted seconds of a pairwise all-to-all of each rank's nbytes over p ranks (module
    docstring): (p-1) alpha + (p-1)/p n beta; 0 for p = 1."""
    if p == 1:
        return 0.0
    return (p - 1) * net.alpha + (p - 1) / p * nbytes * net.beta


def exposed_behind_compute(hop_seconds: float, compute_seconds: float, hops: int) -> float:
    """Seconds of `hops` messages of hop_seconds each that a block of compute_seconds does not
    hide, the message sent before its block is computed (module docstring): each hop takes
    max(compute, message), so hops x max(0, message - compute) of it is the message's alone."""
    return hops * max(0.0, hop_seconds - compute_seconds)


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe or 1F1B step with P equal stages and M micro-batches:
    (P - 1) / (M + P - 1) (Huang et al. 2019)."""
    return (stages - 1) / (micro_batches + stages - 1)


def overlapped_exposed_time(bucket_bytes: Sequence[float], backward_seconds: float, p: int,
                            net: Network) -> float:
    """Predicted exposed seconds of a gradient all-reduce that overlaps backward: bucket i (in the
    order backward completes them) is ready once backward has done its share of the work, taken
    as its share of the bytes (a Linear's backward costs in proportion to its weights); its ring
    starts when it is ready and the ring before it is done; exposed is what runs past backward's
    end. Without overlap every ring runs after backward: sum of ring_allreduce_time. Assumes the
    rings take nothing from the compute (a GPU's copy engines and NICs; not a shared CPU core)."""
    total, ready, end = sum(bucket_bytes), 0.0, 0.0
    for nbytes in bucket_bytes:
        ready += backward_seconds * nbytes / total
        end = max(end, ready) + ring_allreduce_time(nbytes, p, net)
    return max(0.0, end - backward_seconds)
