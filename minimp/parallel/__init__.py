"""minimp.parallel: the strategies that split training across ranks, built on minimp.distributed.

One module per strategy: the dp x pp grid (topology), data parallelism (replicas that average their
gradients), ZeRO (replicas that shard what data parallelism replicates), pipeline parallelism
(contiguous stages) and its schedules (as data). Every strategy takes its communicators as
arguments and runs on one rank, on the simulated world and under mpirun.
"""

from minimp.parallel.data_parallel import DataParallel, ReplicaMismatchError, shard
from minimp.parallel.pipeline import MicroBatch, PipelineStage
from minimp.parallel.stages import (
    PipelineError,
    cut_shapes,
    layer_groups,
    split_stages,
    stage_parameters,
)
from minimp.parallel.schedules import (
    SCHEDULES,
    Action,
    format_schedule,
    gpipe,
    one_f_one_b,
    peak_activations,
)
from minimp.parallel.topology import Topology, TopologyError
from minimp.parallel.zero import ZeroDataParallel, zero_data_parallel
from minimp.parallel.zero_layout import Piece, Unit, ZeroLayout
from minimp.parallel.zero_optimizer import ShardedOptimizer

__all__ = [
    "SCHEDULES",
    "Action",
    "DataParallel",
    "MicroBatch",
    "PipelineError",
    "Piece",
    "PipelineStage",
    "ReplicaMismatchError",
    "ShardedOptimizer",
    "Topology",
    "TopologyError",
    "Unit",
    "ZeroDataParallel",
    "ZeroLayout",
    "cut_shapes",
    "format_schedule",
    "gpipe",
    "layer_groups",
    "one_f_one_b",
    "peak_activations",
    "shard",
    "split_stages",
    "stage_parameters",
    "zero_data_parallel",
]
