"""The files a run writes: checked before the first step, written atomically, never half-written.

A run must never be lost at its end: every output path is tried before training starts (its folder
exists or can be made, it is neither a folder nor a device, pipe or socket, which a rename would
replace, and a file can be created there), and a file already at a path is replaced only by one of
its own kind (a checkpoint by a checkpoint, metrics by metrics), never by a file of another kind
(a --metrics naming a checkpoint, say) unless --force says so. Every file is then
written to a temporary file beside its target and renamed over it in one step, so a reader sees the
old file or the new one, never a mix; a temporary file left by a killed run is removed by the next
save to the same path. Files get the user's normal mode (0666 less the umask), not the 0600 of a
temporary file.
"""

import json
import os
import signal
import tempfile
import zipfile
from typing import IO, Callable

import numpy

from minimp.checkpoints.errors import ConfigError, Terminated

TEMPORARY_SUFFIX = ".minimp-tmp"


def check_output_path(flag: str, path: str, suffixes: tuple[str, ...] = ()) -> None:
    """Raise ConfigError unless a file can be written at path (the folders on the way are made
    now, as the save would make them). `suffixes`: the extensions that may be used, if limited."""
    if not path:
        raise ConfigError(f"{flag} is empty; give a file name")
    if path.endswith((os.sep, "/")):  # "newdir/": a folder, which the save would not be
        raise ConfigError(f"{flag} {path!r} names a folder, not a file; give a file name (as "
                          f"{os.path.join(path, 'out')!r})")
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


# What each kind of output may replace, by what file_kind() finds there; a file of any other kind
# is refused (or needs --force): the flag was most likely given the wrong name.
REPLACEABLE = {"checkpoint": ("empty", "checkpoint"), "metrics": ("empty", "metrics"),
               "timeline": ("empty", "timeline"), "plot": ("empty", "plot"),
               "json": ("empty", "json")}
KIND_NAMES = {"empty": "an empty file", "checkpoint": "a minimp checkpoint",
              "archive": "a zip archive that is not a minimp checkpoint (an .npz, a .docx?)",
              "metrics": "a run's metrics (JSON lines)", "timeline": "a run's timeline (a trace)",
              "plot": "a plot minimp drew", "image": "an image minimp did not draw",
              "json": "JSON text", "text": "text that is not JSON",
              "binary": "binary data of an unknown kind"}
# The first bytes of the image formats; a plot minimp drew names matplotlib in its first or last
# bytes (png, svg, eps and ps near the start, pdf in the document information at its end).
_IMAGE_MAGIC = (b"\x89PNG", b"%PDF", b"%!PS", b"\xc5\xd0\xd3\xc6", b"\xff\xd8\xff", b"II*\x00",
                b"MM\x00*", b"RIFF", b"\x1f\x8b", b"<svg", b"<?xml", b"GIF8")
PLOT_FORMATS = ("eps", "pdf", "png", "ps", "svg")  # the ones whose files say matplotlib drew them
_SNIFFED = 4096


def file_kind(path: str) -> str:
    """What the file at path holds, from its first and last bytes: one of KIND_NAMES' keys."""
    with open(path, "rb") as file:
        head = file.read(_SNIFFED)
        file.seek(max(file.seek(0, os.SEEK_END) - _SNIFFED, 0))
        tail = file.read()
    if not head:
        return "empty"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # a zip, as an .npz is
        return "checkpoint" if read_meta(path) is not None else "archive"
    if head.startswith(_IMAGE_MAGIC):
        return "plot" if b"matplotlib" in (head + tail).lower() else "image"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:  # a character cut by the read is still text
        if error.start < len(head) - 4:
            return "binary"
        text = head[: error.start].decode("utf-8")
    if text.lstrip()[:1] not in ("{", "["):
        return "text"
    if '"traceEvents"' in text[:64]:  # a timeline starts with its events
        return "timeline"
    try:
        first = json.loads(text.splitlines()[0])
    except ValueError:
        return "json"
    return "metrics" if isinstance(first, dict) and "step" in first else "json"


def read_meta(path: str) -> dict | None:
    """A minimp checkpoint's meta (its JSON object; only that member of the archive is read), or
    None for any other file."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open("meta.npy") as member:
            meta = json.loads(str(numpy.lib.format.read_array(member, allow_pickle=False)))
    except (KeyError, ValueError, OSError, zipfile.BadZipFile, EOFError):
        return None
    format_name = meta.get("format", "") if isinstance(meta, dict) else ""
    return meta if str(format_name).startswith("minimp-checkpoint") else None


def check_replaceable(flag: str, path: str, kind: str, force: bool | None = False) -> None:
    """Raise ConfigError if a file at path holds another kind of output than `kind` (a key of
    REPLACEABLE) and `force` is not True: replacing it would lose what it holds. `force` None:
    the command has no --force (the message does not offer it)."""
    if force or not os.path.isfile(path):
        return
    found = file_kind(path)
    if found not in REPLACEABLE[kind]:
        fix = "choose another path, or pass --force" if force is False else "choose another path"
        raise ConfigError(f"{flag} {path} exists and holds {KIND_NAMES[found]}, which this "
                          f"output would replace; {fix}")


def check_output(flag: str, path: str, kind: str, force: bool | None = False,
                 suffixes: tuple[str, ...] = ()) -> None:
    """Raise ConfigError unless `flag`'s output, a file of `kind` (a key of REPLACEABLE), can be
    written at path without losing a file of another kind: check_output_path and
    check_replaceable, what every command that writes a file checks before any work."""
    check_output_path(flag, path, suffixes)
    check_replaceable(flag, path, kind, force)


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (through links too), existing or not yet."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


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
    with open(path, "rb") as file:  # bytes: a damaged line must not stop the reading
        for line in file:
            try:
                record = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                break  # a line cut short by a kill: nothing after it is trustworthy
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                if record["step"] <= step:
                    kept.append(line if line.endswith(b"\n") else line + b"\n")
    atomic_write(path, lambda file: file.write(b"".join(kept)))


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (what `kill` and job schedulers send) into the exception Terminated, a kind
    of KeyboardInterrupt: `finally` blocks and atomic_write's clean-up run instead of the process
    vanishing mid-write, and the command ends as on Ctrl-C, in one line, with status 143."""

    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    try:
        signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread (a simulated rank): leave the default
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
