"""The communicator over real MPI: the only module that calls mpi4py.

Arrays travel as raw bytes with the uppercase buffer methods (Send, Recv, Sendrecv, Bcast): nothing
is pickled, and float16/bfloat16 need no MPI datatype (MPI libraries disagree on half precision).
All reductions of array data happen in minimp's own code; MPI's Allreduce is used only for a few
scalars (flags, lengths), where it is the simplest correct tool. CuPy arrays are synchronised and
staged through host memory (the GPU issue adds CUDA-aware transfers).
"""

import ctypes
import os
import sys

import numpy as np

from minimp import backend

_MPI_OPS = ("max", "min", "sum")


def byte_view(array):
    """The array's memory as a flat uint8 array (no copy); it must be C-contiguous."""
    if not array.flags.c_contiguous:
        raise ValueError("communication needs a C-contiguous array (use numpy.ascontiguousarray)")
    return array.reshape(-1).view(np.uint8)


def mpi_is_cuda_aware():
    """True when the loaded MPI library accepts GPU memory (MPIX_GPU_query_support in MPICH >= 4,
    MPIX_Query_cuda_support in Open MPI); MINIMP_CUDA_AWARE_MPI=0/1 overrides. The PyPI mpich
    wheel answers no."""
    override = os.environ.get("MINIMP_CUDA_AWARE_MPI")
    if override in ("0", "1"):
        return override == "1"
    try:
        with open("/proc/self/maps") as maps:
            libraries = {line.split()[-1] for line in maps if "libmpi" in line.split()[-1]}
    except OSError:
        return False
    for path in sorted(libraries):
        library = ctypes.CDLL(path)
        if hasattr(library, "MPIX_GPU_query_support"):
            supported = ctypes.c_int(0)
            library.MPIX_GPU_query_support(0, ctypes.byref(supported))  # 0 = MPIX_GPU_SUPPORT_CUDA
            return bool(supported.value)
        if hasattr(library, "MPIX_Query_cuda_support"):
            return bool(library.MPIX_Query_cuda_support())
    return False


class MPICommunicator:
    """A group of MPI processes with the minimp communicator API (see minimp/dist/simulated.py)."""

    def __init__(self, mpi_comm):
        self._comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.bytes_sent = 0  # counted for metrics: what this rank put on the wire
        self.messages_sent = 0
        self._cuda_aware = None  # asked once, at the first GPU buffer
        from mpi4py import MPI

        self._status = MPI.Status()  # reused: one allocation less per message

    def __repr__(self):
        return f"MPICommunicator(rank={self.rank}, size={self.size})"

    def _on_host(self, array):
        """(buffer to hand MPI, whether it is a host copy of a device array). A CUDA-aware MPI reads
        GPU memory itself (after the stream is synchronised); otherwise the bytes go through host
        memory, which this rank says once."""
        if not backend.is_device_array(array):
            return array, False
        backend.synchronize()
        if self._cuda_aware is None:
            self._cuda_aware = mpi_is_cuda_aware()
            if not self._cuda_aware and self.rank == 0:
                print(
                    "minimp.dist: this MPI is not CUDA-aware; GPU buffers are staged through host "
                    "memory",
                    file=sys.stderr,
                    flush=True,
                )
        if self._cuda_aware:
            return array, False
        return array.get(), True

    def send(self, array, dest, tag=0):
        from mpi4py import MPI

        host, _ = self._on_host(array)
        buffer = byte_view(host)
        self._comm.Send([buffer, MPI.BYTE], dest=dest, tag=tag)
        self._count(buffer)

    def recv(self, array, source, tag=0):
        """Receive into `array` (its size must equal the message's)."""
        from mpi4py import MPI

        host, staged = self._on_host(array)
        buffer = byte_view(host)
        status = MPI.Status()
        self._comm.Recv([buffer, MPI.BYTE], source=source, tag=tag, status=status)
        _check_count(status.Get_count(MPI.BYTE), buffer.nbytes, source)
        if staged:
            array[...] = backend.to_device(host)

    def sendrecv(self, send_array, dest, recv_array, source, tag=0, recv_tag=None):
        """Send to dest and receive from source at once: no ordering of the two can deadlock.
        The receive matches `recv_tag` (default: the same tag as the send)."""
        from mpi4py import MPI

        send_host, _ = self._on_host(send_array)
        recv_host, staged = self._on_host(recv_array)
        send_buffer, recv_buffer = byte_view(send_host), byte_view(recv_host)
        status = self._status
        self._comm.Sendrecv(
            [send_buffer, MPI.BYTE],
            dest=dest,
            sendtag=tag,
            recvbuf=[recv_buffer, MPI.BYTE],
            source=source,
            recvtag=tag if recv_tag is None else recv_tag,
            status=status,
        )
        _check_count(status.Get_count(MPI.BYTE), recv_buffer.nbytes, source)
        self._count(send_buffer)
        if staged:
            recv_array[...] = backend.to_device(recv_host)  # GPU memory of this rank's device

    def bcast(self, array, root=0):
        """Overwrite `array` on every rank with root's (in place)."""
        from mpi4py import MPI

        host, staged = self._on_host(array)
        buffer = byte_view(host)
        self._comm.Bcast([buffer, MPI.BYTE], root=root)
        if self.rank == root:
            self._count(buffer)
        if staged:
            array[...] = backend.to_device(host)

    def allreduce_scalars(self, values, op="max"):
        """Reduce a few float64 scalars (flags, lengths) over all ranks; returns a new float64
        array."""
        from mpi4py import MPI

        if op not in _MPI_OPS:
            raise ValueError(f"op must be one of {_MPI_OPS}, got {op!r}")
        values = np.ascontiguousarray(values, dtype=np.float64)
        result = np.empty_like(values)
        self._comm.Allreduce(
            values, result, op={"max": MPI.MAX, "min": MPI.MIN, "sum": MPI.SUM}[op]
        )
        return result

    def barrier(self):
        self._comm.Barrier()

    def ranks_on_this_node(self):
        """How many ranks of this communicator share this machine (MPI_COMM_TYPE_SHARED)."""
        return self.node_rank_and_size()[1]

    def node_rank_and_size(self):
        """(this rank's number among the ranks on its machine, how many there are)."""
        from mpi4py import MPI

        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_rank(), local.Get_size()
        finally:
            local.Free()

    def split(self, color, key=0):
        """Sub-communicators: ranks with the same color form one, ordered by key (then old rank)."""
        return MPICommunicator(self._comm.Split(color, key))

    def abort(self, code=1):
        """End every process of the job (MPI_Abort on COMM_WORLD)."""
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)

    def _count(self, buffer):
        self.bytes_sent += buffer.nbytes
        self.messages_sent += 1


def _check_count(received, expected, source):
    if received != expected:
        raise ValueError(
            f"received {received} bytes from rank {source} into a {expected}-byte buffer: "
            "the ranks disagree on the array's length or dtype"
        )


def world():
    """The communicator over MPI.COMM_WORLD (size 1 under plain `python`)."""
    from mpi4py import MPI

    return MPICommunicator(MPI.COMM_WORLD)
