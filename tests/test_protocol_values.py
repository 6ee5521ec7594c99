"""byte_view, the bytes every simulated message carries: one flat uint8 view of the array's memory
whatever its shape, so a message fits any receive buffer of the same number of bytes, as in MPI."""

import numpy as np
import pytest

from minimp import distributed as dist
from minimp.distributed.protocol import byte_view, contiguous_for_wire

SHAPES = [(), (5,), (2, 3), (2, 3, 4)]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_byte_view_is_the_arrays_memory_as_one_flat_run_of_bytes(shape, dtype):
    """A 1-D uint8 array of nbytes elements holding the array's bytes in memory order, a view
    (writing through it changes the array), for a scalar (0-d) array too."""
    array = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    view = byte_view(array)
    assert (view.dtype, view.shape) == (np.uint8, (array.nbytes,))
    assert view.tobytes() == array.tobytes()
    view[:] = 0
    assert not array.any()


def test_a_message_fits_any_buffer_of_its_byte_count_whatever_its_shape():
    """MPI sees bytes, not shapes: a (2, 3) array received into a (6,) buffer and a (3, 2) one,
    a 0-d scalar into a (1,) buffer and back."""
    matrix = np.arange(6, dtype=np.float32).reshape(2, 3)
    scalar = np.array(2.5, dtype=np.float32)

    def body(comm):
        if comm.rank == 0:
            comm.send(matrix, 1, tag=1)
            comm.send(matrix, 1, tag=2)
            comm.send(scalar, 1, tag=3)
            back = np.zeros((), np.float32)
            comm.recv(back, 1, tag=4)
            return back
        flat, other = np.zeros(6, np.float32), np.zeros((3, 2), np.float32)
        one = np.zeros(1, np.float32)
        comm.recv(flat, 0, tag=1)
        comm.recv(other, 0, tag=2)
        comm.recv(one, 0, tag=3)
        comm.send(one, 0, tag=4)
        return flat, other, one

    back, (flat, other, one) = dist.simulate(2, body, timeout=5.0)
    np.testing.assert_array_equal(flat, matrix.reshape(-1))
    np.testing.assert_array_equal(other, matrix.reshape(3, 2))
    np.testing.assert_array_equal(one, [2.5])
    assert back.shape == () and back == 2.5


def test_the_wire_refuses_a_strided_array_with_the_whole_message():
    """The message names the fix and the array's shape and strides, and nothing else."""
    strided = np.zeros(8, np.float32)[::2]
    with pytest.raises(ValueError) as caught:
        contiguous_for_wire(strided)
    assert str(caught.value) == (
        "communication needs a C-contiguous array (use numpy.ascontiguousarray); "
        "got one of shape (4,) with strides (8,)"
    )


def test_the_wire_hands_back_a_contiguous_array_itself():
    array = np.zeros((2, 3), np.float32)
    assert contiguous_for_wire(array) is array
