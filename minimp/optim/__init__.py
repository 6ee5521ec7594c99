"""minimp.optim: optimizers that update float32 master weights, each with its update rule written
once as a function of arrays (`sgd`, `adam`), and learning-rate schedules."""

from minimp.optim.optimizer import SGD, Adam, AdamW, Optimizer, adam, sgd
