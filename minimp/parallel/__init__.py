"""minimp.parallel: the strategies that split training across ranks, built on minimp.distributed.

A folder per strategy: data/ (replicas that average their gradients), zero/ (replicas that shard
what data parallelism replicates, stage by stage), tensor/ (every layer's matrices cut across
ranks, Megatron-LM's column and row split, and sequence parallelism), pipeline/ (contiguous stages,
and their schedules as data, checked and simulated without MPI); beside them the dp x tp x pp grid
(topology.py), the replicas' bit-for-bit check (replicas.py) and fp8's amax agreement between the
ranks that share tensors (amax.py). Every strategy takes its communicators as arguments and runs on
one rank, on the simulated world and under mpirun. This package's names are the strategies' API.
"""

from minimp.parallel.amax import AmaxReduction
from minimp.parallel.data.data_parallel import DataParallel, shard
from minimp.parallel.pipeline.schedules.actions import (Action, format_schedule, gpipe,
                                                       one_f_one_b, peak_activations)
from minimp.parallel.pipeline.schedules.dependencies import check_schedule
from minimp.parallel.pipeline.schedules.interleaved import interleaved
from minimp.parallel.pipeline.schedules.zero_bubble import zb_h1
from minimp.parallel.pipeline.simulator import (Costs, SimulatedStep, simulate_schedule,
                                               simulated_trace)
from minimp.parallel.pipeline.split import (PipelineError, cut_shapes, layer_groups, split_stages,
                                           stage_parameters)
from minimp.parallel.pipeline.stage import MicroBatch, PipelineStage
from minimp.parallel.replicas import ReplicaMismatchError
from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minimp.parallel.tensor.mappings import (copy_to_tensor_parallel_region,
                                             gather_from_sequence_parallel_region,
                                             reduce_from_tensor_parallel_region,
                                             reduce_scatter_to_sequence_parallel_region,
                                             scatter_to_sequence_parallel_region)
from minimp.parallel.tensor.models import (TensorParallelError, TensorParallelPlan,
                                           parallelize_module)
from minimp.parallel.topology import Topology, TopologyError
from minimp.parallel.zero.data_parallel import ZeroDataParallel, zero_data_parallel
from minimp.parallel.zero.layout import Piece, Unit, ZeroLayout
from minimp.parallel.zero.optimizer import ShardedOptimizer
from minimp.parallel.zero.stages import ZeroStage, zero_stage
