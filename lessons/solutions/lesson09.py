"""Reference solutions to lesson 9's exercises (myths). Try them yourself first."""


def zero_bytes_per_parameter(stage, p):
    """Mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter (Rajbhandari et al. 2020):
    ZeRO-1 shards the 12 bytes of optimizer state, ZeRO-2 also the 2 of gradient, ZeRO-3 (and
    FSDP) also the 2 of weight, each over the p data-parallel ranks."""
    weights, gradients, optimizer_state = 2.0, 2.0, 12.0
    if stage >= 1:
        optimizer_state /= p
    if stage >= 2:
        gradients /= p
    if stage >= 3:
        weights /= p
    return weights + gradients + optimizer_state


def dp_bytes_sent(parameters, p, itemsize):
    """The ring all-reduce of every gradient: 2(p - 1) chunks of 1/p of it."""
    return 2 * (p - 1) / p * parameters * itemsize


def pp_bytes_sent(stage, stages, batch, width, itemsize):
    """Activations forward (all but the last stage), their gradients back (all but the first):
    the whole batch crosses each cut once each way, whatever the number of micro-batches."""
    directions = (stage < stages - 1) + (stage > 0)
    return directions * batch * width * itemsize
