"""The checks of --precision nvfp4: what NVFP4 is built for, one line each, before any work (and
the CPU check it shares with --precision fp8).

checks.py runs them first, then the checks NVFP4 shares with the block-scaled fp8 recipes
(checks.py's _check_fp8_groups: --tp, --cp and --experts not built, --hidden and a micro-batch's
tokens multiples of NVFP4_BLOCK); each raises ConfigError naming the flag and the fix.
"""

import os
from typing import TYPE_CHECKING

from minimp.backend import DEVICE_ENVIRONMENT_VARIABLE
from minimp.checkpoints.errors import ConfigError

if TYPE_CHECKING:  # config.py imports checks.py, which imports this module
    from minimp.train.config import TrainConfig

# --precision nvfp4 (precision/recipes.py's NVFP4, train/fp8.py's enable_nvfp4): 16 values along
# every GEMM's K share a scale, and the weight gradient's Hadamard transform mixes 16 tokens.
NVFP4_BLOCK = 16


def check_emulated_on_cpu(config: "TrainConfig") -> None:
    """--precision fp8 and nvfp4 run on the CPU: their casts work on NumPy arrays."""
    device = config.device or os.environ.get(DEVICE_ENVIRONMENT_VARIABLE, "").strip().lower()
    if device == "gpu":
        raise ConfigError(f"--precision {config.precision} is emulated on the CPU (ml_dtypes casts "
                          f"NumPy arrays); use --device cpu")


def check_nvfp4(config: "TrainConfig") -> None:
    """--precision nvfp4: the GPT on the CPU, no --fp8-recipe (NVFP4 is its own recipe), and a
    block to keep in bf16 with one to quantize."""
    if config.precision != "nvfp4":
        return
    if config.fp8_recipe is not None:
        raise ConfigError(f"--fp8-recipe {config.fp8_recipe} with --precision nvfp4: NVFP4 is its "
                          f"own recipe (E2M1 values, E4M3 scales); leave --fp8-recipe out, or use "
                          f"--precision fp8")
    check_emulated_on_cpu(config)
    if config.model != "gpt":
        raise ConfigError("--precision nvfp4 scales 16 values along K together, and the digits "
                          "MLP's 64 inputs and 10 classes do not all tile by 16: use --dataset "
                          "shakespeare (the GPT)")
    if config.layers < 2:
        raise ConfigError(f"--precision nvfp4 keeps the last block's Linears in bf16, so --layers "
                          f"{config.layers} would quantize none: use --layers 2 or more")
