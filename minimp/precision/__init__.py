"""Mixed precision: named dtypes and casts, loss scalers, the step that ties them together, and
fp8: its two formats, its cast and its scaling recipes."""

from minimp.precision.casting import ACCUMULATE_DTYPE, ACTIVATION_DTYPES, BFLOAT16, FLOAT16
from minimp.precision.casting import FLOAT32, MASTER_DTYPE, round_to, widen
from minimp.precision.fp8 import E4M3, E5M2, Fp8Format, dequantize, quantize
from minimp.precision.fp8_scaling import DelayedScaling, Float8CurrentScaling, Fp8Meta
from minimp.precision.fp8_scaling import Fp8Quantizer, Fp8Recipe, NoScaling
from minimp.precision.fp8_scaling import delayed_scaling_update, update_scales
from minimp.precision.scaler import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler
from minimp.precision.step import SINGLE_PROCESS, GradientSync, MixedPrecisionOptimizer
from minimp.precision.step import SingleProcess, StepResult, all_finite, clip_grad_norm_
from minimp.precision.step import global_norm, mixed_precision_step, unscale_
