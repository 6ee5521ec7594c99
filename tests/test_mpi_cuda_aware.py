"""minimp/distributed/mpi.py's mpi_is_cuda_aware in this process: MINIMP_CUDA_AWARE_MPI=0/1 is
taken over what the loaded MPI library answers, here a stand-in for a CUDA-aware Open MPI found
in the process's memory map."""

import contextlib

import pytest

from minimp.distributed import mpi as mpi_module


class CudaAwareLibrary:
    """What ctypes.CDLL opens for a CUDA-aware Open MPI: MPIX_Query_cuda_support says yes."""

    def __init__(self, path):
        self.path = path

    def MPIX_Query_cuda_support(self):
        return 1


@pytest.mark.parametrize("override, aware", [("0", False), ("1", True), (None, True)])
def test_minimp_cuda_aware_mpi_overrides_what_the_library_says(override, aware, monkeypatch):
    # the library loaded in this stand-in process is a CUDA-aware Open MPI
    maps = ["7f00-7f01 r-xp 00000000 08:01 42 /opt/openmpi/lib/libmpi.so.40\n"]
    read_maps = lambda path: contextlib.nullcontext(maps)  # noqa: E731 (the builtin open's stand-in)
    monkeypatch.setattr(mpi_module, "open", read_maps, raising=False)
    monkeypatch.setattr(mpi_module.ctypes, "CDLL", CudaAwareLibrary)
    if override is None:
        monkeypatch.delenv("MINIMP_CUDA_AWARE_MPI", raising=False)
    else:
        monkeypatch.setenv("MINIMP_CUDA_AWARE_MPI", override)
    assert mpi_module.mpi_is_cuda_aware() is aware
