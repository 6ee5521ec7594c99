"""Pipeline parallelism by layer-wise splitting: contiguous stages, and the runner of a schedule.

The model's ordered layers are cut into P contiguous stages, one per pipeline rank. Activations
travel forward and their gradients travel back between neighbouring stages as raw bytes in the
compute dtype (float16 halves them), micro-batch by micro-batch, with shapes both sides know ahead
of time (`cut_shapes`). Nothing is pickled. The runner knows nothing of the model: it runs the
stage's layers, and the last stage hands its output to the loss function it was given.
"""

import time
from dataclasses import dataclass
from typing import Any, Callable

from minimp import backend
from minimp.distributed.protocol import Tag
from minimp.parallel.schedules import Action
from minimp.parallel.topology import Topology
from minimp.tensor import Tensor, no_grad


class PipelineError(ValueError):
    """The model cannot be split as asked."""


def split_stages(layers: list, stages: int) -> list[tuple[int, int]]:
    """[(start, stop)] layer ranges of `stages` contiguous stages, balanced by parameter count.

    Parameter count is the cost because, in an MLP, each weight costs the same multiply-adds per
    sample forward and backward. Each layer with parameters opens a block that also takes the
    parameter-free layers after it (a ReLU stays with its Linear); blocks are then cut so that the
    most expensive stage is as cheap as possible (`_balanced_cuts`).
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


def _balanced_cuts(costs: list[int], parts: int) -> list[int]:
    """Cut points splitting costs into `parts` contiguous non-empty groups, minimising the largest
    sum: a binary search over that largest sum, each candidate tried by one greedy pass. That is
    O(n log(total)); the textbook dynamic programme is O(parts n^2), minutes for 10^4 layers."""
    low, high = max(costs), sum(costs)
    while low < high:  # the smallest limit that `parts` groups can keep to
        middle = (low + high) // 2
        if _groups_needed(costs, middle) <= parts:
            high = middle
        else:
            low = middle + 1
    return _greedy_cuts(costs, low, parts)


def _groups_needed(costs: list[int], limit: int) -> int:
    """How many groups a greedy pass needs when no group may sum to more than limit."""
    groups, total = 1, 0
    for cost in costs:
        if total + cost > limit:
            groups, total = groups + 1, 0
        total += cost
    return groups


def _greedy_cuts(costs: list[int], limit: int, parts: int) -> list[int]:
    """Fill each group up to `limit`, but cut early where the blocks left are just enough to give
    each of the remaining groups one."""
    cuts: list[int] = []
    total = 0
    for index, cost in enumerate(costs):
        groups_after_this_one = parts - len(cuts) - 1
        if index > 0 and (total + cost > limit or len(costs) - index == groups_after_this_one):
            cuts.append(index)
            total = 0
        total += cost
    return cuts


def cut_shapes(layers: list, sample: Any) -> list[tuple[int, ...]]:
    """shapes[i]: the shape of the activation entering layer i for one micro-batch `sample`
    (shapes[len(layers)] is the output's). One forward without a graph, on every rank, so both
    sides of every cut know the shape of the bytes they exchange."""
    shapes, x = [tuple(sample.shape)], Tensor(sample)
    with no_grad():
        for layer in layers:
            x = layer(x)
            shapes.append(tuple(x.shape))
    return shapes


def stage_parameters(model: Any, bounds: tuple[int, int]) -> list[tuple[str, Any]]:
    """(name, Parameter) of the layers in range(*bounds) of a Sequential, named as in the whole
    model ("4.weight"), so every layout writes the same checkpoint names."""
    start, stop = bounds
    return [
        (name, parameter)
        for name, parameter in model.named_parameters()
        if start <= int(name.split(".")[0]) < stop
    ]


@dataclass
class MicroBatch:
    """What a stage holds for one micro-batch between its forward and its backward."""

    received: Any = None  # the activation from the previous stage, not yet forwarded
    input: Tensor | None = None  # the stage's input: a leaf whose gradient is sent back
    output: Tensor | None = None  # the stage's output (the loss, on the last stage)
    grad_output: Any = None  # the gradient of output, received from the next stage
    grad_input: Any = None  # the gradient of input, waiting to be sent back


class PipelineStage:
    """One stage's layers and the runner that executes a schedule's actions for one step."""

    def __init__(
        self,
        layers: list,
        topology: Topology,
        *,
        input_shape: tuple[int, ...],
        output_shape: tuple[int, ...],
        dtype: Any,
        loss_fn: Callable[[Tensor, Any], Tensor],
    ):
        """input_shape / output_shape: one micro-batch's activation entering / leaving this stage.
        loss_fn(output, targets) -> scalar loss Tensor, called on the last stage."""
        self.layers, self.topology, self.comm = layers, topology, topology.pp_group
        self.input_shape, self.output_shape, self.dtype = input_shape, output_shape, dtype
        self.loss_fn = loss_fn
        self.peak_stored = 0  # the most micro-batches whose activations this stage held at once

    def forward(self, x: Tensor) -> Tensor:
        """This stage's layers applied in order."""
        for layer in self.layers:
            x = layer(x)
        return x

    def run(
        self,
        actions: list[Action],
        *,
        inputs: list | None,
        targets: list | None,
        scale_loss: Callable[[Tensor], Tensor],
        after_backward: Callable[[], Any],
        record: Callable[[str, int, float, float], None] | None = None,
        before_forward: Callable[[int], None] | None = None,
    ) -> float:
        """Run one step's actions; returns the sum of the micro-batch losses (last stage; else 0).

        inputs / targets: per micro-batch arrays (first / last stage).
        scale_loss(loss) -> the tensor to call backward on.
        after_backward() runs after each backward (gradient accumulation).
        record(op, micro_batch, start, end) receives every action's timing (compute and
        messages).
        before_forward(micro_batch) runs before each forward (a model with dropout learns there
        which global samples the micro-batch holds).
        """
        self._micro_batches: dict[int, MicroBatch] = {}
        self._inputs, self._targets = inputs, targets
        self._scale_loss, self._after_backward = scale_loss, after_backward
        self._before_forward = before_forward
        self._loss_sum = 0.0
        for action in actions:
            start = time.perf_counter()
            getattr(self, "_" + action.op)(action)
            if record is not None:
                record(action.op, action.micro_batch, start, time.perf_counter())
        return self._loss_sum

    def _state(self, micro_batch: int) -> MicroBatch:
        return self._micro_batches.setdefault(micro_batch, MicroBatch())

    def _buffer(self, shape: tuple[int, ...]) -> Any:
        return backend.default_xp().empty(shape, self.dtype)

    # ----- compute ----------------------------------------------------------------------------
    def _forward(self, action: Action) -> None:
        state, topology = self._state(action.micro_batch), self.topology
        if self._before_forward is not None:
            self._before_forward(action.micro_batch)
        if topology.is_first_stage:
            state.input = Tensor(self._inputs[action.micro_batch])
        else:  # a leaf that wants its gradient: that gradient is what we send back
            state.input = Tensor(state.received, requires_grad=True)
            state.received = None
        output = self.forward(state.input)
        if topology.is_last_stage:
            output = self.loss_fn(output, self._targets[action.micro_batch])
            self._loss_sum += output.item()
        state.output = output
        alive = sum(s.output is not None for s in self._micro_batches.values())
        self.peak_stored = max(self.peak_stored, alive)

    def _backward(self, action: Action) -> None:
        state = self._micro_batches[action.micro_batch]
        if self.topology.is_last_stage:
            self._scale_loss(state.output).backward()
        else:
            state.output.backward(state.grad_output)
        self._after_backward()
        if self.topology.is_first_stage:  # nothing to send back: done with this micro-batch
            del self._micro_batches[action.micro_batch]
            return
        state.grad_input = state.input.grad
        state.input = state.output = state.grad_output = None

    # ----- messages ---------------------------------------------------------------------------
    def _recv_forward(self, action: Action) -> None:
        buffer = self._buffer(self.input_shape)
        self.comm.recv(buffer, self.topology.previous_stage, tag=Tag.PIPELINE_FORWARD)
        self._state(action.micro_batch).received = buffer

    def _send_forward(self, action: Action) -> None:
        output = self._micro_batches[action.micro_batch].output
        self.comm.send(output.data, self.topology.next_stage, tag=Tag.PIPELINE_FORWARD)

    def _recv_backward(self, action: Action) -> None:
        buffer = self._buffer(self.output_shape)
        self.comm.recv(buffer, self.topology.next_stage, tag=Tag.PIPELINE_BACKWARD)
        self._state(action.micro_batch).grad_output = buffer

    def _send_backward(self, action: Action) -> None:
        grad = self._pop_grad_input(action.micro_batch)
        self.comm.send(grad, self.topology.previous_stage, tag=Tag.PIPELINE_BACKWARD)

    def _send_forward_recv_backward(self, action: Action) -> None:
        output = self._micro_batches[action.micro_batch].output
        grad_output = self._exchange(
            output.data, self.topology.next_stage, Tag.PIPELINE_FORWARD, self.output_shape
        )
        self._state(action.received).grad_output = grad_output

    def _send_backward_recv_forward(self, action: Action) -> None:
        grad_input = self._pop_grad_input(action.micro_batch)
        received = self._exchange(
            grad_input, self.topology.previous_stage, Tag.PIPELINE_BACKWARD, self.input_shape
        )
        self._state(action.received).received = received

    def _exchange(self, outgoing: Any, neighbour: int, tag: Tag, shape: tuple) -> Any:
        """One Sendrecv with a neighbour: our data goes out under `tag`, theirs (travelling the
        other way, so under the other direction's tag) comes back into a new buffer."""
        reply_tag = Tag.PIPELINE_BACKWARD if tag == Tag.PIPELINE_FORWARD else Tag.PIPELINE_FORWARD
        buffer = self._buffer(shape)
        self.comm.sendrecv(outgoing, neighbour, buffer, neighbour, tag=tag, recv_tag=reply_tag)
        return buffer

    def _pop_grad_input(self, micro_batch: int) -> Any:
        """The input gradient to send back; the micro-batch is then finished on this stage."""
        return self._micro_batches.pop(micro_batch).grad_input
