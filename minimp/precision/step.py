"""One mixed-precision optimizer step: fp16 grads -> fp32 -> finite check -> unscale -> clip ->
update.

A step whose gradients hold any inf or NaN is skipped whole: masters, optimizer state (Adam's step
count included) and the compute copies stay exactly as they were; only the loss scaler hears about
it.
"""

from dataclasses import dataclass

from minimp.backend import array_module


@dataclass
class StepResult:
    skipped: bool  # True when a non-finite gradient was found (on any rank) and nothing was updated
    loss_scale: float  # the scale this step's gradients were computed with
    grad_norm: (
        float  # L2 norm of the unscaled gradients when clipping (inf when skipped), else None
    )


def all_finite(arrays):
    """True when no array holds inf or NaN (checked on the float32 gradients: cheap and exact)."""
    for array in arrays:
        if array is not None and not bool(array_module(array).isfinite(array).all()):
            return False
    return True


def global_norm(arrays):
    """sqrt(sum of squares) over all arrays, accumulated in float32 per array and float64 across."""
    total = 0.0
    for array in arrays:
        if array is not None:
            flat = array.reshape(-1)
            total += float(flat @ flat)
    return total**0.5


def mixed_precision_step(
    optimizer, loss_scaler, max_grad_norm=None, reduce_gradients=None, reduce_found_inf=None
):
    """Finish a step whose (scaled) backward passes are done; returns a StepResult.

    reduce_found_inf(bool) -> bool and reduce_gradients(list of float32 arrays) are the hooks data
    and pipeline parallelism use: first every rank learns whether any rank overflowed (then all
    skip, and no gradient is sent), else the gradients are averaged across replicas.
    """
    optimizer.accumulate_gradients()
    gradients = optimizer.master_gradients
    found_inf = not all_finite(gradients)
    if reduce_found_inf is not None:
        found_inf = bool(reduce_found_inf(found_inf))
    if not found_inf and reduce_gradients is not None:
        reduce_gradients(gradients)
        # A float16 wire can overflow in the sum. The reduced gradients are bit-identical on every
        # rank, so this second check is the same decision everywhere without another message.
        found_inf = not all_finite(gradients)
    loss_scale = loss_scaler.loss_scale
    if found_inf:
        optimizer.zero_grad()
        loss_scaler.update(True)
        return StepResult(skipped=True, loss_scale=loss_scale, grad_norm=float("inf"))
    inverse_scale = 1.0 / loss_scale
    for grad in gradients:
        if grad is not None and inverse_scale != 1.0:
            grad *= inverse_scale  # float32: values that were subnormal in fp16 are normal here
    norm = None
    if max_grad_norm is not None:
        norm = global_norm(gradients)
        if norm > max_grad_norm:
            for grad in gradients:
                if grad is not None:
                    grad *= max_grad_norm / (norm + 1e-6)
    optimizer.step()
    optimizer.zero_grad()
    loss_scaler.update(False)
    return StepResult(skipped=False, loss_scale=loss_scale, grad_norm=norm)
