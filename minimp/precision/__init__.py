"""Mixed precision: named dtypes and casts, loss scalers, and the step that ties them together."""

from minimp.precision.casting import (
    ACCUMULATE_DTYPE,
    ACTIVATION_DTYPES,
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    MASTER_DTYPE,
    round_to,
    widen,
)
from minimp.precision.scaler import (
    DynamicLossScaler,
    LossScaler,
    NoLossScaler,
    StaticLossScaler,
)
from minimp.precision.step import (
    SINGLE_PROCESS,
    GradientSync,
    SingleProcess,
    StepResult,
    all_finite,
    clip_grad_norm_,
    global_norm,
    mixed_precision_step,
    unscale_,
)

__all__ = [
    "ACCUMULATE_DTYPE",
    "ACTIVATION_DTYPES",
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "MASTER_DTYPE",
    "SINGLE_PROCESS",
    "DynamicLossScaler",
    "GradientSync",
    "LossScaler",
    "NoLossScaler",
    "SingleProcess",
    "StaticLossScaler",
    "StepResult",
    "all_finite",
    "clip_grad_norm_",
    "global_norm",
    "mixed_precision_step",
    "round_to",
    "unscale_",
    "widen",
]
