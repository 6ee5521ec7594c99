"""minimp.parallel: the strategies that split training across ranks, built on minimp.distributed.

One module per strategy: the dp x pp grid (topology), data parallelism (replicas that average their
gradients), ZeRO (replicas that shard what data parallelism replicates), pipeline parallelism
(contiguous stages) and its schedules (as data, checked and simulated without MPI), and fp8's amax
agreement between the ranks that share tensors. Every strategy takes its communicators as arguments
and runs on one rank, on the simulated world and under mpirun.
"""

from minimp.parallel.amax import AmaxReduction
from minimp.parallel.data_parallel import DataParallel, ReplicaMismatchError, shard
from minimp.parallel.dependencies import check_schedule
from minimp.parallel.interleaved import interleaved
from minimp.parallel.pipeline import MicroBatch, PipelineStage
from minimp.parallel.schedules import (
    SCHEDULES,
    Action,
    format_schedule,
    gpipe,
    one_f_one_b,
    peak_activations,
)
from minimp.parallel.simulator import Costs, SimulatedStep, simulate_schedule, simulated_trace
from minimp.parallel.stages import (
    PipelineError,
    cut_shapes,
    layer_groups,
    split_stages,
    stage_parameters,
)
from minimp.parallel.topology import Topology, TopologyError
from minimp.parallel.zero import ZeroDataParallel, zero_data_parallel
from minimp.parallel.zero_bubble import zb_h1
from minimp.parallel.zero_layout import Piece, Unit, ZeroLayout
from minimp.parallel.zero_optimizer import ShardedOptimizer

__all__ = [
    "SCHEDULES",
    "Action",
    "AmaxReduction",
    "Costs",
    "DataParallel",
    "MicroBatch",
    "PipelineError",
    "PipelineStage",
    "Piece",
    "ReplicaMismatchError",
    "ShardedOptimizer",
    "SimulatedStep",
    "Topology",
    "TopologyError",
    "Unit",
    "ZeroDataParallel",
    "ZeroLayout",
    "check_schedule",
    "cut_shapes",
    "format_schedule",
    "gpipe",
    "interleaved",
    "layer_groups",
    "one_f_one_b",
    "peak_activations",
    "shard",
    "simulate_schedule",
    "simulated_trace",
    "split_stages",
    "stage_parameters",
    "zb_h1",
    "zero_data_parallel",
]
