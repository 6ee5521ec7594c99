"""minimp.distributed.alltoall on the simulated world: the result is the obvious gather of chunks
for any counts and dtype, the bytes sent equal the formula, AllToAll's gradient is the transposed
exchange, disagreements fail in one line on every rank, and large chunks cannot deadlock."""

import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in
from hypothesis import given, settings
from hypothesis import strategies as st

from minimp import Tensor
from minimp import distributed as dist
from minimp.distributed.protocol import Tag
from minimp.measure.accounts import BytesSent

# every dtype minimp moves: activations, fp8, token ids
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, np.int64]


def random_bits(rng, shape, dtype):
    """Any bit patterns at all (NaNs and infinities too): compared as bytes, nothing may change."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)


def make_chunks(counts, trailing, dtype, strided, seed):
    """chunks[i][j]: rank i's rows for rank j; strided ones: every other row of a bigger array."""
    rng, p = np.random.default_rng(seed), len(counts)
    chunks = []
    for i in range(p):
        row = []
        for j in range(p):
            whole = random_bits(rng, (2 * counts[i][j] if strided else counts[i][j], *trailing),
                                dtype)
            row.append(whole[::2] if strided else whole)
        chunks.append(row)
    return chunks


def counts_matrices():
    """(p, counts[i][j]: rows rank i sends rank j), p in 1..5, zeros included."""
    return st.integers(1, 5).flatmap(lambda p: st.lists(
        st.lists(st.integers(0, 3), min_size=p, max_size=p), min_size=p, max_size=p))


@settings(max_examples=40, deadline=None)
@given(counts_matrices(), st.lists(st.integers(0, 3), max_size=2).map(tuple),
       st.sampled_from(DTYPES), st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_all_to_all_is_the_gather_of_chunks_and_sends_the_formula_s_bytes(
        counts, trailing, dtype, sizes_given, strided, seed):
    p = len(counts)
    chunks = make_chunks(counts, trailing, dtype, strided, seed)
    row_bytes = int(np.prod(trailing)) * np.dtype(dtype).itemsize

    def run(comm):
        sent = BytesSent()
        expected = [counts[i][comm.rank] for i in range(p)] if sizes_given else None
        with sent.counting(comm, "all_to_all"):
            received = dist.all_to_all(comm, chunks[comm.rank], output_split_sizes=expected)
        return received, sent.by_collective["all_to_all"], comm.bytes_sent

    results = dist.simulate(p, run)
    for j, (received, counted, bytes_sent) in enumerate(results):
        assert len(received) == p
        for i in range(p):  # chunk i on rank j: what rank i cut for rank j
            assert received[i].dtype == np.dtype(dtype)
            assert received[i].shape == chunks[i][j].shape
            assert received[i].tobytes() == chunks[i][j].tobytes()
        formula = dist.all_to_all_bytes(counts[j], row_bytes, j, counts_exchanged=not sizes_given)
        assert counted == bytes_sent == formula
    # one message per non-empty chunk to another rank, and p - 1 counts from each rank
    payloads = [m for m in results.trace if m.tag == Tag.ALL_TO_ALL]
    counted = [m for m in results.trace if m.tag == Tag.ALL_TO_ALL_COUNTS]
    assert len(payloads) == sum(1 for i in range(p) for j in range(p)
                                if i != j and counts[i][j] * row_bytes)
    assert len(counted) == (0 if sizes_given else p * (p - 1))
    assert all(m.nbytes == 8 for m in counted)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(0, 3), st.sampled_from(DTYPES), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_all_to_all_single_with_equal_chunks_sends_no_counts(p, rows, dtype, fortran, seed):
    """Ulysses' form: p equal chunks of one array, each rank's output sizes its own chunk's."""
    rng = np.random.default_rng(seed)
    inputs = [random_bits(rng, (p * rows, 2, 3), dtype) for _ in range(p)]
    if fortran:  # its chunks of rows are not contiguous
        inputs = [np.asfortranarray(x) for x in inputs]

    def run(comm):
        return dist.all_to_all_single(comm, inputs[comm.rank]), comm.bytes_sent

    results = dist.simulate(p, run)
    for j, (out, bytes_sent) in enumerate(results):
        gathered = np.concatenate([x[j * rows:(j + 1) * rows] for x in inputs])
        assert out.shape == gathered.shape and out.tobytes() == gathered.tobytes()
        assert bytes_sent == dist.all_to_all_bytes([rows] * p, 6 * np.dtype(dtype).itemsize, j,
                                                   counts_exchanged=False)
    assert all(m.tag == Tag.ALL_TO_ALL for m in results.trace)


@settings(max_examples=25, deadline=None)
@given(counts_matrices(), st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]),
       st.integers(0, 2**31 - 1))
def test_all_to_all_backward_is_the_transposed_exchange(counts, dtype, seed):
    p, rng = len(counts), np.random.default_rng(seed)
    inputs = [rng.standard_normal((sum(counts[i]), 3)).astype(dtype) for i in range(p)]
    grads = [rng.standard_normal((sum(counts[i][j] for i in range(p)), 3)).astype(dtype)
             for j in range(p)]

    def run(comm):
        x = Tensor(inputs[comm.rank], requires_grad=True)
        y = dist.AllToAll.apply(x, comm=comm, input_split_sizes=counts[comm.rank])
        forward = comm.bytes_sent
        y.backward(grads[comm.rank])
        return y.data, x.grad, comm.bytes_sent - forward

    results = dist.simulate(p, run)
    starts = np.cumsum([[0] + row for row in counts], axis=1)  # starts[i][j]: rank i's chunk j
    for i, (_, grad, backward_bytes) in enumerate(results):
        assert grad.dtype == np.dtype(dtype) and grad.shape == inputs[i].shape
        for j in range(p):
            # rank i's rows for rank j came back as rank j's gradient rows from rank i
            g_start = sum(counts[k][j] for k in range(i))
            mine = grad[starts[i][j]:starts[i][j + 1]]
            assert mine.tobytes() == grads[j][g_start:g_start + counts[i][j]].tobytes()
        received = [counts[k][i] for k in range(p)]  # the backward sends these back
        assert backward_bytes == dist.all_to_all_bytes(received, 3 * np.dtype(dtype).itemsize, i,
                                                       counts_exchanged=False)
    # the transpose: sum over ranks of <y, g> == sum over ranks of <x, dL/dx>, in float64
    forward = sum(np.vdot(r[0].astype(np.float64), g.astype(np.float64))
                  for r, g in zip(results, grads))
    backward = sum(np.vdot(x.astype(np.float64), r[1].astype(np.float64))
                   for r, x in zip(results, inputs))
    assert forward == pytest.approx(backward, rel=1e-12, abs=1e-12)


def test_exchange_counts_sends_one_int64_to_each_other_rank():
    def run(comm):
        return dist.exchange_counts(comm, [10 * comm.rank + j for j in range(comm.size)])

    results = dist.simulate(4, run)
    assert results == [tuple(10 * i + j for i in range(4)) for j in range(4)]
    assert sorted((m.source, m.dest) for m in results.trace) == [
        (i, j) for i in range(4) for j in range(4) if i != j]
    assert {(m.tag, m.nbytes) for m in results.trace} == {(Tag.ALL_TO_ALL_COUNTS, 8)}


def disagreeing(rank):
    """(what each rank passes, the line every rank must raise): each a disagreement the message
    sizes alone would not reveal (same bytes) or would reveal on one rank only."""
    rows = np.zeros((2, 3), np.float32)
    return {
        "trailing shape": ([np.zeros((2, 3) if rank != 1 else (3, 2), np.float32)] * 3, None),
        "dtype": ([rows.view(np.int32) if rank == 2 else rows] * 3, None),
        "16-bit dtype": ([np.zeros((2, 3), np.float16 if rank else ml_dtypes.bfloat16)] * 3, None),
        "sizes given on one rank": ([rows] * 3, [2, 2, 2] if rank == 0 else None),
        "sizes given wrong": ([rows] * 3, [2, 2, 5 if rank == 1 else 2]),
    }


@pytest.mark.parametrize("case, line", [
    ("trailing shape", "ranks disagree on the chunks (rank 0: float32 rows of (3,), sizes "
     "exchanged; rank 1: float32 rows of (2,), sizes exchanged; rank 2: float32 rows of (3,), "
     "sizes exchanged); every rank must send rows of one dtype and trailing shape, and all or "
     "none pass output_split_sizes"),
    ("dtype", "rank 1: float32 rows of (3,), sizes exchanged; rank 2: int32 rows of (3,)"),
    ("16-bit dtype", "rank 0: bfloat16 rows of (3,), sizes exchanged; rank 1: float16 rows"),
    ("sizes given on one rank", "rank 0: float32 rows of (3,), sizes given; rank 1: float32 "
     "rows of (3,), sizes exchanged"),
    ("sizes given wrong", "all_to_all: rank 2 sends 2 rows to rank 1, whose "
     "output_split_sizes[2] is 5; pass the sizes the senders send"),
])
def test_a_disagreement_fails_in_one_line_on_every_rank_before_any_message(case, line):
    def run(comm):
        chunks, sizes = disagreeing(comm.rank)[case]
        with pytest.raises(dist.CollectiveMismatchError) as raised:
            dist.all_to_all(comm, chunks, output_split_sizes=sizes)
        return str(raised.value)

    results = dist.simulate(3, run)
    assert len(set(results)) == 1 and "\n" not in results[0]
    assert line in results[0]
    assert results.trace == []  # nothing was sent: no message is left for a later call


def test_chunks_past_the_eager_limit_do_not_deadlock():
    """400 kB chunks pass the simulated world's 64 KiB eager limit; sends first deadlock there."""
    rows = 100_000  # float32: 400 kB a chunk
    inputs = [np.full((3 * rows,), rank, np.float32) for rank in range(3)]

    def sends_first(comm):
        for step in range(1, comm.size):
            dest = (comm.rank + step) % comm.size
            comm.send(inputs[comm.rank][dest * rows:(dest + 1) * rows], dest, tag=Tag.ALL_TO_ALL)

    with pytest.raises(dist.DeadlockError):
        dist.simulate(3, sends_first)
    results = dist.simulate(3, lambda comm: dist.all_to_all_single(comm, inputs[comm.rank]))
    for out in results:
        assert np.array_equal(out, np.repeat(np.arange(3, dtype=np.float32), rows))


@pytest.mark.parametrize("call, match", [
    (lambda comm: dist.all_to_all(comm, [np.zeros(2)] * 3), "3 chunks for 2 ranks; pass one per"),
    (lambda comm: dist.all_to_all(comm, [np.zeros(2), np.zeros(2, np.float32)]),
     "must share a dtype and a trailing shape"),
    (lambda comm: dist.all_to_all(comm, [np.zeros(())] * 2), "a first axis to count rows"),
    (lambda comm: dist.all_to_all(comm, [np.zeros((1,) * 9)] * 2), "at most 7"),
    (lambda comm: dist.all_to_all(comm, [np.zeros(2)] * 2, output_split_sizes=[2, -1]),
     "output_split_sizes must be 2 non-negative integers"),
    (lambda comm: dist.all_to_all_single(comm, np.zeros(3)), "3 rows do not split into 2 equal"),
    (lambda comm: dist.all_to_all_single(comm, np.zeros(3), input_split_sizes=[1, 1]),
     r"input_split_sizes \[1, 1\] add up to 2, but x has 3 rows"),
    (lambda comm: dist.all_to_all_single(comm, np.zeros(())), "0-d array"),
])
def test_bad_input_is_one_clear_line_before_any_message(call, match):
    def run(comm):
        with pytest.raises(ValueError, match=match):
            call(comm)

    assert dist.simulate(2, run).trace == []


def test_a_device_array_stays_on_the_device_forward_and_backward(monkeypatch):
    """Device rows are exchanged with their own array module (CuPy on a GPU; here the stand-in,
    whose arrays NumPy's empty would turn into host arrays)."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())

    def run(comm):
        x = Tensor(np.full((4, 3), comm.rank, np.float32).view(DeviceLike), requires_grad=True)
        y = dist.AllToAll.apply(x, comm=comm, input_split_sizes=[3, 1] if comm.rank else [1, 3])
        y.backward(y.data)
        return y.data, x.grad

    for rank, (y, grad) in enumerate(dist.simulate(2, run)):
        assert type(y) is DeviceLike and type(grad) is DeviceLike
        rows = [1, 3] if rank == 0 else [3, 1]  # from rank 0, from rank 1
        assert np.array_equal(y, np.repeat(np.arange(2, dtype=np.float32), rows)[:, None]
                              * np.ones(3, np.float32))
        assert np.array_equal(grad, np.full((4, 3), rank, np.float32))
