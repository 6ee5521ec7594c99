"""The runner of a pipeline schedule: one rank's chunks of layers and the actions of one step.

The model's ordered layers are cut into P contiguous stages, one per pipeline rank, or, for an
interleaved schedule, into P x V chunks, rank r holding chunks r, r + P, ... (virtual stages).
Activations travel forward and their gradients travel back between neighbouring virtual stages as
raw bytes in the compute dtype (float16 halves them), micro-batch by micro-batch, with shapes both
sides know ahead of time (`cut_shapes`), each message under a tag of its own (direction, receiving
chunk, micro-batch). Nothing is pickled. The runner knows nothing of the model: it runs the chunk's
layers, and the last virtual stage hands its output to the loss function it was given.

Sends block (a message past MPI's eager limit waits for its receive: GPipe and 1F1B are written for
that, 1F1B with paired exchanges) unless `buffered_sends`: then they are MPI_Isend, completed at the
end of the step, which the interleaved and zero-bubble schedules need
(minimp/parallel/pipeline/schedules/dependencies.py checks both ways). A split backward runs B
(`backward_input`) and W (`backward_weight`) as two actions (minimp/split_backward.py). The six
message actions are one table (actions.py's `MESSAGES`: what each sends and receives) and one
method.
"""

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy.typing as npt

from minimp import backend
from minimp.backend import Array
from minimp.nn import Module
from minimp.parallel.pipeline.schedules.actions import ACTIVATION, MESSAGES, Action
from minimp.parallel.pipeline.split import RunLayers, StageChunk, run_layers
from minimp.parallel.topology import Topology
from minimp.split_backward import PendingWeightGradients, backward_input, backward_weight
from minimp.tensor import Tensor, saved_bytes

# Pipeline tags start here, above distributed.protocol.Tag's 1-10; they may reach Tag's bucket
# tags (1000 up), which travel on the data-parallel group, never on the pipeline's.
FIRST_TAG = 64


def message_tag(direction: int, chunk: int, micro_batch: int, micro_batches: int) -> int:
    """The tag of one ACTIVATION or GRADIENT message, named by the chunk that receives it and the
    micro-batch: every message in flight has its own, so receives posted in any order match the
    right send."""
    return FIRST_TAG + 2 * (chunk * micro_batches + micro_batch) + direction


@dataclass
class MicroBatch:
    """What a chunk holds for one micro-batch between its forward and its (last) backward.

    received: the activation from the previous stage, not yet forwarded; input: the stage's
    input, a leaf whose gradient is sent back; output: the stage's output (the loss, on the last
    stage); grad_output: the gradient of output, received from the next stage; grad_input: the
    gradient of input, waiting to be sent back; weights_pending: B done, W not yet (split
    backward); sent_back: its input's gradient has left (or there is none to send).
    """

    received: Array | None = None
    input: Tensor | None = None
    output: Tensor | None = None
    grad_output: Array | None = None
    grad_input: Array | None = None
    weights_pending: PendingWeightGradients | None = None
    sent_back: bool = False


class PipelineStage:
    """One rank's chunks of layers and the runner of a schedule's actions for one step."""

    def __init__(self, layers: list[Module], topology: Topology, *, input_shape: tuple[int, ...],
                 output_shape: tuple[int, ...], dtype: npt.DTypeLike,
                 loss_fn: Callable[[Tensor, Array], Tensor], run_group: RunLayers = run_layers,
                 more_chunks: Sequence[StageChunk] = (), buffered_sends: bool = False):
        """layers: this rank's first chunk of the model; topology: this rank's place in the grid
        (its pp_group carries the activations); dtype: the activations' dtype on the wire and in
        the receive buffers. input_shape / output_shape: one micro-batch's activation entering /
        leaving `layers`.
        loss_fn(output, targets) -> scalar loss Tensor, called on the last virtual stage.
        run_group(layers, x): how each group of layers (`layer_groups`) runs: in order by
        default; recomputed (--recompute) and gathered (ZeRO stage 3) when the trainer says so.
        more_chunks: this rank's further chunks, in order (virtual stages r + P, r + 2P, ...).
        buffered_sends: send with MPI_Isend and complete the sends at the end of the step."""
        self.chunks = [StageChunk(layers, input_shape, output_shape), *more_chunks]
        self.topology, self.comm, self.dtype = topology, topology.pp_group, dtype
        self.layers = [layer for chunk in self.chunks for layer in chunk.layers]
        self.loss_fn, self.run_group, self.buffered_sends = loss_fn, run_group, buffered_sends
        self.groups = [group for chunk in self.chunks for group in chunk.groups]
        self.parameters = [p for chunk in self.chunks for p in chunk.parameters]
        self.peak_stored = 0  # the most micro-batches whose activations this stage held at once
        self.activation_bytes: dict[tuple, int] = {}  # kept for backward, by (chunk, mb)
        self.peak_activation_bytes = 0  # this step's most bytes kept for backward at once

    def forward(self, x: Tensor, chunk: int = 0) -> Tensor:
        """One chunk's layers applied in order, group by group."""
        for group in self.chunks[chunk].groups:
            x = self.run_group(group, x)
        return x

    def run(self, actions: list[Action], *, inputs: list[Array] | None,
            targets: list[Array] | None, scale_loss: Callable[[Tensor], Tensor],
            after_backward: Callable[[], object],
            record: Callable[[str, int, float, float], None] | None = None,
            before_forward: Callable[[int], None] | None = None) -> float:
        """Run one step's actions; returns the sum of the micro-batch losses (last stage; else 0).

        inputs / targets: per micro-batch arrays (first / last stage).
        scale_loss(loss) -> the tensor to call backward on.
        after_backward() runs after each backward (after W when it is split): gradient accumulation.
        record(op, micro_batch, start, end) receives every action's timing (compute and messages).
        before_forward(micro_batch) runs before each forward (a model with dropout learns there
        which global samples the micro-batch holds).
        """
        self._micro_batches: dict[tuple[int, int], MicroBatch] = {}
        self._inputs, self._targets = inputs, targets
        self._scale_loss, self._after_backward = scale_loss, after_backward
        self._before_forward = before_forward
        self._loss_sum = 0.0
        self._count = 1 + max((action.micro_batch for action in actions), default=0)
        self._sends: list = []  # MPI_Isend requests in flight (buffered_sends)
        self.activation_bytes, self.peak_activation_bytes = {}, 0
        for action in actions:
            start = time.perf_counter()
            if action.op in MESSAGES:
                self._message(action, *MESSAGES[action.op])
            else:
                getattr(self, "_" + action.op)(action)
            if record is not None:
                record(action.op, action.micro_batch, start, time.perf_counter())
        start = time.perf_counter()
        for request in self._sends:
            request.wait()
        if record is not None and self._sends:
            record("wait_sends", -1, start, time.perf_counter())
        return self._loss_sum

    # ----- where a chunk sits in the pipeline -------------------------------------------------
    def _is_first(self, chunk: int) -> bool:
        return self.topology.is_first_stage and chunk == 0

    def _is_last(self, chunk: int) -> bool:
        return self.topology.is_last_stage and chunk == len(self.chunks) - 1

    def _neighbour(self, chunk: int, step: int) -> tuple[int, int]:
        """(pp rank, chunk) of the virtual stage `step` (+1: the next, -1: the previous) from this
        chunk's: past the last stage the ring of stages goes on in the next chunk."""
        stage = self.topology.stage + step
        return stage % self.topology.pp, chunk + stage // self.topology.pp

    def _state(self, action: Action, micro_batch: int | None = None) -> MicroBatch:
        key = (action.chunk, action.micro_batch if micro_batch is None else micro_batch)
        return self._micro_batches.setdefault(key, MicroBatch())

    def _finish_if_done(self, key: tuple[int, int]) -> None:
        """Forget a micro-batch once its input's gradient has left and its W (if split) ran."""
        state = self._micro_batches[key]
        if state.sent_back and state.weights_pending is None:
            del self._micro_batches[key]

    # ----- compute ----------------------------------------------------------------------------
    def _forward(self, action: Action) -> None:
        state, chunk = self._state(action), action.chunk
        if self._before_forward is not None:
            self._before_forward(action.micro_batch)
        if self._is_first(chunk):
            assert self._inputs is not None  # the first stage is given the inputs
            x = Tensor(self._inputs[action.micro_batch])
        else:  # a leaf that wants its gradient: that gradient is what we send back
            assert state.received is not None  # a schedule receives before it forwards
            x = Tensor(state.received, requires_grad=True)
            state.received = None
        state.input, output = x, self.forward(x, chunk)
        if self._is_last(chunk):
            assert self._targets is not None  # the last stage is given the targets
            output = self.loss_fn(output, self._targets[action.micro_batch])
            self._loss_sum += output.item()
        state.output = output
        # micro-batches alive: from the forward until the backward (its W, when split) is done
        alive = sum(other.output is not None or other.weights_pending is not None
                    for other in self._micro_batches.values())
        self.peak_stored = max(self.peak_stored, alive)
        if output.requires_grad:  # what this micro-batch's graph keeps (weights not counted)
            weights = [parameter.data for parameter in self.parameters]
            key = (chunk, action.micro_batch)
            self.activation_bytes[key] = saved_bytes(output, exclude=weights)
        in_flight = sum(self.activation_bytes.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, in_flight)

    def _backward(self, action: Action, split: bool = False) -> None:
        key, state = (action.chunk, action.micro_batch), self._state(action)
        assert state.input is not None and state.output is not None  # its forward ran
        if self._is_last(action.chunk):
            root, grad = self._scale_loss(state.output), None
        else:
            root, grad = state.output, state.grad_output
        if split:  # B: the input's gradient now, the weights' (W) in a later action
            weights = self.chunks[action.chunk].parameters
            state.weights_pending = backward_input(root, grad, weights)
        else:
            root.backward(grad)
            self.activation_bytes.pop(key, None)
            self._after_backward()
        state.grad_input = None if self._is_first(action.chunk) else state.input.grad
        state.sent_back = self._is_first(action.chunk)  # the first stage sends nothing back
        state.output = state.grad_output = None
        self._finish_if_done(key)
        state.input = None

    def _backward_input(self, action: Action) -> None:
        self._backward(action, split=True)

    def _backward_weight(self, action: Action) -> None:
        key, state = (action.chunk, action.micro_batch), self._state(action)
        if state.weights_pending is None:
            raise RuntimeError(f"{action!r}: W before the micro-batch's B on this chunk")
        backward_weight(state.weights_pending)
        state.weights_pending = None
        self.activation_bytes.pop(key, None)
        self._after_backward()
        self._finish_if_done(key)

    # ----- messages ---------------------------------------------------------------------------
    def _message(self, action: Action, send: int | None, receive: int | None) -> None:
        """Send (in direction `send`), receive (in direction `receive`), or both at once as one
        Sendrecv with the same neighbour (a paired exchange: `action.received` names the
        micro-batch whose activation or gradient comes back)."""
        outgoing = None if send is None else self._outgoing(action, send)
        if receive is None:
            assert outgoing is not None  # every message op sends, receives or both
            self._send(*outgoing)
            return
        micro_batch = action.micro_batch if action.received is None else action.received
        chunk = self.chunks[action.chunk]
        shape = chunk.input_shape if receive == ACTIVATION else chunk.output_shape
        buffer = backend.current_device().xp.empty(shape, self.dtype)
        tag = message_tag(receive, action.chunk, micro_batch, self._count)
        if outgoing is None:  # an activation comes from the previous stage, a gradient the next
            source, _ = self._neighbour(action.chunk, -1 if receive == ACTIVATION else +1)
            self.comm.recv(buffer, source, tag=tag)
        else:
            array, rank, send_tag = outgoing
            self.comm.sendrecv(array, rank, buffer, rank, tag=send_tag, recv_tag=tag)
        state = self._state(action, micro_batch)
        if receive == ACTIVATION:
            state.received = buffer
        else:
            state.grad_output = buffer

    def _outgoing(self, action: Action, direction: int) -> tuple[Array, int, int]:
        """(array, pp rank, tag) of what this chunk sends: its output to the next virtual stage
        (ACTIVATION), or its input's gradient to the previous one (GRADIENT)."""
        key = (action.chunk, action.micro_batch)
        state = self._micro_batches[key]
        if direction == ACTIVATION:
            assert state.output is not None  # sent after its forward
            array = state.output.data
        else:  # the micro-batch is then finished on this chunk (once its W, if split, has run)
            array, state.grad_input, state.sent_back = state.grad_input, None, True
            self._finish_if_done(key)
        rank, chunk = self._neighbour(action.chunk, +1 if direction == ACTIVATION else -1)
        return array, rank, message_tag(direction, chunk, action.micro_batch, self._count)

    def _send(self, array: Array, dest: int, tag: int) -> None:
        if self.buffered_sends:
            self._sends.append(self.comm.isend(array, dest, tag=tag))
        else:
            self.comm.send(array, dest, tag=tag)
