"""How long each lesson takes from a fresh kernel: the lessons' 20-second target, measured.

    python benchmarks/lessons_bench.py              # every lesson, once
    python benchmarks/lessons_bench.py 13 15 -r 3   # lessons 13 and 15, three runs each

Each run starts a kernel in an empty folder and executes the notebook top to bottom, as
scripts/execute_lessons.py does (nothing is written back); the time includes the kernel's start.
The target is 20 s on this machine's 2 cores with nothing else running: say what else ran when
you record a figure (lessons/README.md holds the last table).
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from execute_lessons import execute, notebooks  # noqa: E402

TARGET_SECONDS = 20.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("numbers", nargs="*", type=int, help="lesson numbers (default: all)")
    parser.add_argument("-r", "--repeats", type=int, default=1, help="runs per lesson")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    print(f"| lesson | seconds (median of {args.repeats}) | runs | within {TARGET_SECONDS:.0f} s |")
    print("| --- | --- | --- | --- |")
    for path in notebooks(args.numbers):
        runs = [execute(path, store=False) for _ in range(args.repeats)]
        median = statistics.median(runs)
        listed = ", ".join(f"{seconds:.1f}" for seconds in runs)
        print(f"| {os.path.basename(path)} | {median:.1f} | {listed} | "
              f"{'yes' if median <= TARGET_SECONDS else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
