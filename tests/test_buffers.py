"""minimp/distributed/buffers.py pinned directly: the agreement's message (lengths and dtype codes)
and its one all-reduce, the flat views and copies, the `out` buffers and their error messages,
and the flat copy a one-rank collective returns into the caller's `out` (x is only read)."""

import ml_dtypes
import numpy as np
import pytest

from minimp import distributed as dist
from minimp.distributed.buffers import (
    agree_on_array,
    agree_on_layout,
    contiguous_flat,
    flat_copy,
    output_buffer,
    reduce_into,
)


def test_flat_copy_copies_x_into_the_out_it_is_given():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = np.zeros((2, 3), np.float32)
    flat = flat_copy(x, out)
    assert flat.shape == (6,) and np.shares_memory(flat, out)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(x, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_flat_copy_without_out_is_a_new_flat_array():
    x = np.arange(6, dtype=np.float16).reshape(3, 2)
    flat = flat_copy(x)
    assert flat.shape == (6,) and flat.dtype == np.float16 and not np.shares_memory(flat, x)
    np.testing.assert_array_equal(flat, x.reshape(-1))


def test_a_one_rank_ring_allreduce_writes_into_out():
    # one rank: no messages, the ring returns flat_copy(x, out) in x's shape
    def into_buffer(comm):
        x = np.array([[1.5, -2.0], [3.0, 4.25]], np.float32)
        out = np.full((2, 2), np.nan, np.float32)
        result = dist.ring_allreduce(comm, x, out=out)
        return result, out

    ((result, out),) = dist.simulate(1, into_buffer)
    assert result.shape == (2, 2) and np.shares_memory(result, out)
    np.testing.assert_array_equal(out, [[1.5, -2.0], [3.0, 4.25]])


# The dtype codes the agreement sends (a dtype without one sends 99), read back from the message.
CODES = [
    (np.float16, 1), (ml_dtypes.bfloat16, 2), (np.float32, 3), (np.float64, 4),
    (np.int32, 5), (np.int64, 6),
]  # fmt: skip


@pytest.mark.parametrize("dtype, code", CODES)
def test_a_dtype_mismatch_names_both_dtype_codes_in_full(dtype, code):
    def mismatched(comm):
        with pytest.raises(dist.CollectiveMismatchError) as caught:
            agree_on_array(comm, np.zeros(3, dtype if comm.rank == 0 else np.int8), "the test")
        return str(caught.value)

    for message in dist.simulate(2, mismatched):
        assert message == (
            f"the test: ranks disagree on the array (lengths 3..3, dtype codes {code}..99); "
            "every rank must pass the same length and dtype"
        )


def test_a_length_mismatch_names_the_shortest_and_the_longest_length():
    def mismatched(comm):
        with pytest.raises(dist.CollectiveMismatchError) as caught:
            agree_on_layout(comm, [7, 5, 9][comm.rank], np.dtype(np.float16), "the test")
        return str(caught.value)

    for message in dist.simulate(3, mismatched):
        assert message.startswith("the test: ranks disagree on the array (lengths 5..9, ")
        assert "dtype codes 1..1)" in message


def test_ranks_with_the_same_dtype_without_a_code_agree():
    def agree(comm):
        agree_on_array(comm, np.zeros(4, np.int8), "the test")
        return comm.scalar_allreduces

    assert dist.simulate(2, agree) == [1, 1]


def test_one_rank_agrees_without_an_all_reduce():
    def agree(comm):
        agree_on_layout(comm, 4, np.dtype(np.float32), "the test")
        return comm.scalar_allreduces

    assert dist.simulate(1, agree) == [0]


def test_contiguous_flat_passes_a_flat_array_as_it_is_and_copies_a_strided_one():
    flat = np.arange(6, dtype=np.float32)
    assert contiguous_flat(flat) is flat
    strided = contiguous_flat(flat[::2])
    assert strided.flags.c_contiguous and strided.tolist() == [0.0, 2.0, 4.0]
    matrix = flat.reshape(2, 3)
    flattened = contiguous_flat(matrix)
    assert flattened.shape == (6,) and np.shares_memory(flattened, matrix)


def test_a_strided_array_all_reduces_like_its_contiguous_copy():
    def reduce(comm):
        x = np.arange(8, dtype=np.float32)[::2] * (comm.rank + 1)
        return dist.ring_allreduce(comm, x)

    for result in dist.simulate(2, reduce):
        np.testing.assert_array_equal(result, [0.0, 6.0, 12.0, 18.0])


def test_output_buffer_returns_a_flat_out_itself_and_a_flat_view_of_any_other():
    x1, out1 = np.zeros(4, np.float32), np.empty(4, np.float32)
    assert output_buffer(x1, out1) is out1
    x2, out2 = np.zeros((2, 2), np.float32), np.empty((2, 2), np.float32)
    flat = output_buffer(x2, out2)
    assert flat.shape == (4,) and np.shares_memory(flat, out2)
    new = output_buffer(x2)
    assert new.shape == (4,) and new.dtype == np.float32 and not np.shares_memory(new, x2)


@pytest.mark.parametrize(
    "out",
    [np.empty((2, 3), np.float32), np.empty((3, 2), np.float32), np.empty((2, 3), np.float64).T],
    ids=["shape", "dtype", "not-contiguous"],
)
def test_an_out_of_another_layout_is_refused_with_the_layout_it_needs(out):
    x = np.zeros((3, 2), np.float64)
    with pytest.raises(ValueError) as caught:
        output_buffer(x, out)
    assert str(caught.value) == "out must be a C-contiguous float64 array of shape (3, 2)"


def test_an_out_overlapping_x_is_refused_in_one_sentence():
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError) as caught:
        output_buffer(x[:4], x[2:6])
    assert str(caught.value) == "out must not overlap x (x is read while out is written)"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_reduce_into_combines_first_and_incoming_into_target(dtype):
    target = np.full(3, 100.0, dtype)
    reduce_into(target, np.array([2.0, -1.0, 0.5], dtype), "sum", first=np.ones(3, dtype))
    assert target.dtype == np.dtype(dtype) and target.tolist() == [3.0, 0.0, 1.5]
    reduce_into(target, np.array([1.0, 1.0, 1.0], dtype), "max")  # first: target itself
    assert target.tolist() == [3.0, 1.0, 1.5]
    one = np.array([4.0], dtype)
    reduce_into(one, np.array([3.0], dtype), "sum")  # a one-element chunk is reduced too
    assert one.tolist() == [7.0]



def test_reduce_into_keeps_a_16_bit_signalling_nan_bit_for_bit():
    # minimp's own cast back from float32 keeps the NaN's bits; a hardware cast would set the
    # quiet bit (0x7C01 -> 0x7E01)
    target = np.array([0x7C01], np.uint16).view(np.float16)
    reduce_into(target, np.zeros(1, np.float16), "max")
    assert target.view(np.uint16)[0] == 0x7C01


def test_reduce_into_sums_two_16_bit_nans_to_the_first_ones_payload():
    # added in float32, x86 keeps the first operand's NaN (quieted: 0x7D25 -> 0x7F25); a float16
    # ufunc on the raw arrays gives the second's here (0xFC91 -> 0xFE91)
    target = np.zeros(1, np.float16)
    first = np.array([0x7D25], np.uint16).view(np.float16)
    with np.errstate(invalid="ignore"):  # NaN arithmetic sets the invalid flag
        reduce_into(target, np.array([0xFC91], np.uint16).view(np.float16), "sum", first=first)
    assert target.view(np.uint16)[0] == 0x7F25
