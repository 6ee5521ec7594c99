"""Pipeline parallelism: the model cut into contiguous stages, a runner that executes a schedule's
actions on one stage, the schedules as data, and a simulator that plays them without MPI."""

from minimp.parallel.pipeline.split import (
    PipelineError,
    cut_shapes,
    layer_groups,
    split_stages,
    stage_parameters,
)
from minimp.parallel.pipeline.stage import MicroBatch, PipelineStage
