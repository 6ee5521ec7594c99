"""ReLU's arrays, where they live: its output and its gradient are arrays the memory pool handed
out (minimp/memory_pool.py), and a device array's are device arrays, in every float dtype.

Its values, bit for bit, are pinned in test_values16.py; a right value in the wrong memory is what
these catch: a fresh allocation every step instead of the pool's, or a host array for a GPU one.
"""

import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in

from minimp import backend
from minimp.function import Context
from minimp.ops.elementwise import ReLU

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
IDS = ["float16", "bfloat16", "float32", "float64"]


def values(dtype):
    """Negatives, zeros of both signs, positives and infinities; and a gradient for them."""
    x = np.array([-2.0, -0.0, 0.0, 0.5, 3.0, -np.inf, np.inf, -1.5], dtype=dtype).reshape(2, 4)
    return x, np.arange(1, 9, dtype=np.float32).astype(dtype).reshape(2, 4)


def forward_and_backward(x, grad_output):
    """ReLU's output at x and dL/dx for grad_output, straight from the Function."""
    ctx = Context((True,))
    y = ReLU.forward(ctx, x)
    return y, ReLU.backward(ctx, grad_output)


def owner(array):
    """The array that owns array's memory (itself, or the base of a view)."""
    return array if array.base is None else array.base


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_relu_writes_its_output_and_gradient_into_arrays_from_the_memory_pool(dtype):
    """So a training step's ReLU reuses the memory of the step before instead of allocating."""
    x, g = values(dtype)
    y, grad = forward_and_backward(x, g)
    pool = backend.memory_pool()
    assert pool.holds(owner(y)) and pool.holds(owner(grad))
    assert y.dtype == grad.dtype == x.dtype
    np.testing.assert_array_equal(y.astype(np.float64), np.maximum(x.astype(np.float64), 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_relu_of_a_device_array_is_a_device_array_forward_and_backward(dtype, monkeypatch):
    """On a GPU, x and dL/dy are CuPy arrays: so must y and dL/dx be, and the buffers written into
    (CuPy refuses a host array as out=). Checked with a stand-in `cupy` whose arrays are DeviceLike.
    """
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    x, g = values(dtype)
    y, grad = forward_and_backward(x.view(DeviceLike), g.view(DeviceLike))
    assert type(y) is DeviceLike and type(grad) is DeviceLike
    expected_y, expected_grad = forward_and_backward(x, g)  # the same on the host
    np.testing.assert_array_equal(y.view(np.ndarray).view(np.uint8), expected_y.view(np.uint8))
    np.testing.assert_array_equal(
        grad.view(np.ndarray).view(np.uint8), expected_grad.view(np.uint8)
    )


@pytest.mark.parametrize("a_dtype, b_dtype", [(np.float32, np.float16), (np.float16, np.float32),
                                              (np.float16, ml_dtypes.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("op", ["add", "mul"])
def test_a_binary_op_of_two_dtypes_rounds_once_into_their_promotion(a_dtype, b_dtype, op):
    """float16 with float32 is float32 whichever side each is on, and float16 with bfloat16 is
    float32 too (ml_dtypes has no rule for it): one operand's dtype alone would round the exact
    float32 result into 16 bits."""
    from minimp.ops.elementwise import Add, Mul

    a = np.array([1.0 + 2.0**-10, 3.0], a_dtype)
    b = np.array([2.0**-12, 1.0 / 3.0], b_dtype)
    exact = {"add": np.add, "mul": np.multiply}[op](a.astype(np.float32), b.astype(np.float32))
    out = {"add": Add, "mul": Mul}[op].forward(Context((True, True)), a, b)
    assert out.dtype == np.float32
    assert np.array_equal(out.view(np.uint32), exact.view(np.uint32))
