"""minimp/distributed/staging.py's defaults, pinned on the CPU: host_staged sums unless told
otherwise, and copies through CupyCopies when no copier is given (a NumPy stand-in replaces it
here; tests/test_gpu_staging.py checks the copies and bits, and the real CuPy path on a GPU)."""

import numpy as np
from conftest import DeviceLike

from minimp import distributed as dist
from minimp.distributed import staging
from minimp.distributed.ring import ring_allreduce
from minimp.distributed.staging import host_staged


class HostCopies:
    """DeviceCopies for NumPy arrays standing in for device arrays; counts its instances."""

    made = 0

    def __init__(self):
        type(self).made += 1

    def pinned_empty(self, size, dtype):
        return np.empty(size, dtype)

    def flat(self, x):
        return np.ascontiguousarray(x).reshape(-1)

    def output(self, x, out):
        return np.empty(x.size, x.dtype) if out is None else out.reshape(-1)

    def to_host(self, device_flat, host):
        host[...] = device_flat

    def to_device(self, host, device_flat):
        device_flat[...] = host


def test_host_staged_sums_unless_told_otherwise():
    def staged(comm):
        x = np.array([[1.0, -2.0], [0.5, 8.0]], np.float32) * (comm.rank + 1)
        return host_staged(ring_allreduce, comm, x, copies=HostCopies())

    for result in dist.simulate(3, staged):
        np.testing.assert_array_equal(result, [[6.0, -12.0], [3.0, 48.0]])


def test_host_staged_without_a_copier_copies_through_cupy_copies(monkeypatch):
    monkeypatch.setattr(staging, "CupyCopies", HostCopies)
    monkeypatch.setattr(HostCopies, "made", 0)
    x = np.array([1.0, 2.0, 4.0], np.float32)
    results = dist.simulate(2, lambda comm: host_staged(ring_allreduce, comm, x * (comm.rank + 1)))
    assert HostCopies.made == 2  # one per rank, made by host_staged itself
    for result in results:
        np.testing.assert_array_equal(result, [3.0, 6.0, 12.0])


def test_a_staged_ring_writes_into_the_out_it_is_given(monkeypatch):
    # ring_allreduce hands a device array on a staging communicator to host_staged, `out` included
    monkeypatch.setattr(staging, "CupyCopies", HostCopies)

    def into_buffer(comm):
        comm.stages_device_arrays = True  # what an MPI that is not CUDA-aware says
        x = (np.array([[1.0, 2.0], [4.0, 8.0]], np.float32) * (comm.rank + 1)).view(DeviceLike)
        out = np.full((2, 2), np.nan, np.float32)
        result = ring_allreduce(comm, x, out=out)
        return np.shares_memory(result, out), out

    for shares, out in dist.simulate(2, into_buffer):
        assert shares
        np.testing.assert_array_equal(out, [[3.0, 6.0], [12.0, 24.0]])
