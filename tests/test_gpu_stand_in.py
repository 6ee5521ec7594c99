"""Device arrays stay on the device: buffers, the ring's all-gather, DataParallel's buckets, ZeRO's
overlapped rings and stage 3's gathered and freed units, each run on DeviceLike arrays (conftest)
with a stand-in `cupy` installed.

What the stand-in may honestly stand for: NumPy functions that CuPy takes over through
__array_function__ (moveaxis, empty_like) return CuPy arrays for CuPy input, and return DeviceLike
arrays here too. NumPy's creation functions do not dispatch (numpy.empty, ascontiguousarray and
lib.stride_tricks.as_strided have no __array_function__ hook): on a GPU they make host arrays, or
raise TypeError when they must read a CuPy array (CuPy refuses implicit conversion); here they
make plain ndarrays. So a plain ndarray in a result below is a host array (or an error) on a GPU.
"""

import sys

import numpy as np
from conftest import DeviceLike, cupy_stand_in

from minimp import Tensor, nn, ops
from minimp import distributed as dist
from minimp.distributed.buffers import contiguous_flat, output_buffer
from minimp.distributed.ring import all_gather
from minimp.ops.dropout import keep_mask
from minimp.optim import SGD
from minimp.parallel.data.data_parallel import DataParallel
from minimp.parallel.zero.data_parallel import OverlappedUnits, zero_data_parallel
from minimp.parallel.zero.stage3 import _Packed, free

RANKS = 2


def test_contiguous_flat_of_a_strided_device_array_is_a_device_array(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    x = np.arange(6, dtype=np.float32).reshape(2, 3).T.view(DeviceLike)  # (3, 2), not contiguous
    flat = contiguous_flat(x)
    assert type(flat) is DeviceLike and flat.flags.c_contiguous
    np.testing.assert_array_equal(flat, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0])


def test_a_new_output_buffer_lives_on_its_array_s_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    x = np.ones((2, 3), np.float16).view(DeviceLike)
    out = output_buffer(x)
    assert type(out) is DeviceLike and out.shape == (6,) and out.dtype == np.float16


def test_all_gather_of_device_chunks_is_a_device_array(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())

    def gather(comm):
        chunk = np.full(3, float(comm.rank + 1), np.float32).view(DeviceLike)
        return all_gather(comm, chunk)

    for flat in dist.simulate(RANKS, gather):
        assert type(flat) is DeviceLike and flat.dtype == np.float32
        np.testing.assert_array_equal(flat, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0])


def test_an_overlapped_ring_s_buffers_live_where_the_array_they_are_like_lives(monkeypatch):
    """The CPU twin of test_overlap_values' GPU test: the ring adds into these buffers with the
    gradients' own array module, so they must be device arrays."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    units = OverlappedUnits(comm=None, sent=None, parameters=1, micro_batches=1)
    for array in units.new_buffers(np.zeros(4, np.float16).view(DeviceLike), 7):
        assert type(array) is DeviceLike and array.shape == (7,) and array.dtype == np.float16


def _gather_a_device_unit(comm):
    """Stage 3 on Linear(3, 2) with device chunks: (the gathered weight, a transposed view of it
    rebuilt as backward would, the weight before sharding)."""
    layer = nn.Linear(3, 2, rng=np.random.default_rng(5))
    weight = layer.weight.data.copy()  # float32: the compute copy is the master's bits
    gatherer = zero_data_parallel(3, SGD(layer.parameters(), lr=0.1), [layer], comm).gatherer
    chunks = gatherer.optimizer.compute_chunks
    chunks[:] = [chunk.view(DeviceLike) for chunk in chunks]
    (unit,) = gatherer.units_of_layer[id(layer)]
    gatherer._acquire(unit)
    spec = gatherer.layout.units[unit]
    offset = spec.offsets()[spec.indices.index(gatherer.params.index(layer.weight))]
    itemsize = weight.itemsize
    packed = _Packed(unit, offset, (3, 2), (itemsize, 3 * itemsize))  # W.T's strides
    return layer.weight.data, gatherer._unpack(packed), weight


def test_stage_3_gathers_device_chunks_into_a_device_unit(monkeypatch):
    """_acquire all-gathers the unit into a new array on the chunks' device (the parameters become
    views of it), and _unpack rebuilds a saved view of it with the unit's own array module."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    for gathered, transposed, weight in dist.simulate(RANKS, _gather_a_device_unit):
        assert type(gathered) is DeviceLike and gathered.dtype == np.float32
        np.testing.assert_array_equal(gathered, weight)
        assert type(transposed) is DeviceLike
        np.testing.assert_array_equal(transposed, weight.T)


def test_dropout_draws_its_mask_on_the_input_s_device(monkeypatch):
    """The mask Dropout saves for backward is made by the input's array module: CuPy's asarray
    and arange make CuPy arrays, so on a GPU it is a device array (a host mask would make
    cupy.where refuse it, as CuPy converts no NumPy array implicitly)."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    x = Tensor(np.ones((2, 3, 4), np.float32).view(DeviceLike), requires_grad=True)
    y = ops.Dropout.apply(x, p=0.5, seed=1, step=2, layer=3, sample_indices=[0, 1], offset=0)
    (keep,) = y.node.context.saved_arrays
    assert type(keep) is DeviceLike and keep.dtype == np.bool_ and keep.shape == (2, 3, 4)
    np.testing.assert_array_equal(keep, keep_mask((2, 3, 4), 0.5, 1, 2, 3, [0, 1]))


def test_a_freed_stage_3_parameter_is_a_nan_on_its_own_device(monkeypatch):
    """free() makes the NaN with the parameter's array module: numpy.full has no array to follow
    (it would make a host array on a GPU), cupy.full a CuPy one, and CuPy's broadcast_to keeps
    it a CuPy array; one element of memory, the parameter's shape and dtype."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    parameter = nn.Parameter(np.ones((2, 3), np.float16))
    parameter.data = parameter.data.view(DeviceLike)
    free(parameter)
    freed = parameter.data
    assert type(freed) is DeviceLike and freed.shape == (2, 3) and freed.dtype == np.float16
    assert np.isnan(freed).all() and freed.strides == (0, 0)


def _replicas_of_device_masters(comm):
    """DataParallel over two replicas whose float32 masters (a (2, 3) and a 4) are device arrays:
    its bucket buffers, (send, receive) for each bucket."""
    parameters = [nn.Parameter(np.zeros((2, 3), np.float32)), nn.Parameter(np.zeros(4, np.float32))]
    optimizer = SGD(parameters, lr=0.1)
    optimizer.master_weights[:] = [master.view(DeviceLike) for master in optimizer.master_weights]
    return DataParallel(comm, optimizer, bucket_mb=1e-5, comm_dtype=np.float16).buffers


def test_data_parallel_s_bucket_buffers_live_on_the_masters_device(monkeypatch):
    """The buffers are made, once, by the masters' array module (cupy.empty): the gradients are
    packed onto them and the ring adds into them on the device. A limit of about 10 bytes: the
    two float16 parameters (20 bytes together) take a bucket each, last to first."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    for buffers in dist.simulate(RANKS, _replicas_of_device_masters):
        assert [(send.size, receive.size) for send, receive in buffers] == [(4, 4), (6, 6)]
        for array in (array for pair in buffers for array in pair):
            assert type(array) is DeviceLike and array.dtype == np.float16
