"""Loss scalers: loss * S before backward, so small float16 gradients do not flush to zero.

Gradients of at most 2^-25 round to zero in float16 (2^-25 itself is a tie, and ties go to the
even 0); those between 2^-25 and 2^-24 round up to 2^-24, the smallest subnormal; below 2^-14
they lose bits as subnormals.
Scaling the loss by S = 2^k shifts every gradient up by k binades, exactly (a power of two
only moves the exponent); the step divides by S again in float32 (precision/step.py: unscale_;
Micikevicius et al., "Mixed Precision Training", 2018).
"""

from numbers import Real
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # for annotations only: minimp.tensor imports this package
    from minimp.tensor import Tensor


@runtime_checkable
class LossScaler(Protocol):
    """What the mixed-precision step needs from a scaler (Static, Dynamic and No satisfy it)."""

    loss_scale: float  # S: the loss is multiplied by it before backward
    hit_min_scale: bool = False  # True after an update that could not back off any further
    applied: bool = False  # True when scale() was called since the last update()

    def scale(self, loss: "Tensor") -> "Tensor":
        """loss * S, the tensor to call backward() on (the loss is float32, so the product cannot
        overflow where float16 would); marks the scale as applied."""
        self.applied = True
        return loss * self.loss_scale

    def update(self, found_inf: bool) -> None:
        """Adjust S after a step; found_inf must already agree across all ranks."""

    def state_dict(self) -> dict:
        """Everything needed to continue the same trajectory after a resume."""

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict returned."""


FLOAT32_MAX = float(np.finfo(np.float32).max)
# The least scale: float32's smallest normal number, 2^-126. The step multiplies every gradient by
# 1/S in float32 (precision/step.py: unscale_), and 1/S leaves float32's range (inf) for S below
# about 2^-128: a subnormal scale such as 1e-45 turns every gradient into inf or NaN.
SMALLEST_SCALE = float(np.finfo(np.float32).smallest_normal)


def _times(scale: float, factor: float) -> float:
    """scale * factor in float32, as torch.amp.GradScaler keeps its scale in a float32 tensor
    (inf when the product leaves float32's range: the caller decides what to do then)."""
    with np.errstate(over="ignore"):
        return float(np.float32(scale) * np.float32(factor))


def _is_number(value: Any) -> bool:
    """Whether value is a real number, NumPy's included; a bool is not (True would be a scale of
    1, "2" a scale of 2: a mistake somewhere, a flag parsed as a bool, a state read as text)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _positive_float32(name: str, value: Any) -> float:
    """value as a float, or ValueError unless it is a number (NumPy's included; not a bool, not a
    string) that is positive and finite in float32 and does not round to 0 there. Any: value is
    whatever a caller or a loaded state gave (None for a missing field)."""
    if not _is_number(value):
        raise ValueError(f"{name} must be a positive finite number, got {value!r} "
                         f"(a {type(value).__name__})")
    number = float(value)
    if not (0.0 < number <= FLOAT32_MAX):  # NaN fails every comparison
        raise ValueError(f"{name} must be a positive finite float32 number, got {value!r}")
    if np.float32(number) == 0.0:  # a factor of 0 would back the scale off to 0
        raise ValueError(f"{name} {value!r} rounds to 0 in float32, the dtype a scale is kept in")
    return number


def positive_scale(name: str, value: Any) -> float:
    """value as a float, or ValueError unless it is a number (not a bool, not a string) that is a
    finite, normal float32 number: at least 2^-126 (SMALLEST_SCALE), so that 1/S is finite."""
    if _is_number(value) and 0.0 < float(value) < SMALLEST_SCALE:
        kind = "rounds to 0" if np.float32(value) == 0.0 else "is subnormal"
        raise ValueError(
            f"{name} {value!r} {kind} in float32, the dtype a scale is kept in; use at least "
            f"2**-126 = {SMALLEST_SCALE:.5g} (float32's smallest normal number), so that the "
            "step's 1/scale is finite in float32")
    return _positive_float32(name, value)


def _count(name: str, value: object, low: int | None) -> int:
    """value as an int (>= low unless low is None); bools, floats and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_kind(state: dict, kind: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"this is a {kind} loss scaler; the state is for {found!r}")


class StaticLossScaler(LossScaler):
    """One fixed scale S. A step whose gradients overflow is still skipped, but S never changes."""

    def __init__(self, scale: float):
        """scale: S, a normal float32 number (2^-126 up to float32's largest: positive_scale)."""
        self.loss_scale = positive_scale("loss scale", scale)

    def update(self, found_inf: bool) -> None:
        """A static scaler ignores overflows; the step itself is still skipped by the caller."""
        self.applied = False

    def state_dict(self) -> dict:
        return {"kind": "static", "loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "static")
        self.loss_scale = positive_scale("the state's loss_scale", state.get("loss_scale"))


class DynamicLossScaler(LossScaler):
    """A scale that halves on overflow and doubles after `growth_interval` clean steps in a row.

    With hysteresis=1 and above min_scale its trajectory is exactly torch.amp.GradScaler's:
    on inf/NaN multiply by backoff_factor and reset the clean-step count; after
    growth_interval clean steps multiply by growth_factor, unless that would leave
    float32's finite range. hysteresis=h > 1 tolerates h overflows before backing off
    (Megatron-LM's rule: the allowance refills only when the scale grows). A back-off never goes
    below min_scale: it clamps there, as DeepSpeed and Megatron-LM do (max(scale * backoff,
    min_scale)), and sets `hit_min_scale`, so the trainer can say so.

    init_scale: the first scale (default 2^16, as GradScaler's), rounded into float32, the dtype
    every scale lives in; it and min_scale must be normal float32 numbers (2^-126 up to float32's
    largest: see positive_scale). The defaults of the others: growth_factor 2, backoff_factor 0.5,
    growth_interval 2000 steps, hysteresis 1, min_scale 1.
    """

    # The configuration, by constructor argument (init_scale aside: the state's loss_scale is it).
    SETTINGS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale")

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = 1.0):
        init_scale = positive_scale("init_scale", init_scale)
        growth_factor = _positive_float32("growth_factor", growth_factor)
        backoff_factor = _positive_float32("backoff_factor", backoff_factor)
        min_scale = positive_scale("min_scale", min_scale)
        if not (growth_factor > 1.0 and backoff_factor < 1.0):
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got "
                             f"{growth_factor} and {backoff_factor}")
        if min_scale > init_scale:
            raise ValueError(f"need min_scale <= init_scale, got {min_scale} > {init_scale}")
        self.loss_scale = float(np.float32(init_scale))
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = _count("growth_interval", growth_interval, 1)
        self.hysteresis = _count("hysteresis", hysteresis, 1)
        self.min_scale = min_scale
        self.growth_tracker = 0  # clean steps since the last change (torch's _growth_tracker)
        self.hysteresis_tracker = self.hysteresis  # overflows still tolerated before a back-off
        # The flags too, not only LossScaler's defaults: load_state_dict takes a fresh scaler's
        # __dict__, and with it the flags' starting values.
        self.hit_min_scale = False
        self.applied = False  # scale() called since the last update (see mixed_precision_step)

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step; found_inf must already agree across all ranks."""
        self.hit_min_scale, self.applied = False, False
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                backed_off = _times(self.loss_scale, self.backoff_factor)
                if backed_off < self.min_scale:
                    backed_off, self.hit_min_scale = self.min_scale, True
                self.loss_scale = backed_off
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _times(self.loss_scale, self.growth_factor)
            if np.isfinite(grown):
                self.loss_scale = grown
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis

    def state_dict(self) -> dict:
        """The scale, both trackers and the whole configuration (as torch's GradScaler), so a
        default-constructed scaler that loads it continues the same trajectory."""
        return {
            "kind": "dynamic",
            "loss_scale": self.loss_scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
            **{name: getattr(self, name) for name in self.SETTINGS},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict; every field is checked first (nothing changes on an error)."""
        _check_kind(state, "dynamic")
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"dynamic loss scaler state lacks {missing}")
        settings = {name: state[name] for name in self.SETTINGS}
        loss_scale = positive_scale("the state's loss_scale", state["loss_scale"])  # named so
        checked = DynamicLossScaler(init_scale=loss_scale, **settings)
        checked.growth_tracker = _count("growth_tracker", state["growth_tracker"], 0)
        # Below 1 while overflows continue (each one backs off) until the scale grows again.
        checked.hysteresis_tracker = _count("hysteresis_tracker", state["hysteresis_tracker"], None)
        if checked.growth_tracker >= checked.growth_interval:
            raise ValueError("growth_tracker must be below growth_interval")
        if checked.hysteresis_tracker > checked.hysteresis:
            raise ValueError("hysteresis_tracker must not exceed hysteresis")
        checked.loss_scale = loss_scale  # exact, not re-rounded
        self.__dict__.update(checked.__dict__)


class NoLossScaler(LossScaler):
    """Scale 1: for float32 and bfloat16 (whose 8 exponent bits cover float32's range)."""

    loss_scale = 1.0

    def scale(self, loss: "Tensor") -> "Tensor":
        return loss

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"kind": "none", "loss_scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "none")
