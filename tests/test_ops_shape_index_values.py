"""Embedding's index checks and device path, and basic indexing (minimp/ops/embedding.py,
minimp/ops/shape.py), by value: which indices are refused and with which error, which keys
Tensor indexing takes, and that the arrays kept for backward, and the gradients, stay on the
device (the cupy stand-in of conftest: a plain ndarray where a DeviceLike is expected is host
memory, or an error, on a GPU).
"""

import sys

import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in

from minimp import Tensor
from minimp import functional as F
from minimp.function import saved_tensors_hooks

ROWS = 5


def table():
    return Tensor(np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3), requires_grad=True)


def test_embedding_refuses_an_index_equal_to_the_number_of_rows_with_a_value_error():
    """The last row is ROWS - 1: index ROWS is out of range and the check says so (ValueError
    naming the range), rather than leaving NumPy's indexing to raise an IndexError."""
    with pytest.raises(ValueError, match=r"embedding: indices must lie in 0\.\.4$"):
        F.embedding(np.array([0, ROWS]), table())
    np.testing.assert_array_equal(F.embedding(np.array([ROWS - 1]), table()).data, [[12, 13, 14]])


def test_embedding_refuses_a_negative_index_even_when_the_others_are_in_range():
    """-1 would silently pick the last row (NumPy's negative indexing): each bound is checked on
    its own, so one index below 0 is enough to refuse the batch."""
    with pytest.raises(ValueError, match=r"embedding: indices must lie in 0\.\.4$"):
        F.embedding(np.array([0, 2, -1]), table())


def test_embedding_keeps_host_token_ids_on_the_weight_s_device(monkeypatch):
    """Token ids from the host (a NumPy array) are moved to the weight's device before indexing;
    the ids kept for backward are device arrays, so backward's scatter-add reads device memory."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    weight = Tensor(table().data.view(DeviceLike), requires_grad=True)
    saved = []
    with saved_tensors_hooks(lambda array: saved.append(array) or array, lambda array: array):
        y = F.embedding(np.array([[3, 1], [3, 0]]), weight)
    assert [type(array) for array in saved] == [DeviceLike]
    np.testing.assert_array_equal(saved[0].view(np.ndarray), [[3, 1], [3, 0]])
    assert type(y.data) is DeviceLike
    y.backward(np.ones((2, 2, 3), np.float32).view(DeviceLike))
    assert type(weight.grad) is DeviceLike
    np.testing.assert_array_equal(weight.grad.view(np.ndarray)[:, 0], [1, 1, 0, 2, 0])


def test_tensor_indexing_takes_a_lone_int_or_slice_key():
    """A key that is not a tuple is one part: x[2] and x[1:3] are basic indexing."""
    x = Tensor(np.arange(6, dtype=np.float32), requires_grad=True)
    assert float(x[2].data) == 2.0
    x[1:3].backward(np.array([10, 20], np.float32))
    np.testing.assert_array_equal(x.grad, [0, 10, 20, 0, 0, 0])


def test_tensor_indexing_refuses_a_list_key_naming_its_type():
    """A list is an index array (it may pick one element twice, whose gradients must then be
    summed): refused, and the message names the list's type, not some other."""
    x = Tensor(np.arange(6, dtype=np.float32), requires_grad=True)
    with pytest.raises(TypeError, match=r"Ellipsis, got list \(to gather rows"):
        x[[0, 0]]
    with pytest.raises(TypeError, match=r"Ellipsis, got ndarray \(to gather rows"):
        x[1, np.array([0])]


def test_an_index_s_gradient_lives_on_the_device_of_its_output_gradient(monkeypatch):
    """Backward writes dL/dy into zeros made by the gradient's own array module: device zeros
    for a device gradient (NumPy's zeros would be host memory)."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    x = Tensor(np.zeros((2, 3), np.float16).view(DeviceLike), requires_grad=True)
    x[1, 1:].backward(np.array([5, 7], np.float16).view(DeviceLike))
    assert type(x.grad) is DeviceLike and x.grad.dtype == np.float16
    np.testing.assert_array_equal(x.grad.view(np.ndarray), [[0, 0, 0], [0, 5, 7]])
