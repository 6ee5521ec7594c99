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
R). A forward without a graph has no backward: --recompute's first forward of a block, which its
backward runs again with the graph, so a recomputed block's call sends the counts and the forward
rows twice. `dispatch_bytes` is this formula, the calls with and without a graph counted apart;
the trainer's bytes_by_group["expert_parallel"] equals it every step (tests/test_train_moe.py).
The agreements are scalar all-reduces, counted apart.
"""

from dataclasses import dataclass, field

import numpy as np

from minimp import nn
from minimp.distributed.alltoall import COUNT_BYTES, AllToAll, all_to_all_single
from minimp.distributed.protocol import Communicator
from minimp.models.moe import run_experts
from minimp.tensor import Tensor, grad_enabled


@dataclass
class DispatchCounts:
    """What some calls moved: calls, rows_sent (S) and rows_received (R) summed over them."""

    calls: int = 0
    rows_sent: int = 0
    rows_received: int = 0


@dataclass
class ExpertParallelDispatch:
    """The ExpertDispatch of one rank of an ep group (comm): it holds experts comm.rank x E/N ..
    of every mixture. Counts since `reset` (every step, for the metrics): with_graph, the
    training forwards whose backward runs too, and without_graph, those without (--recompute's
    first forwards; the evaluations run the whole model's local experts, and after the step's
    metrics: minimp/train/meter.py)."""

    comm: Communicator
    with_graph: DispatchCounts = field(default_factory=DispatchCounts)
    without_graph: DispatchCounts = field(default_factory=DispatchCounts)

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
        tally = self.with_graph if grad_enabled() else self.without_graph
        tally.calls += 1
        tally.rows_sent += sum(sent) - sent[rank]
        tally.rows_received += sum(received) - received[rank]
        return AllToAll.apply(y, comm=self.comm, input_split_sizes=received,
                              output_split_sizes=sent)

    def reset(self) -> None:
        """Start counting anew (each step)."""
        self.with_graph, self.without_graph = DispatchCounts(), DispatchCounts()


def dispatch_bytes(calls: int, rows_sent: int, rows_received: int, experts: int, ep: int,
                   row_bytes: int, without_graph: DispatchCounts | None = None) -> int:
    """The bytes one rank sends in `calls` training forwards and their backwards, and in the
    forwards `without_graph` (the module's formula): calls x (N - 1) x (E/N) x 8 + 2 (S + R) x
    row_bytes (C x the activation itemsize), plus calls' x (N - 1) x (E/N) x 8 + (S' + R') x
    row_bytes for the forwards without a graph."""
    without_graph = without_graph or DispatchCounts()
    counts = (calls + without_graph.calls) * (ep - 1) * (experts // ep) * COUNT_BYTES
    forward_only = without_graph.rows_sent + without_graph.rows_received
    return counts + (2 * (rows_sent + rows_received) + forward_only) * row_bytes
