"""Loss scalers: loss * S before backward, so small float16 gradients do not flush to zero.

Gradients below 2^-24 are zero in float16 (and below 2^-14 they lose bits as subnormals).
Scaling the loss by S = 2^k shifts every gradient up by k binades, exactly (a power of two
only moves the exponent); the optimizer divides by S again in float32 (Micikevicius et al.,
"Mixed Precision Training", 2018).
"""

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class LossScaler(Protocol):
    """What the mixed-precision step needs from a scaler (Static, Dynamic and No satisfy it)."""

    loss_scale: float  # S: the loss is multiplied by it before backward
    hit_min_scale: bool  # True after an update that could not back off any further

    def scale(self, loss: Any) -> Any:
        """loss * S, the tensor to call backward() on."""

    def update(self, found_inf: bool) -> None:
        """Adjust S after a step; found_inf must already agree across all ranks."""

    def state_dict(self) -> dict:
        """Everything needed to continue the same trajectory after a resume."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict returned."""


def _times(scale, factor):
    """scale * factor in float32, as torch.amp.GradScaler keeps its scale in a float32 tensor."""
    return float(np.float32(scale) * np.float32(factor))


class StaticLossScaler:
    """One fixed scale S. A step whose gradients overflow is still skipped, but S never changes."""

    def __init__(self, scale: float):
        if not np.isfinite(scale) or scale <= 0:
            raise ValueError(f"loss scale must be a positive finite number, got {scale}")
        self.loss_scale = float(scale)
        self.hit_min_scale = False

    def scale(self, loss: Any) -> Any:
        """loss * S (the loss is float32, so the product cannot overflow where float16 would)."""
        return loss * self.loss_scale

    def update(self, found_inf: bool) -> None:
        """A static scaler ignores overflows; the step itself is still skipped by the caller."""

    def state_dict(self) -> dict:
        return {"kind": "static", "loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = float(state["loss_scale"])


class DynamicLossScaler:
    """A scale that halves on overflow and doubles after `growth_interval` clean steps in a row.

    With hysteresis=1 and above min_scale its trajectory is exactly torch.amp.GradScaler's:
    on inf/NaN multiply by backoff_factor and reset the clean-step count; after
    growth_interval clean steps multiply by growth_factor, unless that would leave
    float32's finite range. hysteresis=h > 1 tolerates h overflows before backing off
    (Megatron-LM's rule: the allowance refills only when the scale grows). At min_scale it
    stops shrinking and sets `hit_min_scale`, so the trainer can say so.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
    ):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
            raise ValueError("need growth_factor > 1 and 0 < backoff_factor < 1")
        if growth_interval < 1 or hysteresis < 1 or not 0 < min_scale <= init_scale:
            raise ValueError(
                "need growth_interval >= 1, hysteresis >= 1 and 0 < min_scale <= init_scale"
            )
        self.loss_scale = float(np.float32(init_scale))
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale = min_scale
        self.growth_tracker = 0  # clean steps since the last change (torch's _growth_tracker)
        self.hysteresis_tracker = hysteresis  # overflows still tolerated before a back-off
        self.hit_min_scale = False

    def scale(self, loss: Any) -> Any:
        return loss * self.loss_scale

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step; found_inf must already agree across all ranks."""
        self.hit_min_scale = False
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                backed_off = _times(self.loss_scale, self.backoff_factor)
                if backed_off < self.min_scale:
                    backed_off, self.hit_min_scale = max(self.min_scale, self.loss_scale), True
                self.loss_scale = backed_off
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _times(self.loss_scale, self.growth_factor)
            if np.isfinite(np.float32(grown)):
                self.loss_scale = grown
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis

    def state_dict(self) -> dict:
        return {
            "kind": "dynamic",
            "loss_scale": self.loss_scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = float(state["loss_scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


class NoLossScaler:
    """Scale 1: for float32 and bfloat16 (whose 8 exponent bits cover float32's range)."""

    loss_scale = 1.0
    hit_min_scale = False

    def scale(self, loss: Any) -> Any:
        return loss

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"kind": "none", "loss_scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        pass
