"""Every layout the cluster allows, the ones that fit, ranked by predicted step time.

A layout is feasible when (checked in this order, each rejected layout counted against the first
rule it breaks, so that "nothing fits" can name the rule that failed most):

  tp divides the heads          each rank computes whole heads (Shoeybi et al. 2019, section 3)
  tp divides the GPUs per node  tensor-parallel all-reduces stay on the intra-node network
  pp divides the layers         every stage holds l/P blocks
  dp x b divides the batch      each replica runs M = B / (dp b) whole micro-batches of b rows
  memory fits                   plan/memory.py's peak <= the device's memory

with dp x tp x pp = GPUs. ZeRO stages above 0 are listed only when dp > 1 (with one replica they
shard nothing), sequence parallelism only when tp > 1. Ranked by predicted step time, then by
memory (sequence parallelism costs the same time as tensor parallelism alone in this model and
less memory), then by fewer tensor- and pipeline-parallel ranks and lower ZeRO stages.
"""

from collections import Counter
from dataclasses import dataclass, field, replace

from minimp.plan.inputs import Cluster, Job, Layout, ModelShape, PlanError, divisors
from minimp.plan.memory import Memory, memory_per_device
from minimp.plan.steptime import StepTime, step_flops, step_time

RULES = {
    "heads": "tp must divide the heads",
    "node": "tp must divide the GPUs per node",
    "layers": "pp must divide the layers",
    "batch": "dp x micro-batch size must divide the global batch",
    "memory": "the memory per GPU"}


@dataclass
class Choices:
    """Which ZeRO stages, recomputation and sequence-parallel settings to consider."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[bool, ...] = (False, True)
    sequence_parallel: tuple[bool, ...] = (False, True)


@dataclass
class Plan:
    """One feasible layout with its predicted memory per device and step time."""

    layout: Layout
    memory: Memory
    time: StepTime
    model_flops: float = 0.0  # a step's FLOPs without recomputation (what the model needs)

    def tflops_per_device(self, devices: int) -> float:
        """Model FLOP/s per device in 10^12: the step's FLOPs / (step time x devices)."""
        return self.model_flops / (self.time.total * devices) / 1e12

    def as_dict(self, devices: int) -> dict:
        """Everything the table shows and the parts behind it, for --json."""
        return {**vars(self.layout), "memory_bytes": self.memory.total,
                "memory_by_kind": self.memory.by_kind, "memory_stage": self.memory.stage,
                "step_seconds": self.time.total, "seconds_by_part": vars(self.time),
                "model_tflops_per_device": self.tflops_per_device(devices)}


@dataclass
class Search:
    """What a search found: the feasible plans, best first, and how many layouts each rule
    rejected (with the smallest memory a rejected-for-memory layout needed)."""

    plans: list[Plan] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)
    smallest_memory_rejected: float = float("inf")


def grids(gpus: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp x tp x pp = gpus."""
    return [(gpus // (tp * pp), tp, pp) for tp in divisors(gpus) for pp in divisors(gpus // tp)]


def broken_rule(model: ModelShape, cluster: Cluster, job: Job, grid: tuple, rows: int) -> str:
    """The first rule a (dp, tp, pp) with b rows per micro-batch breaks, or '' (memory apart)."""
    dp, tp, pp = grid
    if model.heads % tp:
        return "heads"
    if cluster.gpus_per_node % tp:
        return "node"
    if model.layers % pp:
        return "layers"
    if job.global_batch % (dp * rows):
        return "batch"
    return ""


def layouts(dp: int, tp: int, pp: int, rows: int, micro_batches: int, choices: Choices):
    """Every ZeRO stage, recomputation and sequence-parallel setting for one grid."""
    for zero in choices.zero_stages if dp > 1 else (0,):
        for recompute in choices.recompute:
            for sp in choices.sequence_parallel if tp > 1 else (False,):
                yield Layout(dp, tp, pp, zero, rows, micro_batches, recompute, sp)


def search(model: ModelShape, cluster: Cluster, job: Job, choices: Choices | None = None) -> Search:
    """Every feasible layout, best first (module docstring)."""
    choices, found = choices or Choices(), Search()
    flops = step_flops(model, job.global_batch, recompute=False)
    for grid in grids(cluster.gpus):
        for rows in job.micro_batch_sizes:
            rule = broken_rule(model, cluster, job, grid, rows)
            if rule:
                found.rejected[rule] += 1
                continue
            micro_batches = job.global_batch // (grid[0] * rows)
            for layout in layouts(*grid, rows, micro_batches, choices):
                memory = memory_per_device(model, layout, job)
                if memory.total > cluster.memory_bytes:
                    found.rejected["memory"] += 1
                    smallest = min(found.smallest_memory_rejected, memory.total)
                    found.smallest_memory_rejected = smallest
                    continue
                time = step_time(model, cluster, job, layout)
                found.plans.append(Plan(layout, memory, time, flops))
    found.plans.sort(key=_rank)
    return found


def _rank(plan: Plan) -> tuple:
    layout = plan.layout
    return (plan.time.total, plan.memory.total, layout.tp, layout.pp, layout.zero)


def best_plans(model: ModelShape, cluster: Cluster, job: Job,
               choices: Choices | None = None) -> list[Plan]:
    """The feasible plans, best first; PlanError naming the rule that failed most when none is."""
    found = search(model, cluster, job, choices)
    if found.plans:
        return found.plans
    rule, count = found.rejected.most_common(1)[0]
    total = sum(found.rejected.values())
    detail = RULES[rule]
    if rule == "memory":
        need, have = found.smallest_memory_rejected / 2**30, cluster.memory_bytes / 2**30
        detail += f" (the smallest layout needs {need:.1f} GiB, a GPU has {have:.1f} GiB)"
    raise PlanError(f"no layout fits: {count} of {total} failed on {detail}; try more GPUs, "
                    "--recompute on, a smaller --micro-batch-size or another --gpus-per-node")


def resimulated(model: ModelShape, cluster: Cluster, job: Job, plans: list[Plan]) -> list[Plan]:
    """The same plans with step times from the pipeline simulator, ranked again."""
    again = [replace(plan, time=step_time(model, cluster, job, plan.layout, simulate=True))
             for plan in plans]  # fmt: skip
    return sorted(again, key=_rank)
