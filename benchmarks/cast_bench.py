"""Benchmark: minimp's float16 casts (NumPy and numba paths) against NumPy's astype, and a check.

    python benchmarks/cast_bench.py                 # ns/element on 262,144 elements (512 x 512)
    python benchmarks/cast_bench.py --size 4194304  # arrays larger than the caches
    python benchmarks/cast_bench.py --json          # one JSON object for machines
    python benchmarks/cast_bench.py --exhaustive    # all 2^32 float32 bit patterns against astype

Every path is timed round-robin (one call of each in turn, so drift on a shared machine hits all
alike) and each median is printed as a ratio against NumPy's astype in the same direction, measured
in the same run. A float32 copy shows the floor any cast could reach; ml_dtypes' bfloat16 casts show
what a vectorised 16-bit cast costs in NumPy (minimp keeps them: they are near the floor already).
"""

import argparse
import json
import statistics
import sys
import time

import ml_dtypes
import numpy as np

from minimp.precision import halfcast, halfcast_numba

F16, F32, BF16 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)


def inputs(size, seed=0):
    """{case: (array, target dtype)}: typical values (a standard normal, like activations), ones
    whose float16 form is subnormal (magnitudes 2^-25 to 2^-14) or infinite (2^16 to 2^40)."""
    rng = np.random.default_rng(seed)
    normal32 = rng.standard_normal(size).astype(F32)
    signs = rng.choice([-1.0, 1.0], size)
    tiny32 = (signs * 2.0 ** rng.uniform(-25, -14, size)).astype(F32)
    huge32 = (signs * 2.0 ** rng.uniform(16, 40, size)).astype(F32)
    subnormal16 = rng.integers(0, 0x400, size, dtype=np.uint16) | (rng.integers(0, 2, size) << 15)
    return {
        "float32 -> float16": (normal32, F16),
        "float32 -> float16, subnormal results": (tiny32, F16),
        "float32 -> float16, overflow to infinity": (huge32, F16),
        "float16 -> float32": (normal32.astype(F16), F32),
        "float16 -> float32, subnormal inputs": (subnormal16.astype(np.uint16).view(F16), F32),
    }


def paths(parallel):
    """{path: cast(array, dtype)} for the paths this machine has."""
    found = {
        "astype": lambda array, dtype: array.astype(dtype),
        "numpy": lambda array, dtype: _ours(array, dtype, "numpy"),
    }
    if halfcast_numba.available():
        found["numba"] = lambda array, dtype: _ours(array, dtype, "numba")
        if parallel:
            found["numba parallel"] = lambda array, dtype: halfcast_numba.cast(array, dtype, True)
    return found


def _ours(array, dtype, implementation):
    if dtype == F16:
        return halfcast.to_float16(array, implementation)
    return halfcast.to_float32(array, implementation)


def median_ns(functions, size, repeats):
    """{name: median ns per element}, timing the functions round-robin after one warm-up each."""
    for function in functions.values():
        function()
    samples = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) / size * 1e9 for name, times in samples.items()}


def speeds(size, repeats, parallel):
    """{case: {path: ns per element}}; the reference rows (copy, bfloat16) sit under the cases."""
    functions = {}
    cases = inputs(size)
    with np.errstate(over="ignore"):
        for case, (array, dtype) in cases.items():
            for path, cast in paths(parallel).items():
                functions[(case, path)] = lambda c=cast, a=array, d=dtype: c(a, d)
        normal32 = cases["float32 -> float16"][0]
        brain16 = normal32.astype(BF16)
        functions[("float32 copy (the floor)", "astype")] = normal32.copy
        functions[("float32 -> bfloat16 (ml_dtypes)", "astype")] = lambda: normal32.astype(BF16)
        functions[("bfloat16 -> float32 (ml_dtypes)", "astype")] = lambda: brain16.astype(F32)
        measured = median_ns(functions, size, repeats)
    table = {}
    for (case, path), ns in measured.items():
        table.setdefault(case, {})[path] = ns
    return table


def reference_of(case, row):
    """Which astype row a row is compared with: a cast its own; a reference row its direction."""
    if "numpy" in row:
        return case
    return "float16 -> float32" if case.startswith("bfloat16 ->") else "float32 -> float16"


def print_table(table, size, repeats):
    names = list(next(iter(table.values())))
    print(
        f"float16 casts, {size:,} elements, median of {repeats} round-robin, ns per element "
        f"(x NumPy's float16 astype in this run)"
    )
    print(f"  {'case':<42}" + "".join(f"{name:>17}" for name in names))
    for case, row in table.items():
        baseline = table[reference_of(case, row)]["astype"]
        cells = [f"{row[name]:.2f} ({row[name] / baseline:.2f}x)" for name in names if name in row]
        print(f"  {case:<42}" + "".join(f"{cell:>17}" for cell in cells))


def exhaustive(implementations, chunk_bits=24):
    """Every float32 bit pattern, a chunk of 2^chunk_bits at a time, against NumPy's astype; and all
    65,536 float16 patterns widened. Returns the counts, the first mismatches and the seconds."""
    start = time.perf_counter()
    checked, mismatches, examples = 0, dict.fromkeys(implementations, 0), []
    low_bits = np.arange(1 << chunk_bits, dtype=np.uint32)
    for high in range(1 << (32 - chunk_bits)):
        bits = low_bits | np.uint32(high << chunk_bits)
        with np.errstate(over="ignore"):
            expected = bits.view(F32).astype(F16).view(np.uint16)
        for implementation in implementations:
            got = halfcast.to_float16(bits.view(F32), implementation).view(np.uint16)
            wrong = np.nonzero(got != expected)[0]
            mismatches[implementation] += wrong.size
            examples += [
                (implementation, int(bits[i]), int(got[i]), int(expected[i])) for i in wrong[:3]
            ]
        checked += bits.size
        if high % 32 == 31:
            print(f"  {checked:,} patterns, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    all16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(F16)
    for implementation in implementations:
        got = halfcast.to_float32(all16, implementation).view(np.uint32)
        mismatches[implementation] += np.count_nonzero(got != all16.astype(F32).view(np.uint32))
    return {
        "float32_patterns": checked,
        "float16_patterns": all16.size,
        "mismatches": mismatches,
        "examples": examples[:10],
        "seconds": time.perf_counter() - start,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1 << 18, help="elements per array")
    parser.add_argument("--repeats", type=int, default=31, help="timed calls per path")
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="also time numba's prange version (its idle threads spin, slowing the other paths)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--exhaustive", action="store_true", help="check all 2^32 float32 bit patterns instead"
    )
    parser.add_argument(
        "--paths", default="numba", help="for --exhaustive: comma-separated, of numba and numpy"
    )
    args = parser.parse_args(argv)
    if args.exhaustive:
        result = exhaustive(args.paths.split(","))
        if args.json:
            print(json.dumps(result))
            return
        counts = ", ".join(
            f"{name}: {count:,} mismatches" for name, count in result["mismatches"].items()
        )
        print(
            f"{result['float32_patterns']:,} float32 and {result['float16_patterns']:,} float16 "
            f"bit patterns against NumPy's astype; {counts}; {result['seconds']:.0f} s"
        )
        for implementation, bits, got, expected in result["examples"]:
            print(f"  {implementation}: {bits:#010x} -> {got:#06x}, NumPy's {expected:#06x}")
        return
    table = speeds(args.size, args.repeats, parallel=args.parallel)
    if args.json:
        print(json.dumps({"size": args.size, "repeats": args.repeats, "ns_per_element": table}))
    else:
        print_table(table, args.size, args.repeats)


if __name__ == "__main__":
    main()
