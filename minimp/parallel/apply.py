"""`parallelize` and `replicate`: the one place the strategies are applied to a model, in order.

Every rank builds the whole float32 model from the seed (so every layout starts from the
one-process weights) and hands it here with its place in the grid (topology.py). What comes back
is this rank's share of the run, built in the order picotron's train.py and torchtitan's
parallelize.py apply theirs:

  1. tensor     a copy of the model whose blocks' Linears are cut over the tp group (tensor/)
     context    with --cp, a copy of the GPT's modules (with --tp, of the cut copy's) sharing its
                weights that runs this rank's shard of the sequence, its attention around the cp
                group's ring or through Ulysses' all-to-alls on the heads it holds (context/)
     expert     with --ep, a copy of the modules sharing the weights whose mixtures send their
                tokens' rows to the ep group's ranks holding their experts (expert/); this rank
                trains E/ep experts of each mixture, and the others' weights are freed
  2. pipeline   this rank's layers: pp x virtual_stages chunks of about equal parameter count,
                chunk r, r + pp, ... on pipeline rank r (pipeline/split.py), and the copy of the
                tied embedding the last stage reads
     (then the caller's `build_optimizer` makes the float32 masters of those parameters, and its
     `prepare` casts the models to the compute dtype and gives their Linears fp8 state, the
     whole model's and, with --tp or --cp, the trained copy's own Linears: masters
     must come from the float32 weights, never from their 16-bit rounding)
  3. recompute  the runner of the chunks reruns each block's forward in its backward
  4. data/zero  the stage's replicas start from replica 0's masters and share one GradientSync:
                DataParallel, or ZeRO's, which shards the optimizer (stage 3: the parameters);
                with --ep its expert parameters reduce (and ZeRO shards them) over their own
                group (expert/grads.py, zero/data_parallel.py);
                with --cp the context shards of a replica are in that group too (each saw other
                tokens of the same samples: context/models.py derives the average)

Steps 1-3 are `parallelize`, step 4 is `replicate` (PyTorch's name for its composable data
parallelism). The first sends no message, the second is a collective: between them the trainer
loads a checkpoint into the new optimizer, and every rank learns whether any rank failed so far,
so a bad --resume stops the whole job at once instead of leaving ranks waiting in a collective.
"""

import copy
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from minimp import nn
from minimp.backend import Array
from minimp.distributed.protocol import Communicator
from minimp.models.gpt import GPT
from minimp.optim import Optimizer
from minimp.parallel.context.layout import ContextLayout
from minimp.parallel.context.models import parallelize_context
from minimp.models.moe import MoE
from minimp.parallel.data.data_parallel import DataParallel, broadcast_masters
from minimp.parallel.expert import ExpertGradients, ExpertParallelDispatch, expert_index
from minimp.parallel.expert import local_experts
from minimp.parallel.pipeline.schedules import CHOICES as SCHEDULES
from minimp.parallel.pipeline.split import StageChunk, cut_shapes, run_layers, split_counts
from minimp.parallel.pipeline.split import stage_parameters
from minimp.parallel.pipeline.stage import PipelineStage
from minimp.parallel.pipeline.tied import TiedGradients, tied_group, tied_indices
from minimp.parallel.tensor.checkpoint import shard_selector
from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.parallel.tensor.models import TensorParallelPlan, paired_counts, parallelize_module
from minimp.parallel.topology import Topology
from minimp.parallel.zero.data_parallel import ZeroDataParallel, zero_data_parallel
from minimp.parallel.zero.stage3 import free
from minimp.parallel.zero.stages import zero_stage
from minimp.precision.wire import grad_wire, wire_of
from minimp.tensor import Tensor

Named = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class Parallelism:
    """The strategies' settings, each the train command's flag of the same name (the grid's sizes
    come with the Topology)."""

    schedule: str = "1f1b"  # the pipeline schedule's name (pipeline/schedules/)
    virtual_stages: int = 1  # chunks per pipeline rank (interleaved)
    micro_batches: int = 1
    sequence_parallel: bool = False
    recompute: bool = False
    zero: int = 0  # ZeRO's stage (zero/stages.py); 0: data parallelism
    overlap: bool = True  # gradients move during backward, bucket by bucket or unit by unit
    bucket_mb: float = 25.0  # data parallelism's buckets
    grad_comm_dtype: str = "fp32"  # the gradients' dtype on the wire: fp32, fp16, bf16 or fp8
    param_gather_dtype: str = "compute"  # ZeRO-3's all-gathers: the compute dtype, or fp8
    grad_average: str = "before"  # divide by the replicas before or after the sum
    cp_layout: str = "zigzag"  # context parallelism's shards (context/layout.py)
    cp_mode: str = "ring"  # context parallelism's attention (context/models.py)


class Task(Protocol):
    """What the strategies need of what a run trains on (minimp/train/tasks.py)."""

    def loss(self, logits: Tensor, targets: Array) -> Tensor:
        """The scalar loss the last stage computes."""

    def is_block(self, layers: list[nn.Module]) -> bool:
        """Whether a group of layers is a block, the unit --recompute reruns."""


@dataclass
class Parallelized:
    """This rank's share of a run: the whole model (rank 0 evaluates it) and the one it trains
    (with --tp a copy, cut), the names and the optimizer of the parameters it trains, the runner
    of its chunks and their layer ranges, the names of the parameters it shares with another
    stage; with --tp what was cut, the step's part of it, and the cut of each checkpoint array
    this rank holds."""

    model: nn.Sequential
    trained: nn.Sequential
    names: list[str]
    optimizer: Optimizer
    runner: PipelineStage
    ranges: list[tuple[int, int]]
    tied_names: list[str]
    plan: TensorParallelPlan | None = None
    tensor_parallel: TensorParallelGradients | None = None
    select: Callable[[str, np.ndarray], np.ndarray] | None = None
    context: ContextLayout | None = None  # with --cp: which positions each context rank holds
    dispatch: ExpertParallelDispatch | None = None  # with --ep: the mixtures' all-to-alls


def parallelize(model: nn.Sequential, grid: Topology, parallelism: Parallelism, task: Task, *,
                sample_input: Array, dtype: np.dtype, build_optimizer: Callable[[Named], Optimizer],
                prepare: Callable[[nn.Sequential], None]) -> Parallelized:
    """Steps 1-3 (the module's docstring) on a whole float32 model, on this rank alone.
    sample_input: one micro-batch of inputs (the shapes of its activations size the pipeline's
    messages); dtype: the compute dtype `prepare` casts to."""
    trained, plan = _tensor_parallel(model, grid, parallelism)
    trained, context = _context_parallel(trained, grid, parallelism)
    trained, dispatch = _expert_parallel(trained, grid)
    ranges = _pipeline_ranges(trained, grid, parallelism, paired=plan is not None)
    tied = _tied_parameters(trained, grid)
    named = [pair for bounds in ranges for pair in stage_parameters(trained, bounds)]
    if dispatch is not None:  # this rank's experts only
        experts = len(next(m for m in trained.modules() if isinstance(m, MoE)).experts)
        mine = local_experts(experts, grid.ep, grid.ep_rank)
        named = [(name, p) for name, p in named if expert_index(name) in (None, *mine)]
    named += [(name, p) for name, p in tied if name not in dict(named)]
    optimizer = build_optimizer(named)
    prepare(model)
    if trained is not model:  # with --tp, --cp or --ep the trained copy has its own modules
        prepare(trained)
    runner = _pipeline_runner(model, trained, ranges, grid, parallelism, task, dtype, sample_input)
    # The other stages' layers are rank 0's to evaluate with, and only after it has gathered
    # their masters (train/saving.py): no rank keeps their compute copies meanwhile.
    kept = {id(parameter) for _, parameter in named}
    for parameter in [*model.parameters(), *(trained.parameters() if plan else [])]:
        if id(parameter) not in kept:
            free(parameter)
    names, tied_names = [name for name, _ in named], [name for name, _ in tied]
    share = Parallelized(model, trained, names, optimizer, runner, ranges, tied_names, plan,
                         context=context, dispatch=dispatch)
    if plan is not None:
        share.tensor_parallel = TensorParallelGradients.for_names(grid.tp_group, names, plan)
        share.select = shard_selector(plan.partitions, grid.tp_rank, grid.tp)
    return share


def _tensor_parallel(model: nn.Sequential, grid: Topology,
                     parallelism: Parallelism) -> tuple[nn.Sequential, TensorParallelPlan | None]:
    """1. With --tp, a copy of the model with its Linears cut (`model` stays whole)."""
    if grid.tp == 1:
        return model, None
    trained = copy.deepcopy(model)
    return trained, parallelize_module(trained, grid.tp_group, parallelism.sequence_parallel)


def _context_parallel(model: nn.Sequential, grid: Topology, parallelism: Parallelism
                      ) -> tuple[nn.Sequential, ContextLayout | None]:
    """1b. With --cp, a copy of the GPT's modules sharing its Parameters, running this rank's
    positions (context/models.py), and the layout naming them; else the model as it is."""
    if grid.cp == 1:
        return model, None
    if not isinstance(model, GPT):
        raise ValueError("context parallelism splits a sequence: it needs the GPT")
    layout = ContextLayout(grid.cp, parallelism.cp_layout)
    return parallelize_context(model, grid.cp_group, layout, parallelism.cp_mode), layout


def _expert_parallel(model: nn.Sequential, grid: Topology
                     ) -> tuple[nn.Sequential, ExpertParallelDispatch | None]:
    """1c. With --ep, a copy of the modules sharing the model's Parameters whose mixtures run
    their experts through the ep group's all-to-alls (`model` keeps running them locally: rank 0
    evaluates it alone); else the model as it is."""
    if grid.ep_group is None:
        return model, None
    trained = copy.deepcopy(model, {id(p): p for p in model.parameters()})
    dispatch = ExpertParallelDispatch(grid.ep_group)
    for module in trained.modules():
        if isinstance(module, MoE):
            module.dispatch = dispatch
    return trained, dispatch


def _pipeline_ranges(model: nn.Sequential, grid: Topology, parallelism: Parallelism,
                     paired: bool) -> list[tuple[int, int]]:
    """2. This rank's layers, a range per chunk: the model cut into pp x virtual_stages chunks,
    of which this stage holds chunks stage, stage + pp, ... (with --tp, an MLP's column -> row
    pairs are never cut apart)."""
    counts = [sum(p.size for p in layer.parameters()) for layer in model.layers]
    if paired and not isinstance(model, GPT):
        counts = paired_counts(counts)
    return split_counts(counts, grid.pp * parallelism.virtual_stages)[grid.stage :: grid.pp]


def _tied_parameters(model: nn.Module, grid: Topology) -> Named:
    """The parameters the first and the last stage both hold (the GPT's head reads the token
    embedding's weight), when they are different stages; else none."""
    tied: Named = getattr(model, "tied_parameters", lambda: [])()
    return tied if grid.pp > 1 and grid.stage in (0, grid.pp - 1) else []


def _tied_gradients(model: nn.Module, names: list[str], tied_names: list[str],
                    grid: Topology) -> TiedGradients | None:
    """The copies of parameters this stage shares with another (every stage of a model with tied
    parameters calls this: the group is split from the pipeline's); None where there are none."""
    if grid.pp == 1 or not hasattr(model, "tied_parameters"):
        return None
    group = tied_group(grid.pp_group, grid.stage, grid.pp)
    if group is None:
        return None
    return TiedGradients(group, tied_indices(names, tied_names), counts_in_norm=grid.is_first_stage)


def _pipeline_runner(model: nn.Sequential, trained: nn.Sequential, ranges: list[tuple[int, int]],
                     grid: Topology, parallelism: Parallelism, task: Task, dtype: np.dtype,
                     sample_input: Array) -> PipelineStage:
    """3. The runner of this rank's chunks, knowing the activation shapes at every cut (one
    forward of the whole model) and running each block recomputed with --recompute."""
    model.eval()  # the shapes need one forward, and dropout then needs no random state
    shapes = cut_shapes(model.layers, sample_input)
    model.train()
    if parallelism.sequence_parallel:  # between the embeddings and the head: 1/tp of positions
        shapes = [(shape[0], shape[1] // grid.tp, *shape[2:]) if 0 < index < len(model) else shape
                  for index, shape in enumerate(shapes)]
    if grid.cp > 1:  # a context shard holds 1/cp of the positions everywhere, ids to logits
        shapes = [(shape[0], shape[1] // grid.cp, *shape[2:]) for shape in shapes]
    chunks = [StageChunk(trained.layers[a:b], shapes[a], shapes[b]) for a, b in ranges]

    def run_group(layers: list[nn.Module], x: Tensor) -> Tensor:
        if parallelism.recompute and task.is_block(layers):
            return nn.recompute(layers, x)
        return run_layers(layers, x)

    return PipelineStage(
        chunks[0].layers, grid, input_shape=chunks[0].input_shape,
        output_shape=chunks[0].output_shape, dtype=dtype, loss_fn=task.loss, run_group=run_group,
        more_chunks=chunks[1:], buffered_sends=SCHEDULES[parallelism.schedule].buffered_sends)


def replicate(share: Parallelized, grid: Topology, parallelism: Parallelism,
              decision_comm: Communicator) -> DataParallel | ZeroDataParallel:
    """Step 4, a collective of the job: the GradientSync of this stage's replicas, every replica
    starting from replica 0's masters: DataParallel, or ZeRO's, which shards the stage's
    optimizer (its `.optimizer` is the one to step from now on) and, in stage 3, gathers the
    parameters around the runner's groups of layers. With --tp both also sum the partial
    gradients and count the whole parameters once (tensor/grads.py). With --cp the group is the
    replicas' context shards too (dp_cp_group). decision_comm: every rank that shares the step's
    skip decision (the job)."""
    tied = _tied_gradients(share.trained, share.names, share.tied_names, grid)
    optimizer, runner = share.optimizer, share.runner
    options: dict[str, Any] = dict(
        comm_dtype=grad_wire(parallelism.grad_comm_dtype),
        average=parallelism.grad_average, decision_comm=decision_comm, tied=tied,
        tensor_parallel=share.tensor_parallel, overlap=parallelism.overlap,
        micro_batches=parallelism.micro_batches)
    stage = zero_stage(parallelism.zero)
    indices = frozenset(i for i, name in enumerate(share.names) if expert_index(name) is not None)
    if not stage.shards_optimizer_state:
        experts = None
        if grid.ep_group is not None and grid.expert_dp_group is not None:  # --ep: apart
            experts = ExpertGradients(grid.expert_dp_group, grid.ep_group, indices)
        sync = DataParallel(
            grid.dp_cp_group, optimizer, bucket_mb=parallelism.bucket_mb,
            stages_comm=grid.mp_group,  # the stages and the tensor-parallel shards
            experts=experts, **options)
        sync.broadcast_parameters()
        return sync
    # Each kind of parameter over its own group (with --ep the experts over the replicas holding
    # the same ones), both from their group's rank 0, as DataParallel.broadcast_parameters.
    expert_comm = grid.expert_dp_group or grid.dp_cp_group
    dense = [index for index in range(len(optimizer.params)) if index not in indices]
    broadcast_masters(grid.dp_cp_group, optimizer, 0, dense)
    broadcast_masters(expert_comm, optimizer, 0, sorted(indices))
    gather = parallelism.param_gather_dtype
    zero = zero_data_parallel(stage, optimizer, runner.layers, grid.dp_cp_group, experts=indices,
                              expert_comm=expert_comm,
                              gather_wire=wire_of(gather) if gather != "compute" else None,
                              **options)
    plain = runner.run_group
    runner.run_group = lambda layers, x: zero.run_group(layers, x, plain)
    return zero
