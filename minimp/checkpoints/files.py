"""The files a run writes: checked before the first step, written atomically, never half-written.

A run must never be lost at its end: every output path is tried before training starts (its folder
exists or can be made, it is neither a folder nor a device, pipe or socket, which a rename would
replace, and a file can be created there). Every file is then
written to a temporary file beside its target and renamed over it in one step, so a reader sees the
old file or the new one, never a mix; a temporary file left by a killed run is removed by the next
save to the same path. Files get the user's normal mode (0666 less the umask), not the 0600 of a
temporary file.
"""

import json
import os
import signal
import sys
import tempfile
from typing import IO, Callable

from minimp.checkpoints.errors import ConfigError

TEMPORARY_SUFFIX = ".minimp-tmp"


def check_output_path(flag: str, path: str, suffixes: tuple[str, ...] = ()) -> None:
    """Raise ConfigError unless a file can be written at path (the folders on the way are made
    now, as the save would make them). `suffixes`: the extensions that may be used, if limited."""
    if suffixes and os.path.splitext(path)[1].lower().lstrip(".") not in suffixes:
        raise ConfigError(f"{flag} {path}: use one of the extensions {', '.join(suffixes)}")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a folder; give a file name inside it")
    if os.path.exists(path) and not os.path.isfile(path):  # the rename would replace the node
        raise ConfigError(f"{flag} {path} is not a regular file (a device, a pipe, a socket), "
                          "which the save would replace; give a file's path")
    folder = os.path.dirname(os.path.abspath(path))
    above = folder
    while not os.path.exists(above):  # the nearest part of the path that exists must be a folder
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ConfigError(f"{flag} {path}: {above} is a file, not a folder; choose another path")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass  # a file can be created there: the real one can be renamed into place
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is read-only")
    except OSError as error:
        reason = error.strerror or str(error)
        raise ConfigError(f"{flag} {path} cannot be written ({reason}); choose another path")


def atomic_write(path: str, write: Callable[[IO[bytes]], object]) -> None:
    """write(file) into a temporary file beside path, flushed to disk, then renamed over path."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temporaries(path)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.",
                                         suffix=TEMPORARY_SUFFIX)
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    except BaseException:  # SystemExit from SIGTERM too: leave no stray file behind
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def remove_stale_temporaries(path: str) -> None:
    """Delete temporary files of our own naming for this path, left by a run that was killed."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}."
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith(TEMPORARY_SUFFIX):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass  # another process took it first


def keep_metrics_up_to(path: str, step: int) -> None:
    """On resume: keep the rows of steps <= step, drop the rest (a killed run's later steps and
    summary rows), atomically, so the file never holds the same step twice."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as file:
        for line in file:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by a kill: nothing after it is trustworthy
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                if record["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    atomic_write(path, lambda file: file.write("".join(kept).encode()))


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (what `kill` and job schedulers send) into SystemExit, so `finally` blocks and
    atomic_write's clean-up run instead of the process vanishing mid-write."""

    def terminate(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread (a simulated rank): leave the default
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
