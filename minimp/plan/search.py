"""Every layout the cluster allows, the ones that fit, ranked by predicted step time.

A layout is feasible when (checked in this order, each rejected layout counted against the first
rule it breaks, so that "nothing fits" can name the rule that failed most):

  tp = 1 with experts           minimp refuses --experts with --tp (tp x ep is not built)
  tp divides the heads          each rank computes whole heads (Shoeybi et al. 2019, section 3)
  tp divides the GPUs per node  tensor-parallel all-reduces stay on the intra-node network
  pp divides the layers         every stage holds l/P blocks
  the context splits over cp    the ring: 2 cp divides the context (zig-zag's 2 cp chunks);
                                Ulysses: cp divides it (equal shards for the all-to-all)
  cp divides the heads per tp   Ulysses only: each rank attends whole heads, a/(t cp) of them
  ep divides dp                 expert-parallel ranks are data-parallel replicas (--ep divides --dp)
  dp x b divides the batch      each replica runs M = B / (dp b) whole micro-batches of b rows
  memory fits                   plan/memory.py's peak <= the device's memory

with dp x cp x tp x pp = GPUs, cp a power of 2 (1, 2, 4, ...) and every cp > 1 in both modes, the
ring and Ulysses (what minimp's trainer runs: --cp, --cp-mode). By default (Choices.context_parallel
None) cp > 1 is searched only when nothing with cp = 1 fits: context parallelism is for a context
whose activations do not fit, and this model cannot see what it costs beyond its messages
(splitting the sequence shrinks every matrix product, which one achievable fraction of peak
ignores), so it would otherwise prefer it where nothing is known to gain. Name sizes to search
them whatever fits. The cp ranks sit inside a node when cp x tp devices fit in one (inputs.py's
placement), else their messages cross nodes (steptime.py prices both). ZeRO stages above 0 are
listed only when dp x cp > 1 (with one rank in the group they shard nothing), sequence
parallelism only when tp > 1. Ranked by predicted step time, then by memory (sequence parallelism
costs the same time as tensor parallelism alone in this model and less memory), then by fewer
tensor-, pipeline- and context-parallel ranks and lower ZeRO stages.

A mixture of experts is searched at every ep that divides its experts (Choices.expert_parallel
None), or the sizes named, each kept where it divides dp: unlike cp, what ep gains (the experts'
memory and gradient reductions shrink by ep) and costs (the all-to-alls) are both priced, so the
ranking chooses. Fewer expert-parallel ranks rank first among equals. A dense model has ep = 1.
"""

from collections import Counter
from dataclasses import dataclass, field, replace

from minimp.plan.inputs import CP_MODES, Cluster, Job, Layout, ModelShape, PlanError, divisors
from minimp.plan.memory import Memory, memory_per_device
from minimp.plan.steptime import StepTime, step_flops, step_time

RULES = {
    "experts tp": "tp must be 1 with experts (minimp refuses --experts with --tp)",
    "heads": "tp must divide the heads",
    "node": "tp must divide the GPUs per node",
    "layers": "pp must divide the layers",
    "context": "2 cp (ring) or cp (Ulysses) must divide the context",
    "cp heads": "cp must divide the heads per tp rank (Ulysses)",
    "ep": "ep must divide dp (expert-parallel ranks are data-parallel replicas)",
    "batch": "dp x micro-batch size must divide the global batch",
    "memory": "the memory per GPU"}


@dataclass
class Choices:
    """Which ZeRO stages, recomputation, sequence-parallel settings, context-parallel sizes
    (powers of 2; None: 1, and the others only when nothing with 1 fits), modes and
    expert-parallel sizes (None: every divisor of the experts; a dense model has 1) to consider."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[bool, ...] = (False, True)
    sequence_parallel: tuple[bool, ...] = (False, True)
    context_parallel: tuple[int, ...] | None = None
    cp_modes: tuple[str, ...] = CP_MODES
    expert_parallel: tuple[int, ...] | None = None


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


def powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to limit."""
    return tuple(2**k for k in range(limit.bit_length()) if 2**k <= limit)


def grids(gpus: int, cp_sizes: tuple[int, ...] = (1,)) -> list[tuple[int, int, int, int]]:
    """Every (dp, cp, tp, pp) with dp x cp x tp x pp = gpus and cp one of cp_sizes."""
    return [(gpus // (cp * tp * pp), cp, tp, pp) for cp in cp_sizes if gpus % cp == 0
            for tp in divisors(gpus // cp) for pp in divisors(gpus // (cp * tp))]


def broken_rule(model: ModelShape, cluster: Cluster, job: Job, grid: tuple, rows: int,
                cp_mode: str = "ring", ep: int = 1) -> str:
    """The first rule a (dp, cp, tp, pp) with b rows per micro-batch, cp_mode and ep breaks, or
    '' (memory apart)."""
    dp, cp, tp, pp = grid
    if model.experts and tp > 1:
        return "experts tp"
    if model.heads % tp:
        return "heads"
    if cluster.gpus_per_node % tp:
        return "node"
    if model.layers % pp:
        return "layers"
    if cp > 1 and model.context % (2 * cp if cp_mode == "ring" else cp):
        return "context"
    if cp > 1 and cp_mode == "ulysses" and model.heads // tp % cp:
        return "cp heads"
    if dp % ep:
        return "ep"
    if job.global_batch % (dp * rows):
        return "batch"
    return ""


def layouts(dp: int, cp: int, tp: int, pp: int, rows: int, micro_batches: int, cp_mode: str,
            choices: Choices, ep: int = 1):
    """Every ZeRO stage, recomputation and sequence-parallel setting for one grid."""
    for zero in choices.zero_stages if dp * cp > 1 else (0,):
        for recompute in choices.recompute:
            for sp in choices.sequence_parallel if tp > 1 else (False,):
                yield Layout(dp, tp, pp, zero, rows, micro_batches, recompute, sp, cp, cp_mode, ep)


def ep_candidates(model: ModelShape, choices: Choices) -> tuple[int, ...]:
    """The ep sizes to try: 1 for a dense model, else the ones named or every divisor of E."""
    if not model.experts:
        return (1,)
    return choices.expert_parallel or tuple(divisors(model.experts))


def search(model: ModelShape, cluster: Cluster, job: Job, choices: Choices | None = None) -> Search:
    """Every feasible layout, best first (module docstring): with choices.context_parallel None,
    cp = 1, and if nothing fits every larger power of 2 as well (the rejections of both counted)."""
    choices = choices or Choices()
    if choices.context_parallel is not None:
        return _search(model, cluster, job, choices, choices.context_parallel)
    found = _search(model, cluster, job, choices, (1,))
    if found.plans:
        return found
    larger = _search(model, cluster, job, choices, powers_of_two(cluster.gpus)[1:])
    larger.rejected += found.rejected
    larger.smallest_memory_rejected = min(larger.smallest_memory_rejected,
                                          found.smallest_memory_rejected)
    return larger


def _search(model: ModelShape, cluster: Cluster, job: Job, choices: Choices,
            cp_sizes: tuple[int, ...]) -> Search:
    found = Search()
    flops = step_flops(model, job.global_batch, recompute=False)
    cases = [(grid, cp_mode, rows, ep) for grid in grids(cluster.gpus, cp_sizes)
             for cp_mode in (choices.cp_modes if grid[1] > 1 else CP_MODES[:1])
             for rows in job.micro_batch_sizes for ep in ep_candidates(model, choices)]
    for grid, cp_mode, rows, ep in cases:
        rule = broken_rule(model, cluster, job, grid, rows, cp_mode, ep)
        if rule:
            found.rejected[rule] += 1
            continue
        micro_batches = job.global_batch // (grid[0] * rows)
        for layout in layouts(*grid, rows, micro_batches, cp_mode, choices, ep):
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
    return (plan.time.total, plan.memory.total, layout.tp, layout.pp, layout.cp, layout.ep,
            layout.zero)


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
                    "--recompute on, a smaller --micro-batch-size, another --gpus-per-node or "
                    "--cp auto")


def resimulated(model: ModelShape, cluster: Cluster, job: Job, plans: list[Plan]) -> list[Plan]:
    """The same plans with step times from the pipeline simulator, ranked again."""
    again = [replace(plan, time=step_time(model, cluster, job, plan.layout, simulate=True))
             for plan in plans]  # fmt: skip
    return sorted(again, key=_rank)
