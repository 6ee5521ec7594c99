"""Lessons that start MPI jobs: find the repository's scripts from any working directory, run them
under this interpreter's mpirun, and show the job's own error when it fails.

A notebook has no `__file__`, and a kernel may start in any folder, so paths like
`../mpirun_examples/x.py` only work from `lessons/`. The repository is found instead from where
minimp is imported (an editable install: `pip install -e .`), or else from the working directory
and its parents.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import minimp

MARKERS = ("mpirun_examples", "lessons")  # folders only the repository's root has, together


def repository_root() -> Path:
    """The root of the minimp checkout these lessons belong to."""
    candidates = [Path(minimp.__file__).resolve().parents[1]]
    candidates += [Path.cwd().resolve(), *Path.cwd().resolve().parents]
    for folder in candidates:
        if all((folder / marker).is_dir() for marker in MARKERS):
            return folder
    raise FileNotFoundError(
        "the lessons run scripts from a checkout of the minimp repository, and none was found "
        f"(minimp is imported from {Path(minimp.__file__).parent}; the working directory is "
        f"{Path.cwd()}): install the checkout with `pip install -e .`, or start Jupyter inside it"
    )


def mpirun_command() -> str:
    """The mpirun next to this interpreter (the mpich wheel's), else the one on PATH."""
    found = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if found is None:
        raise FileNotFoundError("no mpirun found: pip install -e '.[mpi]' brings one (mpich)")
    return found


class JobFailed(RuntimeError):
    """An MPI job (or a script) ended with a non-zero status; the message holds its stderr."""


def run_job(ranks: int, arguments: list[str], timeout: float = 300) -> str:
    """`mpirun -n ranks python ARGUMENTS...` in the repository root; returns its stdout.
    Raises JobFailed with the command, the exit status and the job's stderr when it fails."""
    command = [mpirun_command(), "-n", str(ranks), sys.executable, *arguments]
    done = subprocess.run(
        command,
        cwd=repository_root(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise JobFailed(
            f"`{' '.join(command[1:])}` exited with status {done.returncode}; its stderr:\n"
            + (done.stderr.strip() or "(empty)")
            + ("\nits stdout:\n" + done.stdout.strip()[-2000:] if done.stdout.strip() else "")
        )
    return done.stdout


def run_script(ranks: int, script: str, *arguments: str, timeout: float = 300) -> str:
    """Run a script of the repository (a path from its root) on `ranks` MPI ranks."""
    path = repository_root() / script
    if not path.is_file():
        raise FileNotFoundError(f"{script} is not in the repository at {repository_root()}")
    return run_job(ranks, [str(path), *arguments], timeout=timeout)


def run_json(ranks: int, script: str, *arguments: str, timeout: float = 300) -> Any:
    """run_script for a script that prints one JSON document; JobFailed shows what it printed
    instead when that is not JSON."""
    output = run_script(ranks, script, *arguments, timeout=timeout)
    try:
        return json.loads(output)
    except json.JSONDecodeError:
        raise JobFailed(
            f"{script} printed something that is not JSON:\n{output.strip()[-2000:] or '(nothing)'}"
        ) from None
