"""minimp.parallel: the strategies that split training across ranks, built on minimp.distributed.

One module per strategy: the dp x pp grid (topology), data parallelism (replicas that average their
gradients), pipeline parallelism (contiguous stages) and its schedules (as data), and fp8's amax
agreement between the ranks that share tensors. Every strategy takes its communicators as arguments
and runs on one rank, on the simulated world and under mpirun.
"""

from minimp.parallel.amax import AmaxReduction
from minimp.parallel.data_parallel import DataParallel, ReplicaMismatchError, shard
from minimp.parallel.pipeline import (
    MicroBatch,
    PipelineError,
    PipelineStage,
    cut_shapes,
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

__all__ = [
    "SCHEDULES",
    "Action",
    "AmaxReduction",
    "DataParallel",
    "MicroBatch",
    "PipelineError",
    "PipelineStage",
    "ReplicaMismatchError",
    "Topology",
    "TopologyError",
    "cut_shapes",
    "format_schedule",
    "gpipe",
    "one_f_one_b",
    "peak_activations",
    "shard",
    "split_stages",
    "stage_parameters",
]
