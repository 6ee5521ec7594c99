"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): every block's matrices cut across ranks,
column then row, with sequence parallelism (Korthikanti et al. 2022) between them."""
