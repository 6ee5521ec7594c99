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
from minimp.parallel.stages import layer_groups, run_layers
from minimp.parallel.topology import Topology
from minimp.parallel.zero_layout import reachable_parameters
from minimp.tensor import Tensor, saved_bytes


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
        run_group: Callable[[list, Tensor], Tensor] = run_layers,
    ):
        """input_shape / output_shape: one micro-batch's activation entering / leaving this stage.
        loss_fn(output, targets) -> scalar loss Tensor, called on the last stage.
        run_group(layers, x): how each group of layers (`layer_groups`) runs: in order by
        default; recomputed (--recompute) and gathered (ZeRO stage 3) when the trainer says so."""
        self.layers, self.topology, self.comm = layers, topology, topology.pp_group
        self.input_shape, self.output_shape, self.dtype = input_shape, output_shape, dtype
        self.loss_fn, self.run_group = loss_fn, run_group
        self.groups = [layers[start:stop] for start, stop in layer_groups(layers)]
        self.parameters = [p for layer in layers for p in reachable_parameters(layer)]
        self.peak_stored = 0  # the most micro-batches whose activations this stage held at once
        self.activation_bytes: dict[int, int] = {}  # kept for backward, by micro-batch in flight
        self.peak_activation_bytes = 0  # this step's most bytes kept for backward at once

    def forward(self, x: Tensor) -> Tensor:
        """This stage's layers applied in order, group by group."""
        for group in self.groups:
            x = self.run_group(group, x)
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
        self.activation_bytes, self.peak_activation_bytes = {}, 0
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
        if output.requires_grad:  # what this micro-batch's graph keeps (weights not counted)
            weights = [parameter.data for parameter in self.parameters]
            self.activation_bytes[action.micro_batch] = saved_bytes(output, exclude=weights)
        in_flight = sum(self.activation_bytes.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, in_flight)

    def _backward(self, action: Action) -> None:
        state = self._micro_batches[action.micro_batch]
        if self.topology.is_last_stage:
            self._scale_loss(state.output).backward()
        else:
            state.output.backward(state.grad_output)
        self.activation_bytes.pop(action.micro_batch, None)
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
