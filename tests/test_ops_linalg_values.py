"""The GEMM helpers of minimp/ops/linalg.py, where their arrays live and in which dtype.

gemm_operand: what a matrix product reads. A 2-D float16 device array goes to cuBLAS as it is
(tensor cores, float32 accumulation); every other array (host arrays, bfloat16, 3-D batches) is
widened to float32. pooled_matmul: a @ b written into an array from the memory pool (host) or
into a device array (GPU), in the dtype a @ b would have.

The values of Linear and MatMul are pinned elsewhere (test_ops.py, test_values16.py); these
catch a right value in the wrong place: a fresh allocation instead of the pool's, a host array
for a device one, a float64 buffer for float32 operands, or a float16 operand widened on a GPU.
Device paths use the stand-in `cupy` of conftest.py (DeviceLike arrays).
"""

import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in

from minimp import backend
from minimp.function import Context
from minimp.ops.linalg import Linear, gemm_operand, pooled_matmul


def owner(array):
    """The array that owns array's memory (itself, or the base of a view)."""
    return array if array.base is None else array.base


def operands(dtype_a=np.float32, dtype_b=np.float32):
    """A (3, 4) and a (4, 2) operand with exact small values."""
    a = (np.arange(12, dtype=np.float64).reshape(3, 4) / 4 - 1).astype(dtype_a)
    b = (np.arange(8, dtype=np.float64).reshape(4, 2) / 2 - 1.5).astype(dtype_b)
    return a, b


def test_gemm_operand_passes_a_2d_float16_device_array_as_it_is(monkeypatch):
    """cuBLAS multiplies float16 on the tensor cores and accumulates in float32: widening the
    operand first would double the bytes read and skip the tensor cores."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    x = np.ones((3, 4), np.float16).view(DeviceLike)
    assert gemm_operand(x) is x


@pytest.mark.parametrize(
    "shape, dtype",
    [((2, 3, 4), np.float16), ((4,), np.float16), ((3, 4), ml_dtypes.bfloat16)],
    ids=["float16-3d", "float16-1d", "bfloat16-2d"],
)
def test_gemm_operand_widens_other_device_arrays_to_float32(shape, dtype, monkeypatch):
    """Only 2-D float16 goes to cuBLAS unwidened: batches (3-D) and bfloat16 are read in float32,
    and stay device arrays."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    x = np.full(shape, 1.5, dtype).view(DeviceLike)
    widened = gemm_operand(x)
    assert widened.dtype == np.float32 and type(widened) is DeviceLike
    np.testing.assert_array_equal(widened.view(np.ndarray), np.full(shape, 1.5, np.float32))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_gemm_operand_widens_a_2d_16_bit_host_array(dtype):
    """On the CPU every 16-bit operand is multiplied by float32 BLAS."""
    x = np.full((3, 4), 1.5, dtype)
    assert gemm_operand(x).dtype == np.float32


def test_pooled_matmul_writes_a_at_b_into_a_float32_array_from_the_memory_pool():
    """The same product as a @ b, in a's and b's float32 (not a float64 buffer), in memory the
    pool hands out again next step instead of a fresh allocation."""
    a, b = operands()
    product = pooled_matmul(a, b)
    assert backend.memory_pool().holds(owner(product))
    assert product.dtype == np.float32 and product.shape == (3, 2)
    np.testing.assert_array_equal(product, a @ b)


@pytest.mark.parametrize("dtype_a, dtype_b", [(np.float32, np.float64), (np.float64, np.float32)])
def test_pooled_matmul_of_two_dtypes_has_their_promotion(dtype_a, dtype_b):
    """a @ b of float32 and float64 is float64 whichever side each is on: one operand's dtype
    alone would round the float64 product to float32."""
    a, b = operands(dtype_a, dtype_b)
    a = a + np.float32(2.0**-20)  # a value float32 holds and the float64 product needs
    product = pooled_matmul(a, b)
    assert product.dtype == np.float64
    np.testing.assert_array_equal(product, a @ b)


def test_pooled_matmul_of_device_arrays_is_a_device_array(monkeypatch):
    """On a GPU the output buffer must be a CuPy array like the operands (CuPy refuses a host
    array as out=)."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    a, b = operands()
    product = pooled_matmul(a.view(DeviceLike), b.view(DeviceLike))
    assert type(product) is DeviceLike and product.dtype == np.float32
    np.testing.assert_array_equal(product.view(np.ndarray), a @ b)


def test_linear_writes_its_output_and_gradients_into_arrays_from_the_memory_pool():
    """Linear's product and its dL/dx and dL/dW come from pooled_matmul: float32 arrays of the
    pool, reused step after step."""
    x, w = operands()
    weight = np.ascontiguousarray(w.T)  # (out=2, in=4)
    bias = np.array([0.5, -0.25], np.float32)
    ctx = Context((True, True, True))
    y = Linear.forward(ctx, x, weight, bias)
    grad_x, grad_weight, _ = Linear.backward(ctx, np.ones((3, 2), np.float32))
    pool = backend.memory_pool()
    for array in (y, grad_x, grad_weight):
        assert pool.holds(owner(array)) and array.dtype == np.float32
    np.testing.assert_array_equal(y, x @ weight.T + bias)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True), (True, True, True)])  # fmt: skip
def test_linear_backward_computes_exactly_the_gradients_asked_for(needs):
    """Each gradient asked for is the float32 product (x: dy W, weight: dy^T x, bias: the sum
    over rows), on a 3-D input; each one not asked for is None, not computed and not a
    placeholder (the engine skips inputs that need no gradient, such as the data)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    weight = rng.standard_normal((5, 4)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    ctx = Context(needs)
    Linear.forward(ctx, x, weight, bias)
    dy = rng.standard_normal((2, 3, 5)).astype(np.float32)
    rows, dy_rows = x.reshape(6, 4), dy.reshape(6, 5)
    expected = ((dy_rows @ weight).reshape(x.shape), dy_rows.T @ rows, dy_rows.sum(axis=0))
    for needed, grad, want in zip(needs, Linear.backward(ctx, dy), expected):
        if needed:
            assert grad.dtype == np.float32 and grad.shape == want.shape
            np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)
        else:
            assert grad is None

