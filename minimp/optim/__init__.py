"""minimp.optim: optimizers that update float32 master weights, and learning-rate schedules."""

from minimp.optim.optimizer import SGD, Adam, AdamW, Optimizer
