"""minimp/distributed/mpi.py's MPICommunicator in this process, around a stand-in for the mpi4py
communicator that records what it is handed: which buffer reaches MPI (a host array as it is, a
device array as a host copy when MPI is not CUDA-aware), the broadcast's default root, and what
the watchdog would say the rank waits for. The real messages are checked under mpirun
(tests/test_distributed_mpi.py)."""

import numpy as np
import pytest

from minimp import backend
from minimp.distributed.mpi import MPICommunicator


class OneRank:
    """An mpi4py communicator of one rank that records each Bcast and writes `incoming` into it."""

    def __init__(self, incoming=None):
        self.incoming, self.calls, self.owner = incoming, [], None

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Bcast(self, message, root):
        buffer, _ = message
        waiting = self.owner.waiting
        self.calls.append((buffer, root, None if waiting is None else waiting.describe()))
        if self.incoming is not None:
            buffer[...] = self.incoming


def communicator(incoming=None):
    mpi = OneRank(incoming)
    comm = MPICommunicator(mpi)
    mpi.owner = comm
    return comm, mpi


class FakeDeviceArray:
    """Looks like a CuPy array to backend.is_device_array; get() is its host copy."""

    __module__ = "cupy.stand_in"

    def __init__(self, values):
        self.values = values

    def get(self):
        return self.values.copy()

    def __setitem__(self, key, value):
        self.values[key] = value


def test_bcast_broadcasts_from_rank_0_unless_told_otherwise():
    comm, mpi = communicator()
    x = np.arange(3, dtype=np.float32)
    comm.bcast(x)
    ((buffer, root, _),) = mpi.calls
    assert root == 0 and buffer is x
    assert (comm.bytes_sent, comm.messages_sent) == (12, 1)  # the root's bytes


def test_a_watched_bcast_says_it_waits_for_a_broadcast_from_the_root():
    comm, mpi = communicator()
    comm.start_watchdog(3600.0)
    try:
        comm.bcast(np.zeros(2, np.float32))
    finally:
        comm._watchdog.fired = True  # ends the watchdog's thread
    assert mpi.calls[0][2] == "broadcast from rank 0"
    assert comm.waiting is None  # cleared once MPI returned


@pytest.mark.parametrize(
    "make", [np.array, lambda values: values.view(np.recarray)], ids=["ndarray", "recarray"]
)
def test_a_host_array_goes_to_mpi_as_it_is_and_is_not_copied_back(make, monkeypatch):
    # a host array of any ndarray type: no host copy, no staging, no to_device on the way back,
    # even where MPI cannot read GPU memory
    monkeypatch.setenv("MINIMP_CUDA_AWARE_MPI", "0")
    monkeypatch.setattr(backend, "to_device", lambda array: pytest.fail("copied back"))
    comm, mpi = communicator(incoming=np.float32(5.0))
    x = make(np.arange(4, dtype=np.float32))
    comm.bcast(x)
    assert mpi.calls[0][0] is x
    np.testing.assert_array_equal(np.asarray(x), [5.0, 5.0, 5.0, 5.0])


def test_a_device_array_goes_through_a_host_copy_when_mpi_is_not_cuda_aware(monkeypatch):
    monkeypatch.setenv("MINIMP_CUDA_AWARE_MPI", "0")
    comm, mpi = communicator(incoming=np.float32(5.0))
    device = FakeDeviceArray(np.arange(4, dtype=np.float32))
    comm.bcast(device)
    ((buffer, _, _),) = mpi.calls
    assert type(buffer) is np.ndarray and not np.shares_memory(buffer, device.values)
    np.testing.assert_array_equal(device.values, [5.0, 5.0, 5.0, 5.0])  # copied back
