"""Mixed precision: named dtypes and casts, loss scalers, the step that ties them together, and
fp8: its two formats, its cast and its scaling recipes."""

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
from minimp.precision.fp8 import E4M3, E5M2, Fp8Format, dequantize, quantize
from minimp.precision.fp8_scaling import (
    DelayedScaling,
    Float8CurrentScaling,
    Fp8Meta,
    Fp8Quantizer,
    Fp8Recipe,
    NoScaling,
    delayed_scaling_update,
    update_scales,
)
from minimp.precision.scaler import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler
from minimp.precision.step import (
    SINGLE_PROCESS,
    GradientSync,
    MixedPrecisionOptimizer,
    SingleProcess,
    StepResult,
    all_finite,
    clip_grad_norm_,
    global_norm,
    mixed_precision_step,
    unscale_,
)
