"""Benchmark: the error of a gradient reduced over an fp8 wire, against the float32 reduction.

    python benchmarks/wire_bench.py                  # p = 2, 4, 8 ranks, 2^16 elements each
    python benchmarks/wire_bench.py --ranks 2 4 8 16 --size 1048576 --seed 1

On the simulated world (ranks are threads), every rank holds a gradient g_r = s + n_r (a signal
the replicas share plus noise of their own, both standard normal, as the minibatch gradients of
replicas are), multiplied by 1/p as DataParallel's default "before" averaging sends it. Each cell
is ||reduced - reference|| / ||reference||, with reference minimp's float32 ring reduction of the
same arrays, over the chunks the ranks own after the reduce-scatter (or the whole array, for the
all-reduce):

  ring RS    the ring's reduce-scatter, each partial sum requantized at each of the p - 1 hops
  once RS    the one-shot reduce-scatter: every share quantized once, sent straight to its owner
  ring AR    the whole fp8 all-reduce: the ring's reduce-scatter, then the owner's sum quantized
             once more for the all-gather (what --grad-comm-dtype fp8 does to the gradient)
  bf16 AR    minimp's ring all-reduce with a bfloat16 wire, for scale

for E4M3 and E5M2 values (minimp/precision/wire.py says why --grad-comm-dtype fp8 takes E4M3).
"""

import argparse

import numpy as np

from minimp.distributed.ring import chunk_bounds, ring_allreduce
from minimp.distributed.ring_fp8 import fp8_reduce_scatter_into, fp8_ring_allreduce_into
from minimp.distributed.ring_fp8 import quantized_reduce_scatter_once
from minimp.distributed.simulated import simulate
from minimp.precision.casting import BFLOAT16
from minimp.precision.wire import WIRE_FORMATS, Fp8Wire


def gradients(ranks: int, size: int, seed: int) -> list[np.ndarray]:
    """Each rank's float32 gradient, shared signal plus its own noise, times 1/ranks."""
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(size)
    return [((signal + rng.standard_normal(size)) / ranks).astype(np.float32)
            for _ in range(ranks)]


def relative_error(got: np.ndarray, reference: np.ndarray) -> float:
    """||got - reference|| / ||reference||, in float64."""
    difference = got.astype(np.float64) - reference.astype(np.float64)
    return float(np.linalg.norm(difference) / np.linalg.norm(reference.astype(np.float64)))


def one_world(comm, grads: list[np.ndarray], formats: list[str]) -> dict[str, np.ndarray]:
    """On one rank: the float32 reference, and each method's result (a chunk or the whole)."""
    x = grads[comm.rank]
    bounds = chunk_bounds(x.size, comm.size)
    start, stop = bounds[comm.rank]
    reference = ring_allreduce(comm, x)
    results = {"reference": reference, "bf16 AR": ring_allreduce(comm, x.astype(BFLOAT16))}
    for name in formats:
        wire = Fp8Wire(WIRE_FORMATS[name])
        out = np.empty_like(x)
        fp8_reduce_scatter_into(comm, x, out, bounds, wire)
        results[f"{name} ring RS"] = out[start:stop].copy()
        results[f"{name} once RS"] = quantized_reduce_scatter_once(comm, x, wire)
        fp8_ring_allreduce_into(comm, x, out, wire)
        results[f"{name} ring AR"] = out.copy()
    results["chunk"] = reference[start:stop]
    return results


def table(ranks: list[int], size: int, seed: int, formats: list[str]) -> list[dict[str, float]]:
    """One row per world size: each method's relative error (chunks over all owners)."""
    rows = []
    for p in ranks:
        per_rank = simulate(p, one_world, gradients(p, size, seed), formats)
        chunks = np.concatenate([r["chunk"] for r in per_rank])
        row: dict[str, float] = {"p": p}
        for key in per_rank[0]:
            if key.endswith("RS"):
                row[key] = relative_error(np.concatenate([r[key] for r in per_rank]), chunks)
            elif key.endswith("AR"):
                whole = per_rank[0][key]
                assert all(np.array_equal(r[key].view(np.uint8), whole.view(np.uint8))
                           for r in per_rank), "replicas differ"
                row[key] = relative_error(whole.astype(np.float32), per_rank[0]["reference"])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--size", type=int, default=2**16, help="elements of each gradient")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    formats = list(WIRE_FORMATS)
    rows = table(args.ranks, args.size, args.seed, formats)
    keys = [k for k in rows[0] if k != "p"]
    print(f"relative error against the float32 ring, {args.size} elements per rank, "
          f"seed {args.seed}; replicas bit-identical after every all-reduce")
    print("| p | " + " | ".join(k.replace("fp8_e5m2", "E5M2").replace("fp8", "E4M3")
                              for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for row in rows:
        print(f"| {row['p']} | " + " | ".join(f"{row[k]:.2e}" for k in keys) + " |")


if __name__ == "__main__":
    main()
