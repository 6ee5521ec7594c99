"""Execute the lessons and store their outputs in the notebooks, as the slow tier checks them.

    python scripts/execute_lessons.py            # every lesson
    python scripts/execute_lessons.py 3 11       # lessons 3 and 11

Each notebook runs top to bottom in a fresh kernel started in an empty folder (nothing may depend
on lessons/ being the working directory), under the OpenBLAS kernel the test suite pins
(tests/conftest.py says why), and is written back with its outputs: the repository's web page then
shows every printed figure and plot. `tests/lessons/test_notebooks.py` runs them again with nbval
and compares what they print with what is stored, lines lessons/sanitize.cfg masks aside.
"""

import argparse
import os
import sys
import tempfile
import time

# Before anything loads NumPy (the kernel inherits this environment): the suite's kernel.
os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")
os.environ.setdefault("OPENBLAS_L2_SIZE", "512")

import nbclient  # noqa: E402
import nbformat  # noqa: E402

LESSONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lessons")


def notebooks(numbers: list[int]) -> list[str]:
    """lessons/NN_*.ipynb for the numbers asked (all when none), in order."""
    names = sorted(name for name in os.listdir(LESSONS) if name.endswith(".ipynb"))
    chosen = [name for name in names if not numbers or int(name.split("_")[0]) in numbers]
    missing = set(numbers) - {int(name.split("_")[0]) for name in chosen}
    if missing:
        raise SystemExit(f"no lesson numbered {sorted(missing)}: the lessons are {names}")
    return [os.path.join(LESSONS, name) for name in chosen]


def execute(path: str, store: bool = True) -> float:
    """Run the notebook at `path` in a fresh kernel in an empty folder and, with `store`, write it
    back with its outputs. Returns the seconds it took, the kernel's start included."""
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as folder:
        client = nbclient.NotebookClient(
            notebook, timeout=300, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": folder}},
        )
        start = time.perf_counter()
        client.execute()  # raises CellExecutionError, naming the cell, on any error
        seconds = time.perf_counter() - start
    if store:
        nbformat.write(notebook, path)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("numbers", nargs="*", type=int, help="lesson numbers (default: all)")
    args = parser.parse_args(argv)
    for path in notebooks(args.numbers):
        print(f"{os.path.basename(path)}: {execute(path):.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
