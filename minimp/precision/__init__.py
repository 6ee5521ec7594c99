"""Mixed precision: named dtypes and casts, loss scalers, and the optimizer step that ties them
together."""

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
from minimp.precision.scaler import DynamicLossScaler, NoLossScaler, StaticLossScaler
from minimp.precision.step import StepResult, all_finite, global_norm, mixed_precision_step

__all__ = [
    "ACCUMULATE_DTYPE",
    "ACTIVATION_DTYPES",
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "MASTER_DTYPE",
    "DynamicLossScaler",
    "NoLossScaler",
    "StaticLossScaler",
    "StepResult",
    "all_finite",
    "global_norm",
    "mixed_precision_step",
    "round_to",
    "widen",
]
