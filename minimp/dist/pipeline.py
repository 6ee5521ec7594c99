"""Pipeline parallelism by layer-wise splitting: contiguous stages, and the runner of a schedule.

The model's ordered layers are cut into P contiguous stages, one per pipeline rank. Activations
travel forward and their gradients travel back between neighbouring stages as raw bytes in the
compute dtype (float16 halves them), micro-batch by micro-batch, with shapes both sides know ahead
of time: (micro-batch size, width of the layer at the cut). Nothing is pickled.
"""

import time

from minimp import backend, functional
from minimp.tensor import Tensor

FORWARD_TAG, BACKWARD_TAG = (
    0,
    1,
)  # one tag per direction: MPI keeps each direction's messages in order


class PipelineError(ValueError):
    """The model cannot be split as asked."""


def split_stages(layers, stages):
    """[(start, stop)] layer ranges of `stages` contiguous stages, balanced by parameter count.

    Parameter count is the cost because, in an MLP, each weight costs the same multiply-adds per
    sample forward and backward. Each layer with parameters opens a block that also takes the
    parameter-free layers after it (a ReLU stays with its Linear); blocks are then cut so that the
    most expensive stage is as cheap as possible (dynamic programming over the cut points).
    """
    counts = [sum(p.size for p in layer.parameters()) for layer in layers]
    starts = [i for i, count in enumerate(counts) if count > 0]
    if stages > len(starts):
        raise PipelineError(
            f"--pp {stages} needs at least {stages} layers with weights, the model has "
            f"{len(starts)} (use --layers)"
        )
    starts[0] = 0
    blocks = [(start, stop) for start, stop in zip(starts, starts[1:] + [len(layers)])]
    costs = [sum(counts[a:b]) for a, b in blocks]
    cuts = _balanced_cuts(costs, stages)
    return [
        (blocks[first][0], blocks[last - 1][1])
        for first, last in zip([0] + cuts, cuts + [len(blocks)])
    ]


def _balanced_cuts(costs, parts):
    """Cut points splitting costs into `parts` contiguous non-empty groups minimising the largest
    sum."""
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    infinity = float("inf")
    # best[k][i]: the smallest possible largest group when the first i blocks form k groups
    best = [[infinity] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    cuts, i = [], n
    for k in range(parts, 1, -1):
        i = choice[k][i]
        cuts.append(i)
    return cuts[::-1]


class PipelineStage:
    """One stage's layers and the runner that executes a schedule's actions for one step."""

    def __init__(
        self, layers, comm, stage, stages, input_width, output_width, dtype, micro_batch_rows
    ):
        self.layers, self.comm, self.stage, self.stages = layers, comm, stage, stages
        self.input_width, self.output_width, self.dtype = input_width, output_width, dtype
        self.micro_batch_rows = micro_batch_rows  # every micro-batch has this many rows
        self.first, self.last = stage == 0, stage == stages - 1
        self.peak_stored = 0  # the most micro-batches whose activations this stage held at once

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def run(self, actions, inputs, targets, scale_loss, after_backward, record=None):
        """Execute one step's actions. inputs / targets: per micro-batch arrays (first / last
        stage). scale_loss(loss) -> the tensor to call backward on; after_backward() runs after
        each backward (gradient accumulation). Returns the sum of the micro-batch losses (last
        stage; else 0). record(kind, micro_batch, start, end) receives every forward and
        backward's timing."""
        # Per micro-batch: input tensors, outputs (or losses), received activations, received
        # gradients, and input gradients waiting to be sent back.
        state = {
            "inputs": {},
            "outputs": {},
            "received": {},
            "grads": {},
            "to_send": {},
            "loss": 0.0,
        }
        handlers = {
            "forward": self._forward,
            "backward": self._backward,
            "recv_forward": self._recv_forward,
            "send_forward": self._send_forward,
            "recv_backward": self._recv_backward,
            "send_backward": self._send_backward,
            "send_forward_recv_backward": self._send_forward_recv_backward,
            "send_backward_recv_forward": self._send_backward_recv_forward,
        }
        context = (inputs, targets, scale_loss, after_backward)
        for action in actions:
            start = time.perf_counter()
            handlers[action[0]](state, context, *action[1:])
            if record is not None and action[0] in ("forward", "backward"):
                record(action[0], action[1], start, time.perf_counter())
        return state["loss"]

    def _buffer(self, width):
        return backend.default_xp().empty((self.micro_batch_rows, width), self.dtype)

    def _forward(self, state, context, mb):
        inputs, targets, _, _ = context
        if self.first:
            x = Tensor(inputs[mb])
        else:  # a leaf that wants its gradient: that gradient is what we send back
            x = Tensor(state["received"].pop(mb), requires_grad=True)
        output = self.forward(x)
        if self.last:
            output = functional.cross_entropy(output, Tensor(targets[mb]))
            state["loss"] += output.item()
        state["inputs"][mb], state["outputs"][mb] = x, output
        self.peak_stored = max(self.peak_stored, len(state["outputs"]))

    def _backward(self, state, context, mb):
        _, _, scale_loss, after_backward = context
        output = state["outputs"].pop(mb)
        if self.last:
            scale_loss(output).backward()
        else:
            output.backward(state["grads"].pop(mb))
        after_backward()
        x = state["inputs"].pop(mb)
        if not self.first:
            state["to_send"][mb] = x.grad

    def _recv_forward(self, state, context, mb):
        buffer = self._buffer(self.input_width)
        self.comm.recv(buffer, self.stage - 1, tag=FORWARD_TAG)
        state["received"][mb] = buffer

    def _send_forward(self, state, context, mb):
        self.comm.send(state["outputs"][mb].data, self.stage + 1, tag=FORWARD_TAG)

    def _recv_backward(self, state, context, mb):
        buffer = self._buffer(self.output_width)
        self.comm.recv(buffer, self.stage + 1, tag=BACKWARD_TAG)
        state["grads"][mb] = buffer

    def _send_backward(self, state, context, mb):
        self.comm.send(state["to_send"].pop(mb), self.stage - 1, tag=BACKWARD_TAG)

    def _send_forward_recv_backward(self, state, context, sent_mb, received_mb):
        buffer = self._buffer(self.output_width)
        self.comm.sendrecv(
            state["outputs"][sent_mb].data,
            self.stage + 1,
            buffer,
            self.stage + 1,
            tag=FORWARD_TAG,
            recv_tag=BACKWARD_TAG,
        )
        state["grads"][received_mb] = buffer

    def _send_backward_recv_forward(self, state, context, sent_mb, received_mb):
        buffer = self._buffer(self.input_width)
        self.comm.sendrecv(
            state["to_send"].pop(sent_mb),
            self.stage - 1,
            buffer,
            self.stage - 1,
            tag=BACKWARD_TAG,
            recv_tag=FORWARD_TAG,
        )
        state["received"][received_mb] = buffer
