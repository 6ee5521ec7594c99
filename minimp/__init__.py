"""minimp: a small teaching autograd engine with mixed precision, data and pipeline parallelism."""

from minimp import functional, nn, optim
from minimp.precision import DynamicLossScaler, NoLossScaler, StaticLossScaler, StepResult
from minimp.precision import mixed_precision_step
from minimp.tensor import Tensor, no_grad

__version__ = "0.1.0"
