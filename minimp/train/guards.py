"""What watches a run from outside the step: the faults and overflows a user injects to see what
failure looks like, and the divergence checks that stop a run that cannot learn."""

import math
import os
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from minimp import backend
from minimp.checkpoints.errors import AgreedError, DivergenceError
from minimp.nn import Parameter
from minimp.train.config import TrainConfig


class Guards:
    """Injections (--inject-overflow, --inject-fault) and divergence checks of one rank's run."""

    def __init__(self, config: TrainConfig, rank: int, start_step: int, world_size: int):
        self.config, self.rank = config, rank
        self.overflow_at = config.injection("inject_overflow", world_size, after=start_step)
        self.fault_at = config.injection("inject_fault", world_size, after=start_step)
        self.consecutive_skips = 0

    @contextmanager
    def overflow_injected(self, step: int, parameter: Parameter) -> Iterator[None]:
        """--inject-overflow: on that step and rank, inside this block, a gradient hook turns the
        parameter's gradient into inf, as if backward had overflowed."""
        if self.overflow_at != (step, self.rank):
            yield
            return
        xp = backend.array_module(parameter.data)
        handle = parameter.register_hook(lambda grad: xp.full_like(grad, np.inf))
        try:
            yield
        finally:
            handle.remove()

    def inject_fault(self, step: int) -> None:
        if self.fault_at == (step, self.rank):
            message = f"injected fault at step {step} on rank {self.rank} (--inject-fault)"
            raise RuntimeError(message)

    def stop_if_diverging(self, step: int, loss: float, skipped: bool, loss_scale: float) -> None:
        """Stop a run that cannot learn: a non-finite loss on a step that was taken, or
        --max-consecutive-skips skipped steps in a row. Every rank sees the same loss and the
        same skip decisions, so all stop here together (one of them says why)."""
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        limit, message = self.config.max_consecutive_skips, None
        if not skipped and not math.isfinite(loss):
            message = (f"step {step}: the loss is {loss} although the gradients were finite; the "
                       "model diverged (lower --lr, clip with --max-grad-norm) or the data holds "
                       "non-finite values")
        elif limit and self.consecutive_skips >= limit:
            message = (f"the last {limit} steps (to step {step}) were all skipped: their gradients "
                       f"overflowed every time, the loss scale is now {loss_scale:g}. Likely "
                       "causes: a learning rate too high (--lr), a static --loss-scale that always "
                       "overflows, or non-finite data; use --max-consecutive-skips 0 to go on")
        if message is not None:
            raise AgreedError(DivergenceError(message), speaker=self.rank == 0, exit_code=1)

    def stop_if_nothing_to_keep(self, records: list[dict]) -> None:
        """At the end, before anything is saved: a run whose last loss is not finite, or whose every
        step was skipped, ends with exit 1 and saves nothing (its weights cannot compute the loss,
        or they learned nothing): a checkpoint already at --save is left as it was. Every rank
        sees the same losses and skip decisions, so all stop here together."""
        if not records:
            return
        step, loss = records[-1]["step"], records[-1]["loss"]
        message = None
        if not math.isfinite(loss):
            message = (f"the run ended at step {step} with loss {loss}: its weights cannot compute "
                       "the loss (they grew too large, or the data holds non-finite values; lower "
                       "--lr, clip with --max-grad-norm)")
        elif all(record["skipped"] for record in records):
            message = (f"every step of this run ({len(records)}) was skipped: its gradients were "
                       "never finite, so nothing was learned (a --loss-scale too large for fp16, "
                       "a --lr too high, or non-finite data)")
        if message is not None:
            raise AgreedError(DivergenceError(message + self._kept()), speaker=self.rank == 0,
                              exit_code=1)

    def _kept(self) -> str:
        """What becomes of --save when a run stops without saving."""
        if not self.config.save:
            return ""
        if os.path.exists(self.config.save):
            return f"; not saved, {self.config.save} keeps what it held"
        return "; not saved"

    def check_weights(self, step: int, masters: list) -> None:
        """Raise DivergenceError if this rank's float32 masters hold inf or NaN: every later step
        would compute NaN, and no save may keep them (run after a non-finite loss, which is when
        they can be; every rank checks its own and agree_on_error shares the verdict)."""
        if any(m is not None and not bool(backend.array_module(m).isfinite(m).all())
               for m in masters):
            raise DivergenceError(
                f"step {step}: the float32 master weights hold inf or NaN: the model diverged "
                f"(lower --lr, clip with --max-grad-norm){self._kept()}")

