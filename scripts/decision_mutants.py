"""Decision mutants: plant each hand-written flip of a decision the package takes, one at a time,
in a copy of minimp/, and run the one test that must catch it.

    python scripts/decision_mutants.py                 # every mutant of tests/decision_mutants.json
    python scripts/decision_mutants.py ID ...          # only these
    python scripts/decision_mutants.py --list          # the ids

mutmut's operators (a `+` made `-`, a constant changed) rarely flip a decision as a person gets it
wrong: the clipping done before the unscaling, an overflow decided by one rank alone, a sum kept in
float16. Each entry of tests/decision_mutants.json is such a flip, written by hand: `find` (text
that occurs exactly once in `file`) becomes `replace`, and `test` (one pytest node id) must fail.

The working tree is never changed (a kill -9 leaves it clean): minimp/ is copied into a temporary
folder, the replacement made there, and pytest started in that folder with PYTHONPATH pointing at
it, so the tests and every process they start (mpirun, `python -m minimp.train`) import the copy.
Before any mutant, every `find` must occur exactly once, the copy must be what `import minimp`
finds, and every test must pass on the unmutated copy. A test that fails (or runs past the
timeout) kills its mutant. Exit status 1 when any mutant survived, 2 for a bad entry.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MUTANTS = os.path.join(ROOT, "tests", "decision_mutants.json")
FIELDS = ("id", "decision", "file", "find", "replace", "test")


def load(path: str = MUTANTS) -> list[dict]:
    """The entries of the mutants file, in its order."""
    with open(path) as file:
        return json.load(file)


def bad_finds(entries: list[dict]) -> list[str]:
    """One line per entry whose `find` does not occur exactly once in its file."""
    problems = []
    for entry in entries:
        with open(os.path.join(ROOT, entry["file"])) as file:
            count = file.read().count(entry["find"])
        if count != 1:
            problems.append(f"{entry['id']}: `find` occurs {count} times in {entry['file']}")
    return problems


def copy_package(folder: str) -> None:
    """minimp/ copied into folder (without caches: a stale .pyc must not stand in for a mutant)."""
    shutil.copytree(os.path.join(ROOT, "minimp"), os.path.join(folder, "minimp"),
                    ignore=shutil.ignore_patterns("__pycache__"))


def mutate(folder: str, entry: dict) -> None:
    """Make the entry's one replacement in folder's copy of its file."""
    path = os.path.join(folder, entry["file"])
    with open(path) as file:
        source = file.read()
    with open(path, "w") as file:
        file.write(source.replace(entry["find"], entry["replace"], 1))


def environment(folder: str) -> dict[str, str]:
    """This process's environment with folder first on PYTHONPATH (inherited by subprocesses)."""
    paths = [folder, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def imported_from(folder: str) -> str:
    """Where `import minimp` finds the package in a process started as the tests start theirs."""
    command = [sys.executable, "-c", "import minimp; print(minimp.__file__)"]
    found = subprocess.run(command, cwd=folder, env=environment(folder), capture_output=True,
                           text=True, check=True)
    return found.stdout.strip()


def run_tests(folder: str, tests: list[str], timeout: float) -> tuple[int | None, str]:
    """pytest on the tests (node ids relative to the repository), started in folder so that the
    copy, not the working tree, is the minimp it imports; returns its exit status (None on a
    timeout) and its output."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               *(os.path.join(ROOT, test) for test in tests)]
    try:
        done = subprocess.run(command, cwd=folder, env=environment(folder), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:g} s"
    return done.returncode, done.stdout + done.stderr


def check_unmutated(entries: list[dict], timeout: float) -> str | None:
    """Why the mutants cannot be judged (a copy that is not what gets imported, a test that fails
    without any mutant), or None."""
    with tempfile.TemporaryDirectory(prefix="decision-mutants-") as folder:
        copy_package(folder)
        where = imported_from(folder)
        if not where.startswith(os.path.join(folder, "minimp")):
            return f"`import minimp` finds {where}, not the copy in {folder}"
        tests = list(dict.fromkeys(entry["test"] for entry in entries))
        status, output = run_tests(folder, tests, timeout * len(tests))
        if status != 0:
            return "a test fails on the unmutated code:\n" + output[-3000:]
    return None


def run_mutant(entry: dict, timeout: float) -> tuple[bool, float]:
    """(killed, seconds) of one mutant."""
    with tempfile.TemporaryDirectory(prefix="decision-mutant-") as folder:
        copy_package(folder)
        mutate(folder, entry)
        started = time.perf_counter()
        status, _ = run_tests(folder, [entry["test"]], timeout)
        return status != 0, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="run only these mutants (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants' ids and stop")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one mutant's test may run before it counts as killed")
    args = parser.parse_args(argv)
    entries = load()
    if args.list:
        print("\n".join(entry["id"] for entry in entries))
        return 0
    unknown = sorted(set(args.ids) - {entry["id"] for entry in entries})
    if unknown:
        parser.error(f"no mutant {', '.join(unknown)} in {MUTANTS} (--list names them)")
    chosen = [entry for entry in entries if not args.ids or entry["id"] in args.ids]
    problems = bad_finds(chosen)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    reason = check_unmutated(chosen, args.timeout)
    if reason:
        print(f"decision_mutants.py: error: {reason}", file=sys.stderr)
        return 2
    killed = 0
    for entry in chosen:
        dead, seconds = run_mutant(entry, args.timeout)
        killed += dead
        verdict = "killed" if dead else "SURVIVED"
        print(f"{verdict:9} {entry['id']:44} {entry['test']}  {seconds:.1f} s", flush=True)
    share = 100.0 * killed / len(chosen) if chosen else 100.0
    print(f"decision mutants: {killed} of {len(chosen)} killed ({share:.0f}%)")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
