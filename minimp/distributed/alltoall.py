"""The all-to-all with per-rank counts: rank i sends chunk j of its rows to rank j and receives one
chunk from each rank, in rank order (MPI_Alltoallv; torch.distributed's all_to_all_single).

Context parallelism's Ulysses turns sequence shards into head shards with it (every chunk the same
shape), and expert parallelism dispatches tokens to the ranks that hold their experts (chunks of
any length, which the receivers learn first). Chunks are cut along the first axis (rows); every
rank sends rows of one dtype and one trailing shape.

Three calls, one per use: `all_to_all(comm, chunks)` (a list in, a list out), `all_to_all_single`
(one array cut by `input_split_sizes`, the received chunks side by side in one array) and the
`AllToAll` Function, its differentiable form. A receiver that is not told `output_split_sizes`
learns them first: one int64 from each other rank (`exchange_counts`: an all-to-all of its own,
Tag.ALL_TO_ALL_COUNTS).

Agreement, before any message: one `allreduce_scalars` of every rank's layout, written as the text
an error prints ("float32 rows of (3,), sizes given": its dtype's name, its rows' trailing shape,
whether it passed output_split_sizes) and, when the sizes are given, of what each rank sends and
what each expects. A disagreement raises CollectiveMismatchError with the same line on every rank,
having sent nothing: no hang, no bytes read as another dtype or shape.

Deadlock: every receive is posted (irecv) before any send starts (isend), and only then does the
rank wait, so no send waits for a receive that is not yet posted, at any size (a large message
waits for its receiver under MPI's rendezvous protocol; the simulated world models that too).
Sends go to rank + 1, rank + 2, ... in turn, so the ranks do not all send to rank 0 first. The
local chunk is copied into place, not sent; an empty chunk is not sent (both sides know it).

Bytes each rank sends, counted in comm.bytes_sent (a caller measures a call with
measure.accounts.BytesSent.counting, as the strategies do their collectives):
    payloads: sum over j != rank of chunk j's nbytes (= its rows x trailing size x itemsize),
    counts:   (p - 1) x 8 when the output sizes are exchanged, 0 when they are given.
`all_to_all_bytes` is this formula. The agreement is a scalar all-reduce (counted apart, in
comm.scalar_allreduces, as every collective's agreement is). AllToAll's backward sends the same
payload bytes back with the counts transposed, and no counts (they are known from the forward).
"""

from typing import Sequence

import numpy as np

from minimp.backend import Array, array_module
from minimp.distributed.buffers import CollectiveMismatchError
from minimp.distributed.protocol import Communicator, Tag
from minimp.function import Context, Function

Sizes = tuple[int, ...]  # rows to or from each rank, in rank order
COUNT_BYTES = 8  # one int64 per count message
MAX_TRAILING_AXES = 7  # a rank's layout line must fit LINE_CHARS
# The layout line travels in the agreement, one scalar per character: a dtype's name (at most 18:
# float8_e4m3b11fnuz), 7 axes of at most 19 digits and the words take fewer than 200.
LINE_CHARS = 200


def all_to_all(comm: Communicator, chunks: Sequence[Array],
               output_split_sizes: Sequence[int] | None = None) -> list[Array]:
    """[the chunk rank 0 sent this rank, ..., rank p - 1's]: chunks[j] goes to rank j. Every
    rank's chunks have one dtype and one trailing shape; their first axes may differ. Without
    output_split_sizes (the rows to expect from each rank) they are exchanged first. The results
    are views of one new C-contiguous array."""
    out, sizes = _all_to_all(comm, chunks, output_split_sizes, "all_to_all")
    return _split(out, sizes)


def all_to_all_single(comm: Communicator, x: Array, input_split_sizes: Sequence[int] | None = None,
                      output_split_sizes: Sequence[int] | None = None) -> Array:
    """x's rows cut into chunks of input_split_sizes (default: p equal chunks), chunk j sent to rank
    j; returns the chunks received, in rank order, along the first axis of a new array. Without
    either size list every chunk of every rank has x's chunk's shape (checked: Ulysses' case);
    with input_split_sizes alone the output sizes are exchanged first."""
    return _single(comm, x, input_split_sizes, output_split_sizes)[0]


def exchange_counts(comm: Communicator, input_split_sizes: Sequence[int]) -> Sizes:
    """The rows each rank will send this one (its output_split_sizes), learned from the rows each
    rank sends (input_split_sizes[j]: to rank j): an all-to-all of one int64 per rank."""
    sent = np.array(_check_sizes(comm, input_split_sizes, "input_split_sizes"), np.int64)
    chunks, ones = [sent[j:j + 1] for j in range(comm.size)], (1,) * comm.size
    return tuple(int(n) for n in _exchange(comm, chunks, ones, Tag.ALL_TO_ALL_COUNTS))


def all_to_all_bytes(input_split_sizes: Sequence[int], row_bytes: int, rank: int,
                     counts_exchanged: bool) -> int:
    """The bytes `rank` sends in one all-to-all: its rows to every other rank times row_bytes
    (the trailing shape's size times the itemsize), plus 8 (p - 1) when the counts are exchanged."""
    payload = (sum(input_split_sizes) - input_split_sizes[rank]) * row_bytes
    return payload + (COUNT_BYTES * (len(input_split_sizes) - 1) if counts_exchanged else 0)


class AllToAll(Function):
    """y = the rows every rank sent this one, in rank order (all_to_all_single);
    dL/dx = dL/dy's rows sent back where they came from: the same exchange with the counts
    transposed (each rank's output_split_sizes become its input_split_sizes)."""

    @staticmethod
    def forward(ctx: Context, x: Array, comm: Communicator,
                input_split_sizes: Sequence[int] | None = None,
                output_split_sizes: Sequence[int] | None = None) -> Array:
        """all_to_all_single(comm, x, ...), remembering both size lists for backward."""
        out, ctx.input_split_sizes, ctx.output_split_sizes = _single(
            comm, x, input_split_sizes, output_split_sizes)
        ctx.comm = comm
        return out

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        """The rows of dL/dy that came from rank i go back to rank i (output and input sizes
        swap), and the ones this rank sent to rank j come back as dL/dx's chunk j."""
        # Unchecked: the forward agreed on the layout, and dL/dy has y's shape and dtype.
        chunks = _split(grad_output, ctx.output_split_sizes)
        return _exchange(ctx.comm, chunks, ctx.input_split_sizes, Tag.ALL_TO_ALL)


def _single(comm: Communicator, x: Array, input_split_sizes: Sequence[int] | None,
            output_split_sizes: Sequence[int] | None) -> tuple[Array, Sizes, Sizes]:
    """all_to_all_single's result, its input sizes (given, checked to cover x's rows, or p equal
    chunks of them) and its output sizes."""
    if x.ndim == 0:
        raise ValueError("all_to_all_single: x needs a first axis to cut into chunks; got a 0-d "
                         "array (reshape it to (1,))")
    rows, p = x.shape[0], comm.size
    if input_split_sizes is not None:
        sizes = _check_sizes(comm, input_split_sizes, "input_split_sizes")
        if sum(sizes) != rows:
            raise ValueError(f"all_to_all_single: input_split_sizes {list(sizes)} add up to "
                             f"{sum(sizes)}, but x has {rows} rows")
    elif rows % p:
        raise ValueError(f"all_to_all_single: {rows} rows do not split into {p} equal chunks; "
                         "pass input_split_sizes")
    else:
        sizes = (rows // p,) * p
        if output_split_sizes is None:  # Ulysses: every chunk the same shape (the agreement checks)
            output_split_sizes = sizes
    out, received = _all_to_all(comm, _split(x, sizes), output_split_sizes, "all_to_all_single")
    return out, sizes, received


def _check_sizes(comm: Communicator, sizes: Sequence[int], name: str) -> Sizes:
    """sizes as ints, after checking there is one per rank and none is negative."""
    if len(sizes) != comm.size or any(int(n) != n or n < 0 for n in sizes):
        raise ValueError(f"{name} must be {comm.size} non-negative integers (one per rank), got "
                         f"{list(sizes)}")
    return tuple(int(n) for n in sizes)


def _all_to_all(comm: Communicator, chunks: Sequence[Array],
                output_split_sizes: Sequence[int] | None, name: str) -> tuple[Array, Sizes]:
    """Check the chunks here, agree with every rank, learn the sizes if need be, exchange."""
    if len(chunks) != comm.size:
        raise ValueError(f"{name}: {len(chunks)} chunks for {comm.size} ranks; pass one per rank "
                         "(chunk j goes to rank j)")
    first = chunks[0]
    if any(c.ndim == 0 or c.dtype != first.dtype or c.shape[1:] != first.shape[1:]
           for c in chunks):
        layouts = sorted({f"{c.dtype} {c.shape}" for c in chunks})
        raise ValueError(f"{name}: the chunks must share a dtype and a trailing shape, with a "
                         f"first axis to count rows along; got {', '.join(layouts)}")
    if first.ndim - 1 > MAX_TRAILING_AXES:
        raise ValueError(f"{name}: rows of {first.ndim - 1} axes; at most {MAX_TRAILING_AXES} "
                         "(reshape the rows)")
    sent = tuple(int(c.shape[0]) for c in chunks)
    if output_split_sizes is not None:
        output_split_sizes = _check_sizes(comm, output_split_sizes, "output_split_sizes")
    _agree(comm, first, sent, output_split_sizes, name)
    sizes = exchange_counts(comm, sent) if output_split_sizes is None else output_split_sizes
    return _exchange(comm, chunks, sizes, Tag.ALL_TO_ALL), sizes


def _agree(comm: Communicator, like: Array, sent: Sizes, expected: Sizes | None, name: str) -> None:
    """Raise CollectiveMismatchError on every rank, in the same line, unless every rank sends rows
    of one dtype and trailing shape, all or none pass output_split_sizes (`expected`), and each
    given size is what its sender sends. One scalar all-reduce of a p x (LINE_CHARS + 2p) table
    (a sum: each rank fills its own row, the others leave zeros)."""
    p, r, given = comm.size, comm.rank, expected is not None
    line = f"{like.dtype.name} rows of {like.shape[1:]}, sizes {'given' if given else 'exchanged'}"
    table = np.zeros((p, LINE_CHARS + 2 * p))  # row i: rank i's line, its sends, its expectations
    table[r, :len(line)] = [ord(char) for char in line]
    if expected is not None:  # [i, LINE_CHARS + j]: rank i sends rank j; [i, -p + j]: expects
        table[r, LINE_CHARS:] = [*sent, *expected]
    table = table if p == 1 else comm.allreduce_scalars(table, op="sum")
    lines, sends, expects = table[:, :LINE_CHARS], table[:, LINE_CHARS:-p], table[:, -p:]
    if (lines != lines[0]).any():
        ranks = "; ".join(f"rank {i}: " + "".join(chr(int(c)) for c in row if c)
                          for i, row in enumerate(lines))
        raise CollectiveMismatchError(f"{name}: ranks disagree on the chunks ({ranks}); every rank "
                                      "must send rows of one dtype and trailing shape, and all "
                                      "or none pass output_split_sizes")
    mismatched = np.argwhere(sends != expects.T)  # [i, j] against what rank j expects from i
    if len(mismatched):
        i, j = mismatched[0]
        raise CollectiveMismatchError(f"{name}: rank {i} sends {int(sends[i, j])} rows to rank "
                                      f"{j}, whose output_split_sizes[{i}] is "
                                      f"{int(expects[j, i])}; pass the sizes the senders send")


def _split(x: Array, sizes: Sequence[int]) -> list[Array]:
    """Views of x's rows in chunks of sizes[0], sizes[1], ... rows, in rank order."""
    return array_module(x).split(x, np.cumsum(sizes)[:-1].tolist())


def _exchange(comm: Communicator, chunks: Sequence[Array], output_split_sizes: Sequence[int],
              tag: Tag) -> Array:
    """The messages alone (the ranks agreed): every receive posted, then every send, then the
    waits. Received rows go straight into their place in the output (rows of a C-contiguous
    array are contiguous), the local chunk is copied there; an empty chunk is not sent."""
    p, r, first = comm.size, comm.rank, chunks[0]
    xp = array_module(first)
    out = xp.empty((sum(output_split_sizes), *first.shape[1:]), first.dtype)
    pieces = _split(out, output_split_sizes)
    others = [(r + step) % p for step in range(1, p)]  # sends in turn, not all to rank 0 first
    requests = [comm.irecv(pieces[s], s, tag=tag) for s in others if pieces[s].nbytes]
    # a non-contiguous chunk is sent from a contiguous copy
    requests += [comm.isend(xp.ascontiguousarray(chunks[d]), d, tag=tag) for d in others
                 if chunks[d].nbytes]
    pieces[r][...] = chunks[r]
    for request in requests:
        request.wait()
    return out
