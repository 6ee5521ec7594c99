"""Host staging of GPU arrays: one copy each way per collective, the same bits as the host ring.

The staging logic runs here with NumPy arrays standing in for device arrays and a copier that
counts; on a GPU (skipped without CuPy) the staged ring on CuPy arrays is checked under mpirun.
"""

import os
import subprocess

import numpy as np
import pytest
from conftest import MPIRUN, PYTHON, requires_gpu

from minimp.distributed import simulate
from minimp.distributed.ring import ring_allreduce
from minimp.distributed.staging import host_staged, stages_through_host


class CountingCopies:
    """DeviceCopies for NumPy 'device' arrays: plain host buffers, every call counted."""

    def __init__(self):
        self.calls = {"pinned_empty": 0, "to_host": 0, "to_device": 0}

    def pinned_empty(self, size, dtype):
        self.calls["pinned_empty"] += 1
        return np.empty(size, dtype)

    def flat(self, x):
        return np.ascontiguousarray(x).reshape(-1)

    def output(self, x, out):
        return np.empty(x.size, x.dtype) if out is None else out.reshape(-1)

    def to_host(self, device_flat, host):
        self.calls["to_host"] += 1
        host[...] = device_flat

    def to_device(self, host, device_flat):
        self.calls["to_device"] += 1
        device_flat[...] = host


def bits(array):
    return array.view(np.uint16 if array.dtype == np.float16 else np.uint32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_a_staged_ring_copies_once_each_way_and_gives_the_host_rings_bits(ranks, dtype):
    """Whatever p is: one copy in, one copy out, two pinned buffers; the result is the ring's
    on the same host data, bit for bit, with the input left as it was."""

    def body(comm):
        rng = np.random.default_rng(comm.rank)
        x = (rng.standard_normal((37, 5)) * 100).astype(dtype)
        before = x.copy()
        copies = CountingCopies()
        staged = host_staged(ring_allreduce, comm, x, "sum", copies=copies)
        plain = ring_allreduce(comm, x)
        np.testing.assert_array_equal(bits(x), bits(before))
        return staged, plain, copies.calls

    for staged, plain, calls in simulate(ranks, body):
        assert staged.shape == plain.shape == (37, 5)
        np.testing.assert_array_equal(bits(staged), bits(plain))
        assert calls == {"pinned_empty": 2, "to_host": 1, "to_device": 1}


def test_a_staged_ring_writes_into_out():
    def body(comm):
        x = np.full(10, comm.rank + 1.0, np.float32)
        out = np.zeros(10, np.float32)
        result = host_staged(ring_allreduce, comm, x, "max", out=out, copies=CountingCopies())
        return np.shares_memory(result, out), out

    for shares, out in simulate(3, body):
        assert shares and np.all(out == 3.0)


class FakeDeviceArray:
    """Looks like a CuPy array to backend.is_device_array (its type's module is cupy's)."""

    __module__ = "cupy.fake"


class Comm:
    def __init__(self, size, stages):
        self.size, self.stages_device_arrays = size, stages


def test_only_device_arrays_on_a_staging_communicator_with_peers_are_staged():
    assert stages_through_host(Comm(2, True), FakeDeviceArray())
    assert not stages_through_host(Comm(2, False), FakeDeviceArray())  # CUDA-aware MPI
    assert not stages_through_host(Comm(1, True), FakeDeviceArray())  # nobody to send to
    assert not stages_through_host(Comm(2, True), np.ones(3))  # host arrays go as they are
    simulated = type("Simulated", (), {"size": 2})()  # no stages_device_arrays at all
    assert not stages_through_host(simulated, FakeDeviceArray())


def test_the_ring_hands_a_staged_array_to_host_staged(monkeypatch):
    from minimp.distributed import ring

    calls = []
    monkeypatch.setattr(ring, "host_staged", lambda *args: calls.append(args) or "staged")
    comm, x = Comm(2, True), FakeDeviceArray()
    assert ring.ring_allreduce(comm, x, "max") == "staged"
    assert calls == [(ring.ring_allreduce, comm, x, "max", None)]


STAGED_RING = """
import cupy, numpy as np
from minimp import backend
from minimp import distributed as dist
from minimp.distributed.ring import ring_allreduce
from minimp.distributed.staging import stages_through_host
comm = dist.world(); backend.use_device('gpu', comm.rank)
for dtype in (np.float32, np.float16):
    for size in (1, 1000, 1 << 20):
        host = (np.random.default_rng(comm.rank).standard_normal(size) * 10).astype(dtype)
        device = cupy.asarray(host)
        assert stages_through_host(comm, device) == comm.stages_device_arrays
        staged = ring_allreduce(comm, device)
        assert type(staged).__module__.startswith('cupy')
        expected = ring_allreduce(comm, host)
        view = np.uint16 if dtype == np.float16 else np.uint32
        assert np.array_equal(staged.get().view(view), expected.view(view)), (dtype, size)
print('ok', comm.rank, comm.stages_device_arrays, flush=True)
"""


@pytest.mark.gpu
@requires_gpu
@pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH")
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_staged_ring_on_cupy_arrays_gives_the_host_rings_bits(ranks):
    result = subprocess.run(
        [MPIRUN, "-n", str(ranks), PYTHON, "-c", STAGED_RING],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok") == ranks
