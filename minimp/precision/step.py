"""THE mixed-precision step, whole in one function: every decision between backward and the update.

    accumulate (fp16 -> fp32) -> finite? -> agree across ranks -> reduce -> finite again?
      -> unscale -> clip -> update masters, round into compute copies -> scaler update

With overlap (minimp/parallel/data/overlap.py) the reduce's bytes move into backward: the step
starts by waiting for what is still in flight; the first check then looks at the reduced gradients.

A step whose gradients hold any inf or NaN (on any rank) is skipped whole: masters, optimizer state
(Adam's step count included) and the compute copies stay exactly as they were; only the loss scaler
hears about it. Other classes each do one part: the optimizer accumulates and updates (what the
step needs of it is `MixedPrecisionOptimizer`), the scaler picks the scale, a `GradientSync` (data
parallelism, pipelines) agrees and reduces across ranks.
"""

import math
import warnings
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy

from minimp.backend import Array, array_module
from minimp.precision.scaler import LossScaler


@dataclass
class StepResult:
    """What `mixed_precision_step` did. skipped: True when a non-finite gradient was found (on any
    rank) and nothing was updated; loss_scale: the scale this step's gradients were computed with;
    grad_norm: the norm of the unscaled gradients when clipping (inf if skipped), else None."""

    skipped: bool
    loss_scale: float
    grad_norm: float | None


class MixedPrecisionOptimizer(Protocol):
    """What mixed_precision_step needs of an optimizer (optim.Optimizer and ZeRO's
    ShardedOptimizer both satisfy it): float32 gradient sums the step may check, reduce, unscale
    and clip in place, then the update, then forgetting."""

    def accumulate_gradients(self) -> list[Array | None]:
        """Move the parameters' gradients into float32 sums; returns the sums (None where no
        gradient arrived), which step() then updates with as they are."""

    def step(self) -> None:
        """Update the float32 masters with the sums, and round them into the compute copies."""

    def zero_grad(self) -> None:
        """Forget the gradients: the parameters' and this step's sums."""


class GradientSync(Protocol):
    """How the ranks that share one step agree and reduce; on one process every method is a no-op.

    The order of the decisions is fixed by `mixed_precision_step`; where the bytes move is up to
    the implementation: all at once after backward (parallel.DataParallel), bucket by bucket
    during backward (DataParallel with overlap: `finalize_backward` waits for the last ones and
    `reduce` is left with nothing to do), or a reduce-scatter per layer as backward completes it
    (parallel.zero).
    """

    def finalize_backward(self) -> None:
        """Every backward of the step is done: wait for the reductions backward started (data
        parallelism with overlap); by default there are none."""
        return None

    def backward_communication_seconds(self) -> float:
        """Seconds spent communicating inside backward so far (a running total); by default 0."""
        return 0.0

    def any_rank(self, found_inf: bool) -> bool:
        """True on every rank when it is True on any rank of the job (one decision for all)."""

    def reduce(self, gradients: list[Array | None]) -> None:
        """Replace each float32 gradient, in place, by its mean over the data-parallel replicas.
        ZeRO replaces the list's contents instead: with this rank's pieces of the mean, which
        are all the rest of the step (unscale, clip, update) then touches."""

    def global_squared_norm(self, gradients: Sequence[Array | None]) -> float:
        """The squared norm of the whole model's gradient: this rank's part plus the parts of the
        ranks that hold other parameters (pipeline stages), each parameter counted once, so every
        rank clips by the same norm."""


class SingleProcess(GradientSync):
    """The GradientSync of a one-process run: nothing to agree with, nothing to reduce."""

    def any_rank(self, found_inf: bool) -> bool:
        return found_inf

    def reduce(self, gradients: list[Array | None]) -> None:
        pass

    def global_squared_norm(self, gradients: Sequence[Array | None]) -> float:
        return squared_norm(gradients)


def all_finite(arrays: Sequence[Array | None]) -> bool:
    """True when no array holds inf or NaN (checked on the float32 gradients: cheap and exact).

    One read of every element and one answer per step: each float32/float64 array's sum of
    squares (a BLAS dot product: no temporary array), added up on the arrays' device and read
    once (on a GPU, one host sync per step instead of one per gradient). A square of inf or NaN
    is inf or NaN and no sum of squares brings it back, so a finite total proves every element
    finite. A total that is not finite (a non-finite element, or finite ones whose squares
    overflow) is decided exactly, element by element.
    """
    present = [array for array in arrays if array is not None]
    if not present:
        return True
    if any(array.dtype.kind != "f" or array.dtype.itemsize < 4 for array in present):
        return _each_finite(present)  # 16-bit squares overflow at 256: no shortcut for them
    xp = array_module(*present)
    total = None
    with numpy.errstate(over="ignore"):  # an overflow only sends us to the exact check
        for array in present:
            flat = array.reshape(-1)
            square = flat @ flat
            total = square if total is None else total + square
    return bool(xp.isfinite(total)) or _each_finite(present)


def _each_finite(arrays: Sequence[Array]) -> bool:
    """all_finite, element by element: an isfinite pass over every array."""
    return all(bool(array_module(array).isfinite(array).all()) for array in arrays)


def squared_norm(arrays: Sequence[Array | None]) -> float:
    """Sum of squares over all arrays: float32 dot products per array, added in float64."""
    total = 0.0
    for array in arrays:
        if array is not None:
            flat = array.reshape(-1)
            total += float(flat @ flat)
    return total


def global_norm(arrays: Sequence[Array | None]) -> float:
    """sqrt(sum of squares) over all arrays (the L2 norm of them all as one vector)."""
    return math.sqrt(squared_norm(arrays))


def unscale_(gradients: Sequence[Array | None], loss_scale: float) -> None:
    """Divide every gradient by the loss scale, in place, in float32: values that were subnormal
    (or zero) in float16 are normal float32 numbers after the division."""
    if loss_scale != 1.0:
        _multiply_(gradients, 1.0 / loss_scale)  # 1 / S is exact: the scale is a power of two


def clip_grad_norm_(gradients: Sequence[Array | None], max_norm: float | None,
                    sync: GradientSync) -> float | None:
    """Scale the gradients so their global norm is at most max_norm
    (PyTorch's clip_grad_norm_: factor max_norm / (norm + 1e-6) when the norm is larger);
    returns the norm, or None when not clipping."""
    if max_norm is None:
        return None
    norm = math.sqrt(sync.global_squared_norm(gradients))
    if norm > max_norm:
        _multiply_(gradients, max_norm / (norm + 1e-6))
    return norm


def _multiply_(gradients: Sequence[Array | None], factor: float) -> None:
    """Every gradient times factor, in place, in float32 (unscale_'s and clip_grad_norm_'s)."""
    for grad in gradients:
        if grad is not None:
            grad *= factor


SINGLE_PROCESS = SingleProcess()


def _warn_if_scale_unused(loss_scaler: LossScaler, sync: GradientSync) -> None:
    """The classic slip: backward on the loss instead of scaler.scale(loss); the step would then
    divide unscaled gradients by S. Only checked on one process: a pipeline's first stages never
    see the loss, yet their gradients carry the scale."""
    if sync is SINGLE_PROCESS and loss_scaler.loss_scale != 1.0 and not loss_scaler.applied:
        warnings.warn(
            "mixed_precision_step: the loss scaler's scale was not applied since its last update; "
            "call scaler.scale(loss).backward(), not loss.backward()", stacklevel=3)


def mixed_precision_step(optimizer: MixedPrecisionOptimizer, loss_scaler: LossScaler,
                         max_grad_norm: float | None = None,
                         sync: GradientSync = SINGLE_PROCESS) -> StepResult:
    """Finish a step whose (scaled) backward passes are done; returns a StepResult."""
    _warn_if_scale_unused(loss_scaler, sync)
    sync.finalize_backward()  # overlap: the float32 gradients are then the reduced mean already
    gradients = optimizer.accumulate_gradients()  # 16-bit .grad -> float32 sums
    # Without overlap nobody sends inf; with it the reduced mean is checked, and it is
    # non-finite wherever any replica's gradient was: the same decision. All skip together.
    found_inf = sync.any_rank(not all_finite(gradients))
    # One process: the reduce changes nothing, so a second check would only repeat the first.
    if not found_inf and not isinstance(sync, SingleProcess):
        sync.reduce(gradients)  # average over the replicas
        # A float16 wire can overflow in the sum, and a pipeline's other stages must hear of it.
        found_inf = sync.any_rank(not all_finite(gradients))
    loss_scale = loss_scaler.loss_scale  # the scale these gradients carry (update may change it)
    if found_inf:
        optimizer.zero_grad()
        loss_scaler.update(found_inf=True)
        return StepResult(skipped=True, loss_scale=loss_scale, grad_norm=math.inf)
    unscale_(gradients, loss_scale)
    norm = clip_grad_norm_(gradients, max_grad_norm, sync)
    optimizer.step()  # update the float32 masters, round them into the compute copies
    optimizer.zero_grad()
    loss_scaler.update(found_inf=False)
    return StepResult(skipped=False, loss_scale=loss_scale, grad_norm=norm)
