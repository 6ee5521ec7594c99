"""Pipeline parallelism by layer-wise splitting: contiguous stages, and the runner of a schedule.

The model's ordered layers are cut into P contiguous stages, one per pipeline rank, or, for an
interleaved schedule, into P x V chunks, rank r holding chunks r, r + P, ... (virtual stages).
Activations travel forward and their gradients travel back between neighbouring virtual stages as
raw bytes in the compute dtype (float16 halves them), micro-batch by micro-batch, with shapes both
sides know ahead of time (`cut_shapes`), each message under a tag of its own (direction, receiving
chunk, micro-batch). Nothing is pickled. The runner knows nothing of the model: it runs the chunk's
layers, and the last virtual stage hands its output to the loss function it was given.

Sends block (a message past MPI's eager limit waits for its receive: GPipe and 1F1B are written for
that, 1F1B with paired exchanges) unless `buffered_sends`: then they are MPI_Isend, completed at the
end of the step, which the interleaved and zero-bubble schedules need (minimp/parallel/
dependencies.py checks both ways). A split backward runs B (`backward_input`) and W
(`backward_weight`) as two actions (minimp/split_backward.py).
"""

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from minimp import backend
from minimp.parallel.pipeline.schedules.actions import Action
from minimp.parallel.pipeline.split import StageChunk, run_layers
from minimp.parallel.topology import Topology
from minimp.split_backward import PendingWeightGradients, backward_input, backward_weight
from minimp.tensor import Tensor, saved_bytes

FIRST_TAG = 64  # pipeline tags start here, above minimp.distributed.protocol.Tag's
FORWARD, BACKWARD = 0, 1  # a message's direction, in its tag


def message_tag(direction: int, chunk: int, micro_batch: int, micro_batches: int) -> int:
    """The tag of one activation (FORWARD) or gradient (BACKWARD) message, named by the chunk that
    receives it and the micro-batch: every message in flight has its own, so receives posted in
    any order match the right send."""
    return FIRST_TAG + 2 * (chunk * micro_batches + micro_batch) + direction


@dataclass
class MicroBatch:
    """What a chunk holds for one micro-batch between its forward and its (last) backward."""

    received: Any = None  # the activation from the previous stage, not yet forwarded
    input: Tensor | None = None  # the stage's input: a leaf whose gradient is sent back
    output: Tensor | None = None  # the stage's output (the loss, on the last stage)
    grad_output: Any = None  # the gradient of output, received from the next stage
    grad_input: Any = None  # the gradient of input, waiting to be sent back
    weights_pending: PendingWeightGradients | None = None  # B done, W not yet (split backward)
    sent_back: bool = False  # its input's gradient has left (or there is none to send)


class PipelineStage:
    """One rank's chunks of layers and the runner that executes a schedule's actions for one
    step."""

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
        more_chunks: Sequence[StageChunk] = (),
        buffered_sends: bool = False,
    ):
        """input_shape / output_shape: one micro-batch's activation entering / leaving `layers`.
        loss_fn(output, targets) -> scalar loss Tensor, called on the last virtual stage.
        run_group(layers, x): how each group of layers (`layer_groups`) runs: in order by
        default; recomputed (--recompute) and gathered (ZeRO stage 3) when the trainer says so.
        more_chunks: this rank's further chunks, in order (virtual stages r + P, r + 2P, ...).
        buffered_sends: send with MPI_Isend and complete the sends at the end of the step."""
        self.chunks = [StageChunk(layers, input_shape, output_shape), *more_chunks]
        self.topology, self.comm = topology, topology.pp_group
        self.layers = [layer for chunk in self.chunks for layer in chunk.layers]
        self.input_shape, self.output_shape, self.dtype = input_shape, output_shape, dtype
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
        after_backward() runs after each backward (after W when it is split): gradient
        accumulation.
        record(op, micro_batch, start, end) receives every action's timing (compute and
        messages).
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

    def _next(self, chunk: int) -> tuple[int, int]:
        """(pp rank, chunk) of the virtual stage after this chunk's."""
        stages = self.topology.pp
        wraps = self.topology.stage == stages - 1
        return (self.topology.stage + 1) % stages, chunk + (1 if wraps else 0)

    def _previous(self, chunk: int) -> tuple[int, int]:
        stages = self.topology.pp
        wraps = self.topology.stage == 0
        return (self.topology.stage - 1) % stages, chunk - (1 if wraps else 0)

    def _state(self, action: Action, micro_batch: int | None = None) -> MicroBatch:
        key = (action.chunk, action.micro_batch if micro_batch is None else micro_batch)
        return self._micro_batches.setdefault(key, MicroBatch())

    def _buffer(self, shape: tuple[int, ...]) -> Any:
        return backend.current_device().xp.empty(shape, self.dtype)

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
            state.input = Tensor(self._inputs[action.micro_batch])
        else:  # a leaf that wants its gradient: that gradient is what we send back
            state.input = Tensor(state.received, requires_grad=True)
            state.received = None
        output = self.forward(state.input, chunk)
        if self._is_last(chunk):
            output = self.loss_fn(output, self._targets[action.micro_batch])
            self._loss_sum += output.item()
        state.output = output
        alive = sum(  # from the forward until the backward (its W, when split) is done
            s.output is not None or s.weights_pending is not None
            for s in self._micro_batches.values()
        )
        self.peak_stored = max(self.peak_stored, alive)
        if output.requires_grad:  # what this micro-batch's graph keeps (weights not counted)
            weights = [parameter.data for parameter in self.parameters]
            key = (chunk, action.micro_batch)
            self.activation_bytes[key] = saved_bytes(output, exclude=weights)
        in_flight = sum(self.activation_bytes.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, in_flight)

    def _backward(self, action: Action, split: bool = False) -> None:
        key, state = (action.chunk, action.micro_batch), self._state(action)
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
        if state.sent_back and state.weights_pending is None:
            del self._micro_batches[key]
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
    def _send(self, array: Any, dest: int, tag: int) -> None:
        if self.buffered_sends:
            self._sends.append(self.comm.isend(array, dest, tag=tag))
        else:
            self.comm.send(array, dest, tag=tag)

    def _recv_forward(self, action: Action) -> None:
        buffer = self._buffer(self.chunks[action.chunk].input_shape)
        tag = message_tag(FORWARD, action.chunk, action.micro_batch, self._count)
        self.comm.recv(buffer, self._previous(action.chunk)[0], tag=tag)
        self._state(action).received = buffer

    def _send_forward(self, action: Action) -> None:
        output = self._micro_batches[(action.chunk, action.micro_batch)].output
        rank, chunk = self._next(action.chunk)
        self._send(output.data, rank, message_tag(FORWARD, chunk, action.micro_batch, self._count))

    def _recv_backward(self, action: Action) -> None:
        buffer = self._buffer(self.chunks[action.chunk].output_shape)
        tag = message_tag(BACKWARD, action.chunk, action.micro_batch, self._count)
        self.comm.recv(buffer, self._next(action.chunk)[0], tag=tag)
        self._state(action).grad_output = buffer

    def _send_backward(self, action: Action) -> None:
        grad = self._pop_grad_input(action.chunk, action.micro_batch)
        rank, chunk = self._previous(action.chunk)
        self._send(grad, rank, message_tag(BACKWARD, chunk, action.micro_batch, self._count))

    def _send_forward_recv_backward(self, action: Action) -> None:
        output = self._micro_batches[(action.chunk, action.micro_batch)].output
        rank, chunk = self._next(action.chunk)
        send_tag = message_tag(FORWARD, chunk, action.micro_batch, self._count)
        recv_tag = message_tag(BACKWARD, action.chunk, action.received, self._count)
        shape = self.chunks[action.chunk].output_shape
        self._state(action, action.received).grad_output = self._exchange(
            output.data, rank, send_tag, recv_tag, shape
        )

    def _send_backward_recv_forward(self, action: Action) -> None:
        grad_input = self._pop_grad_input(action.chunk, action.micro_batch)
        rank, chunk = self._previous(action.chunk)
        send_tag = message_tag(BACKWARD, chunk, action.micro_batch, self._count)
        recv_tag = message_tag(FORWARD, action.chunk, action.received, self._count)
        shape = self.chunks[action.chunk].input_shape
        self._state(action, action.received).received = self._exchange(
            grad_input, rank, send_tag, recv_tag, shape
        )

    def _exchange(self, outgoing: Any, rank: int, tag: int, recv_tag: int, shape: tuple) -> Any:
        """One Sendrecv with a neighbour: ours goes out, theirs comes back into a new buffer."""
        buffer = self._buffer(shape)
        self.comm.sendrecv(outgoing, rank, buffer, rank, tag=tag, recv_tag=recv_tag)
        return buffer

    def _pop_grad_input(self, chunk: int, micro_batch: int) -> Any:
        """The input gradient to send back; the micro-batch is then finished on this chunk (once
        its W, if split, has run)."""
        key = (chunk, micro_batch)
        state = self._micro_batches[key]
        grad, state.grad_input, state.sent_back = state.grad_input, None, True
        self._finish_if_done(key)
        return grad
