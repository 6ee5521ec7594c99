"""fp8 scaling recipes and the per-tensor state they keep: which scale each quantization uses.

These are the one-scale-per-tensor members of recipes.py's interface (each says its three GEMMs
through `gemms`); the recipes with a scale per group live there.

A tensor's scale s should put its largest magnitude (its amax) near the format's maximum: too small
an s and small values underflow to zero, too large and big ones saturate. Three recipes:

  DelayedScaling        (Transformer Engine's `recipe.DelayedScaling`) s from the largest amax of
                        the last `amax_history_len` steps: s = (max / 2^margin) / amax. Known
                        before the tensor exists, so on a GPU the cast needs one pass over it. This
                        step's amax is recorded on the way and enters the next step's scale.
  Float8CurrentScaling  (TE's name) s from this tensor's own amax, s = max / amax: a pass to find
                        the amax before the cast, no state and no lag.
  NoScaling             s = 1: the plain cast, to see what scaling is for.

TE's special cases are kept: an amax that is 0, inf or NaN leaves the scale as it was (delayed) or
gives 1 (current). A scale beyond float32's range becomes float32's largest number, as in TE's
current scaling; minimp does the same for delayed scaling, where TE's kernel would store inf.

`Fp8Quantizer` is one tensor's state (the scale, the amax history, this step's amax and counts);
`Fp8Meta` holds a Linear's three: its input and weight (E4M3) and its output gradient (E5M2), TE's
HYBRID. After each optimizer step, `update_scales` agrees on the step's amaxes across the ranks that
share the tensors (the `reduce_amax` it is given) and moves every quantizer to its next scale.
"""

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from minimp.precision import fp8
from minimp.precision.casting import FLOAT32
from minimp.precision.fp8 import E4M3, E5M2, Fp8Format
from minimp.precision.recipes import LinearGemms, per_tensor_gemms

FLOAT32_MAX = np.finfo(np.float32).max


def scale_from_amax(amax: float, fp8_max: float, previous: float) -> np.float32:
    """fp8_max / amax in float32; `previous` when amax is 0, inf or NaN; float32's max when the
    quotient overflows (TE's compute_scale_from_amax)."""
    if not (np.isfinite(amax) and amax > 0):
        return np.float32(previous)
    with np.errstate(over="ignore"):
        scale = np.float32(fp8_max) / np.float32(amax)
    return scale if np.isfinite(scale) else FLOAT32_MAX


def delayed_scaling_update(amax_history: np.ndarray, amax: float, scale: float, fp8_max: float,
                           margin: int = 0) -> tuple[np.ndarray, np.float32]:
    """One step of delayed scaling: (the history with this step's amax in front and the oldest
    dropped, the next scale from the largest amax it holds). Element 0 is the newest step."""
    if np.ndim(amax_history) != 1:
        raise ValueError("delayed scaling keeps one amax per step, a 1-D history; got shape "
                         f"{np.shape(amax_history)}: pass one tensor's history at a time")
    history = np.roll(amax_history, 1)
    history[0] = amax
    scaled_max = np.float32(fp8_max) * np.float32(2.0**-margin)  # exact: a power of two
    return history, scale_from_amax(float(history.max()), float(scaled_max), scale)


@dataclass(frozen=True)
class DelayedScaling:
    """s = (fp8 max / 2^margin) / (largest amax of the last amax_history_len steps, this one
    included); Transformer Engine's default recipe (its history is 1024 steps; 16 here suits
    runs of a few hundred steps)."""

    margin: int = 0
    amax_history_len: int = 16
    name = "delayed"
    has_state = True  # the history and the scale are saved in checkpoints and agreed across ranks

    @property
    def gemms(self) -> LinearGemms:
        """One scale per tensor, from the amax history (recipes.py's interface)."""
        return per_tensor_gemms(self.name)

    def scale_for(self, stored: float, tensor_amax: float, fmt: Fp8Format) -> np.float32:
        """The scale of this quantization: the stored one (computed after the last step)."""
        return np.float32(stored)


@dataclass(frozen=True)
class Float8CurrentScaling:
    """s = fp8 max / (this tensor's own amax), computed afresh for every quantization."""

    name = "current"
    amax_history_len = 1  # the last step's amax, kept for the record only
    has_state = False

    @property
    def gemms(self) -> LinearGemms:
        """One scale per tensor, from its own amax (recipes.py's interface)."""
        return per_tensor_gemms(self.name)

    def scale_for(self, stored: float, tensor_amax: float, fmt: Fp8Format) -> np.float32:
        """From the tensor's amax; 1 for an all-zero or non-finite tensor."""
        return scale_from_amax(tensor_amax, fmt.max, 1.0)


@dataclass(frozen=True)
class NoScaling:
    """s = 1: values below half of the format's smallest subnormal become 0, and values above its
    maximum saturate."""

    name = "none"
    amax_history_len = 1
    has_state = False

    @property
    def gemms(self) -> LinearGemms:
        """One scale per tensor, 1 (recipes.py's interface)."""
        return per_tensor_gemms(self.name)

    def scale_for(self, stored: float, tensor_amax: float, fmt: Fp8Format) -> np.float32:
        """Always 1."""
        return np.float32(1.0)


RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "none": NoScaling}
Fp8Recipe = DelayedScaling | Float8CurrentScaling | NoScaling  # any one of the three


class Fp8Quantizer:
    """One tensor's fp8 scaling state (TE's quantizer): its format `fmt` (E4M3 or E5M2) and
    `recipe` (how its scale is chosen); `scale`, delayed
    scaling's scale for this step (set after the last one) or the scale of the latest quantization
    for the stateless recipes; `amax_history` (element 0 the newest step); and this step's
    statistics: `step_amax`, `underflow` (nonzero values that became 0), `saturated` (values
    beyond the format's saturation_threshold, which only the clip brought back) and
    `count` (all values)."""

    def __init__(self, fmt: Fp8Format, recipe: Fp8Recipe):
        self.fmt, self.recipe = fmt, recipe
        self.scale = np.float32(1.0)  # TE starts every scale at 1
        self.amax_history = np.zeros(recipe.amax_history_len, FLOAT32)
        self.reset_step()

    def reset_step(self) -> None:
        """Forget this step's amax and counts (update_scales calls it)."""
        self.step_amax = np.float32(0.0)  # max |x| over this step's quantizations
        self.underflow = self.saturated = self.count = 0

    def quantize(self, array: np.ndarray, record: bool = True) -> tuple[np.ndarray, np.float32]:
        """(q, 1/s): the array in fp8 with this step's scale. `record`: count the amax and the
        values lost into this step's statistics (training does; evaluation leaves them alone)."""
        delayed = self.recipe.has_state
        tensor_amax = fp8.amax(array) if record or not delayed else 0.0
        self.scale = self.recipe.scale_for(float(self.scale), tensor_amax, self.fmt)
        scaled = fp8.scale_values(array, float(self.scale))
        q = fp8.cast_saturating(scaled, self.fmt)
        if record:
            # A NaN amax is kept as inf: both leave the scale alone, and MAX reductions (MPI's
            # among them) are defined for inf but not for NaN.
            amax = np.float32(np.inf) if np.isnan(tensor_amax) else np.float32(tensor_amax)
            self.step_amax = max(self.step_amax, amax)
            threshold = self.fmt.saturation_threshold
            self.saturated += int(np.count_nonzero(np.abs(scaled) > threshold))
            self.underflow += int(np.count_nonzero(fp8.is_zero(q) & (scaled != 0)))
            self.count += scaled.size
        return q, fp8.inverse(float(self.scale))

    def end_step(self, amax: float) -> None:
        """Take the step's amax (agreed across ranks) into the history; delayed scaling computes
        the scale of the next step from it. The statistics start again."""
        if isinstance(self.recipe, DelayedScaling):  # the one recipe with state
            self.amax_history, self.scale = delayed_scaling_update(
                self.amax_history, amax, float(self.scale), self.fmt.max, self.recipe.margin)
        else:
            self.amax_history = np.roll(self.amax_history, 1)
            self.amax_history[0] = amax
        self.reset_step()

    def state_dict(self) -> dict[str, np.ndarray]:
        """{"amax_history", "scale"} as float32 arrays for delayed scaling; {} for the stateless
        recipes, whose scales come from each tensor afresh."""
        if not self.recipe.has_state:
            return {}
        return {"amax_history": self.amax_history.copy(), "scale": np.array([self.scale])}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore what state_dict returned (a resume then continues bit for bit)."""
        if not self.recipe.has_state:
            return
        history, scale = np.asarray(state["amax_history"]), np.asarray(state["scale"])
        if history.shape != self.amax_history.shape or scale.shape != (1,):
            raise ValueError(f"fp8 state: amax_history of shape {history.shape} and scale of "
                             f"shape {scale.shape}, expected {self.amax_history.shape} and (1,)")
        if not (np.isfinite(scale[0]) and scale[0] > 0):
            raise ValueError(f"fp8 state: scale {scale[0]} is not a positive finite number")
        self.amax_history = history.astype(FLOAT32)
        self.scale = np.float32(scale[0])


class Fp8Meta:
    """The fp8 state of one Linear (TE's fp8_meta): a quantizer for its input and its weight
    (E4M3, forward) and for its output gradient (E5M2, backward), all three scaled by `recipe`
    (DelayedScaling, Float8CurrentScaling or NoScaling)."""

    TENSORS = ("input", "weight", "grad_output")
    per_tensor = True  # ops.Fp8Linear multiplies, with these quantizers

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self.input = Fp8Quantizer(E4M3, recipe)
        self.weight = Fp8Quantizer(E4M3, recipe)
        self.grad_output = Fp8Quantizer(E5M2, recipe)

    def quantizers(self) -> list[tuple[str, Fp8Quantizer]]:
        """(tensor name, quantizer), in TENSORS order."""
        return [(name, getattr(self, name)) for name in self.TENSORS]

    def __repr__(self) -> str:
        return f"Fp8Meta({type(self.recipe).__name__})"


def quantizers_state_dict(quantizers: Sequence[tuple[str, Fp8Quantizer]]) -> dict[str, Any]:
    """{"<quantizer name>/<field>": array} of named quantizers (empty for stateless recipes)."""
    return {f"{name}/{field}": array for name, quantizer in quantizers
            for field, array in quantizer.state_dict().items()}


def load_quantizers_state_dict(quantizers: Sequence[tuple[str, Fp8Quantizer]],
                               state: dict[str, Any], check_only: bool = False) -> None:
    """Restore what quantizers_state_dict returned. Everything is checked before anything changes:
    KeyError naming the first array that is missing, ValueError for a wrong shape or scale.
    `check_only`: check, and change nothing."""
    checked = []
    for name, quantizer in quantizers:
        keys = {field: f"{name}/{field}" for field in quantizer.state_dict()}
        missing = [key for key in keys.values() if key not in state]
        if missing:
            raise KeyError(f"fp8 state lacks {missing[0]}")
        fields = {field: state[key] for field, key in keys.items()}
        Fp8Quantizer(quantizer.fmt, quantizer.recipe).load_state_dict(fields)  # raises if wrong
        checked.append((quantizer, fields))
    if check_only:
        return
    for quantizer, fields in checked:
        quantizer.load_state_dict(fields)


def update_scales(quantizers: Sequence[Fp8Quantizer],
                  reduce_amax: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
    """After an optimizer step: one vector of the step's amaxes, made the same on every rank
    that shares these tensors by `reduce_amax` (an elementwise MAX over those ranks; None on one
    process), then each quantizer's next scale. Stateless recipes need no agreement."""
    amaxes = np.array([q.step_amax for q in quantizers], FLOAT32)
    if reduce_amax is not None and any(q.recipe.has_state for q in quantizers):
        amaxes = np.asarray(reduce_amax(amaxes), FLOAT32)
    for quantizer, amax in zip(quantizers, amaxes):
        quantizer.end_step(float(amax))
