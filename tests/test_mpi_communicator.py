"""minimp/distributed/mpi.py's MPICommunicator in this process, around a stand-in for the mpi4py
communicator that records what it is handed: which buffer reaches MPI (a host array as it is, a
device array as a host copy when MPI is not CUDA-aware), the broadcast's default root, and what
the watchdog would say the rank waits for, the counters; one message to itself on the real
one-rank world. The real messages are checked under mpirun
(tests/test_distributed_mpi.py)."""

import numpy as np
import pytest

from minimp import backend
from minimp import distributed as dist
from minimp.distributed.mpi import MPICommunicator


class OneRank:
    """An mpi4py communicator of one rank that records each call; a Bcast gets `incoming`."""

    def __init__(self, incoming=None):
        self.incoming, self.calls, self.owner = incoming, [], None

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def waits_for(self):
        waiting = self.owner.waiting
        return None if waiting is None else waiting.describe()

    def Bcast(self, message, root):
        buffer, _ = message
        self.calls.append((buffer, root, self.waits_for()))
        if self.incoming is not None:
            buffer[...] = self.incoming

    def Allreduce(self, values, result, op):
        self.calls.append((values.copy(), op, self.waits_for()))
        result[...] = values

    def Sendrecv(self, sendbuf, **kwargs):
        """A message to itself: the receive buffer gets the send buffer's bytes, and the status
        says how many arrived (as MPI's would)."""
        (send, _), (recv, _) = sendbuf, kwargs.pop("recvbuf")
        status = kwargs.pop("status")
        self.calls.append(("Sendrecv", kwargs, self.waits_for()))
        recv.reshape(-1).view(np.uint8)[: send.nbytes] = send.reshape(-1).view(np.uint8)
        status.Set_elements(self.owner._MPI.BYTE, send.nbytes)

    def Barrier(self):
        self.calls.append(("Barrier", self.waits_for()))

    def Split_type(self, kind):
        self.calls.append(("Split_type", kind))
        return Node(self.calls)

    def Split(self, color, key):
        self.calls.append(("Split", color, key, self.waits_for()))
        return OneRank()


class Node:
    """What Split_type returns: this rank is number 2 of 3 on its machine."""

    def __init__(self, calls):
        self.calls = calls

    def Get_rank(self):
        return 2

    def Get_size(self):
        return 3

    def Free(self):
        self.calls.append("Free")


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


def watched(comm):
    """Start comm's watchdog (an hour: it never fires here) and return a function that stops it."""
    comm.start_watchdog(3600.0)

    def stop():
        comm._watchdog.fired = True  # ends the watchdog's thread

    return stop


def test_a_watched_bcast_says_it_waits_for_a_broadcast_from_the_root():
    comm, mpi = communicator()
    stop = watched(comm)
    try:
        comm.bcast(np.zeros(2, np.float32))
    finally:
        stop()
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


def test_a_new_communicator_has_sent_nothing_and_waits_for_nothing():
    comm, _ = communicator()
    assert (comm.rank, comm.size) == (0, 1)
    assert (comm.bytes_sent, comm.messages_sent, comm.scalar_allreduces) == (0, 0, 0)
    assert comm.waiting is None


def test_the_bytes_and_messages_a_root_broadcasts_add_up():
    comm, _ = communicator()
    comm.bcast(np.zeros(3, np.float32))
    comm.bcast(np.zeros(5, np.float64))
    assert (comm.bytes_sent, comm.messages_sent) == (12 + 40, 2)


def test_an_unwatched_communicator_records_no_wait():
    # the two attribute writes are for the watchdog: without one, none is made
    comm, mpi = communicator()
    comm.bcast(np.zeros(2, np.float32))
    comm.barrier()
    assert mpi.calls[0][2] is None and mpi.calls[1] == ("Barrier", None)


def test_allreduce_scalars_hands_mpi_float64_values_and_its_max_by_default():
    comm, mpi = communicator()
    result = comm.allreduce_scalars([3, -1])
    again = comm.allreduce_scalars(np.array([2.5]), op="min")
    total = comm.allreduce_scalars((1, 2, 3), op="sum")
    assert result.dtype == np.float64 and result.tolist() == [3.0, -1.0]
    assert again.tolist() == [2.5] and total.tolist() == [1.0, 2.0, 3.0]
    values, ops = [call[0] for call in mpi.calls], [call[1] for call in mpi.calls]
    assert [v.dtype for v in values] == [np.float64] * 3 and values[0].tolist() == [3.0, -1.0]
    assert ops == [comm._MPI.MAX, comm._MPI.MIN, comm._MPI.SUM]
    assert comm.scalar_allreduces == 3
    with pytest.raises(ValueError, match="op must be one of"):
        comm.allreduce_scalars([1.0], op="mean")


def test_each_blocking_call_tells_a_watchdog_what_it_waits_for_and_clears_it():
    comm, mpi = communicator()
    stop = watched(comm)
    try:
        comm.allreduce_scalars([1.0], op="sum")
        assert comm.waiting is None
        comm.barrier()
        assert comm.waiting is None
        child = comm.split(5)
        assert comm.waiting is None
    finally:
        stop()
    assert mpi.calls[0][2] == "all-reduce (sum) with all 1 ranks"
    assert mpi.calls[1] == ("Barrier", "meet all 1 ranks at a barrier")
    assert mpi.calls[2] == ("Split", 5, 0, "split the communicator with all ranks")
    # the child is watched by the same watchdog
    assert child._watchdog is comm._watchdog and child in comm._watchdog.watched


def test_split_of_an_unwatched_communicator_gives_an_unwatched_child():
    comm, mpi = communicator()
    child = comm.split(1, key=4)
    assert isinstance(child, MPICommunicator) and (child.rank, child.size) == (0, 1)
    assert child._watchdog is None and mpi.calls == [("Split", 1, 4, None)]


def test_the_node_is_asked_of_mpi_as_the_ranks_sharing_memory_and_freed():
    comm, mpi = communicator()
    assert comm.node_rank_and_size() == (2, 3)
    assert comm.ranks_on_this_node() == 3
    shared = ("Split_type", comm._MPI.COMM_TYPE_SHARED)
    assert mpi.calls == [shared, "Free", shared, "Free"]


@pytest.mark.parametrize("aware", ["0", "1"])
def test_device_arrays_are_staged_exactly_when_mpi_is_not_cuda_aware(aware, monkeypatch, capsys):
    monkeypatch.setenv("MINIMP_CUDA_AWARE_MPI", aware)
    comm, _ = communicator()
    assert comm.stages_device_arrays == (aware == "0")
    assert comm.stages_device_arrays == (aware == "0")  # asked once, said once
    said = (
        "minimp.distributed: this MPI is not CUDA-aware; "
        "GPU buffers are staged through host memory\n"
    )
    assert capsys.readouterr().err == (said if aware == "0" else "")


def test_the_world_is_mpi_comm_world_and_a_message_to_itself_arrives_whole():
    comm = dist.world()
    assert (comm.rank, comm.size) == (0, 1)
    x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    comm.sendrecv(x, 0, y, 0, tag=3)  # the byte count is read from the reused status
    np.testing.assert_array_equal(y, x)
    assert (comm.bytes_sent, comm.messages_sent) == (16, 1)


def test_sendrecv_hands_mpi_the_peers_and_by_default_tag_0_both_ways():
    comm, mpi = communicator()
    x, y = np.arange(3, dtype=np.float32), np.zeros(3, np.float32)
    comm.sendrecv(x, 0, y, 0)
    assert mpi.calls == [("Sendrecv", dict(dest=0, sendtag=0, source=0, recvtag=0), None)]
    np.testing.assert_array_equal(y, x)
    assert (comm.bytes_sent, comm.messages_sent) == (12, 1)
    assert comm.waiting is None


def test_sendrecv_receives_with_recv_tag_when_given_one_and_else_with_the_send_tag():
    comm, mpi = communicator()
    x, y = np.ones(2, np.float32), np.zeros(2, np.float32)
    comm.sendrecv(x, 0, y, 0, tag=3, recv_tag=7)
    comm.sendrecv(x, 0, y, 0, tag=3)
    tags = [(call[1]["sendtag"], call[1]["recvtag"]) for call in mpi.calls]
    assert tags == [(3, 7), (3, 3)]


def test_a_watched_sendrecv_says_both_peers_and_clears_it():
    comm, mpi = communicator()
    stop = watched(comm)
    try:
        comm.sendrecv(np.ones(2, np.float32), 0, np.zeros(2, np.float32), 0)
    finally:
        stop()
    assert mpi.calls[0][2] == "send to rank 0 and receive from rank 0"
    assert comm.waiting is None


def test_a_sendrecv_message_shorter_than_its_buffer_is_an_error_naming_the_source():
    comm, _ = communicator()
    with pytest.raises(ValueError, match="received 12 bytes from rank 0 into a 16-byte buffer"):
        comm.sendrecv(np.ones(3, np.float32), 0, np.zeros(4, np.float32), 0)



class Truncating(OneRank):
    """A one-rank communicator whose every receive fails with the MPI error class it is given."""

    def __init__(self, error_class):
        super().__init__()
        self.error_class = error_class

    def fail(self):
        from mpi4py import MPI

        self.calls.append(self.waits_for())
        raise MPI.Exception(self.error_class)

    def Sendrecv(self, sendbuf, **kwargs):
        self.fail()

    def Recv(self, message, **kwargs):
        self.fail()

    def Irecv(self, message, **kwargs):
        return type("Request", (), {"Wait": lambda _, status: self.fail()})()


def truncating(error_class):
    mpi = Truncating(error_class)
    comm = MPICommunicator(mpi)
    mpi.owner = comm
    return comm, mpi


@pytest.mark.parametrize("receive", ["sendrecv", "recv", "irecv"])
def test_a_message_longer_than_its_buffer_is_the_size_error_a_short_one_is(receive):
    # MPI truncates it and raises MPI_ERR_TRUNCATE; a collective catches MessageSizeError alone
    from mpi4py import MPI

    comm, mpi = truncating(MPI.ERR_TRUNCATE)
    stop = watched(comm)
    buffer = np.zeros(4, np.float32)
    try:
        with pytest.raises(dist.protocol.MessageSizeError) as caught:
            if receive == "sendrecv":
                comm.sendrecv(np.ones(4, np.float32), 0, buffer, 0)
            elif receive == "recv":
                comm.recv(buffer, 0)
            else:
                comm.irecv(buffer, 0).wait()
    finally:
        stop()
    assert str(caught.value) == (
        "received more than 16 bytes from rank 0 into a 16-byte buffer (MPI truncated it): the "
        "ranks disagree on the array's length or dtype")
    assert mpi.calls[-1] is not None and comm.waiting is None  # watched, then cleared


def test_any_other_mpi_error_is_raised_as_mpi_raised_it():
    from mpi4py import MPI

    comm, _ = truncating(MPI.ERR_OTHER)
    with pytest.raises(MPI.Exception) as caught:
        comm.recv(np.zeros(4, np.float32), 0)
    assert caught.value.Get_error_class() == MPI.ERR_OTHER and comm.waiting is None
