"""The --ep dispatch: each (token, choice) pair's activation row travels to the rank holding its
expert, is computed there, and comes home (MoE's ExpertDispatch seam, minimp/models/moe.py).

Each rank routes its own tokens (per sample, as one process does) and hands over its admitted
rows sorted by expert with the count for each expert. Then, on the ep group of N ranks:

  1. counts    every rank sends rank j the rows it has for each of j's E/N experts (E/N int64
               per rank: all_to_all_single, every chunk one shape). The row totals alone, which
               all_to_all_single can exchange itself, would not tell the receiver which rows are
               which expert's, so the per-expert counts travel and the totals follow from them.
  2. dispatch  the rows: AllToAll with both size lists known (no second count exchange); rank j
               receives, from each rank in turn, its rows for j's experts, sorted by expert.
  3. experts   each local expert runs on its rows from every source (moe.run_experts).
  4. combine   the outputs go back where they came from: AllToAll with the sizes transposed.

Backward is the reverse, because AllToAll is a Function: the combine's backward sends each output
row's gradient to the expert's rank, the dispatch's backward sends each input row's gradient home.

What travels: the activation rows in the activation dtype (float32: 4 bytes per element, fp16 and
bf16: 2), C elements per row. Per call this rank sends, with S its rows to other ranks and R the
rows other ranks sent it:

    counts (N - 1) x (E/N) x 8  +  forward (S + R) x C x itemsize  [+ backward the same again]

(the dispatch sends S and the combine R; in backward the combine sends S back and the dispatch
R). `dispatch_bytes` is this formula; the trainer's bytes_by_group["expert_parallel"] equals it
every step (tests/test_parallel_expert.py). The agreements are scalar all-reduces, counted apart.
"""

from dataclasses import dataclass

import numpy as np

from minimp import nn
from minimp.distributed.alltoall import COUNT_BYTES, AllToAll, all_to_all_single
from minimp.distributed.protocol import Communicator
from minimp.models.moe import run_experts
from minimp.tensor import Tensor, grad_enabled


@dataclass
class ExpertParallelDispatch:
    """The ExpertDispatch of one rank of an ep group (comm): it holds experts comm.rank x E/N ..
    of every mixture. Counts since `reset` (every step, for the metrics): calls, the training
    forwards that dispatched; rows_sent (S) and rows_received (R) over them."""

    comm: Communicator
    calls: int = 0
    rows_sent: int = 0
    rows_received: int = 0

    def __call__(self, experts: nn.Sequential, rows: Tensor, counts: np.ndarray) -> Tensor:
        p, rank = self.comm.size, self.comm.rank
        local = len(counts) // p
        sending = np.asarray(counts, np.int64).reshape(p, local)  # [j, l]: to rank j's expert l
        receiving = all_to_all_single(self.comm, sending)  # [s, l]: from rank s for my expert l
        sent, received = tuple(sending.sum(axis=1).tolist()), tuple(receiving.sum(axis=1).tolist())
        mine = list(experts)[rank * local : (rank + 1) * local]
        x = AllToAll.apply(rows, comm=self.comm, input_split_sizes=sent,
                           output_split_sizes=received)
        y = run_experts(mine, x, receiving)
        if grad_enabled():  # a training forward (evaluations run under no_grad)
            self.calls += 1
            self.rows_sent += sum(sent) - sent[rank]
            self.rows_received += sum(received) - received[rank]
        return AllToAll.apply(y, comm=self.comm, input_split_sizes=received,
                              output_split_sizes=sent)

    def reset(self) -> None:
        """Start counting anew (each step)."""
        self.calls = self.rows_sent = self.rows_received = 0


def dispatch_bytes(calls: int, rows_sent: int, rows_received: int, experts: int, ep: int,
                   row_bytes: int) -> int:
    """The bytes one rank sends in `calls` training forwards and their backwards (the module's
    formula): calls x (N - 1) x (E/N) x 8 + 2 (S + R) x row_bytes (C x the activation itemsize)."""
    counts = calls * (ep - 1) * (experts // ep) * COUNT_BYTES
    return counts + 2 * (rows_sent + rows_received) * row_bytes
