"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): every block's matrices cut across ranks,
column then row, with sequence parallelism (Korthikanti et al. 2022) between them."""

from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minimp.parallel.tensor.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from minimp.parallel.tensor.models import TensorParallelError, TensorParallelPlan, parallelize
