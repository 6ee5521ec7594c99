"""minimp/distributed/mpi.py's mpi_is_cuda_aware in this process: MINIMP_CUDA_AWARE_MPI=0/1 is
taken over what the loaded MPI library answers; without it, the libmpi found in the process's
memory map (/proc/self/maps) is opened and asked, MPICH >= 4 by MPIX_GPU_query_support, Open MPI
by MPIX_Query_cuda_support. The memory map and the libraries are stand-ins; every other file the
code opens is the real file system's, and ctypes.CDLL fails, as the real one does, for a path
that holds no library."""

import builtins
import contextlib
import ctypes

import pytest

from minimp.distributed import mpi as mpi_module

MPICH = "/opt/mpich/lib/libmpi.so.12"
OPEN_MPI = "/opt/openmpi/lib/libmpi.so.40"


def maps_of(library):
    """/proc/self/maps lines of a process that loaded `library`: its segments (the same path on
    each), an anonymous mapping (no path: five fields) and the heap."""
    return [
        f"7f3a10000000-7f3a10028000 r--p 00000000 103:02 1311 {library}\n",
        f"7f3a10028000-7f3a10200000 r-xp 00028000 103:02 1311 {library}\n",
        f"7f3a10300000-7f3a10310000 rw-p 00300000 103:02 1311 {library}\n",
        "7f3a10310000-7f3a10320000 rw-p 00000000 00:00 0\n",
        "55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0 [heap]\n",
    ]


class ThisProgram:
    """What ctypes.CDLL(None) opens: the python executable, which exports no MPIX function."""


class Mpich:
    """An MPICH >= 4 library: MPIX_GPU_query_support(gpu_type, int *supported) writes `answer`
    through its pointer (a real ctypes function, so ctypes.byref is what it must be given) and
    records the gpu_type it was asked about."""

    def __init__(self, answer):
        self.asked = []

        def query(gpu_type, supported):
            self.asked.append(gpu_type)
            supported[0] = answer
            return 0  # MPI_SUCCESS

        prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
        self.MPIX_GPU_query_support = prototype(query)


class OpenMpi:
    """An Open MPI library: MPIX_Query_cuda_support() says yes."""

    def MPIX_Query_cuda_support(self):
        return 1


@pytest.fixture
def process(monkeypatch):
    """Make this process one that loaded the library `path` -> `library` (None: what
    ctypes.CDLL(None) opens, the program itself), with MINIMP_CUDA_AWARE_MPI unset."""

    def load(path, library):
        def open_(file, *args, **kwargs):
            if file == "/proc/self/maps":
                return contextlib.nullcontext(maps_of(path))
            return builtins.open(file, *args, **kwargs)

        libraries = {None: ThisProgram(), path: library}

        def cdll(name):
            if name not in libraries:
                raise OSError(f"{name}: cannot open shared object file: No such file or directory")
            return libraries[name]

        monkeypatch.setattr(mpi_module, "open", open_, raising=False)
        monkeypatch.setattr(mpi_module.ctypes, "CDLL", cdll)
        monkeypatch.delenv("MINIMP_CUDA_AWARE_MPI", raising=False)

    return load


@pytest.mark.parametrize("override, aware", [("0", False), ("1", True), (None, True)])
def test_minimp_cuda_aware_mpi_overrides_what_the_library_says(
    override, aware, process, monkeypatch
):
    process(OPEN_MPI, OpenMpi())  # a CUDA-aware Open MPI
    if override is not None:
        monkeypatch.setenv("MINIMP_CUDA_AWARE_MPI", override)
    assert mpi_module.mpi_is_cuda_aware() is aware


@pytest.mark.parametrize("answer", [0, 1], ids=["no", "yes"])
def test_an_mpich_in_the_memory_map_is_asked_about_cuda_and_its_answer_taken(answer, process):
    # MPICH has no MPIX_Query_cuda_support: only its own query can say yes
    mpich = Mpich(answer)
    process(MPICH, mpich)
    assert mpi_module.mpi_is_cuda_aware() is bool(answer)
    assert mpich.asked == [0]  # MPIX_GPU_SUPPORT_CUDA, once for the three segments
