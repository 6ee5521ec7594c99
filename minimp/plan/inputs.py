"""What the planner is given: the model's shape, the cluster, the job; checked before any work.

A model is a GPT (minimp's, and Megatron-LM's: pre-LayerNorm blocks, an MLP 4x wide, token and
position embeddings, the head tied to the token embedding) of `layers` blocks of width `hidden`
with `heads` heads, `context` tokens per sample and a vocabulary of `vocab`. Given only a number
of parameters, `shape_for_parameters` picks one: GPT-3's proportions (Brown et al. 2020, Table
2.1: 175B has 96 layers of 12,288, heads of 128 channels), hidden = 128 x layers, rounded to whole
heads of 128.

A mixture of experts (minimp/models/moe.py, the trainer's --experts): with `experts` E > 0 each
block's MLP is E expert MLPs of width `expert_hidden` (0: the dense MLP's 4h), each C -> f, GELU,
f -> C with biases, and a router (E h, no bias) sending each token to its `top_k` K of them. The
planner assumes dropless, balanced routing: every expert gets T K / E of a sample's (token,
choice) pairs and none is dropped, so it takes no capacity factor (balanced, any factor >= 1
drops nothing, and minimp pads no expert up to its capacity, so such a factor changes neither
memory nor time; one below 1 drops pairs, which is not priced). The experts split over `ep`
ranks (expert parallelism, --ep; the placement below).

A cluster is `gpus` devices, `gpus_per_node` of them per node, each with `memory_bytes`,
`peak_flops` of which `achievable` is reached on the model's matrix products, and two networks:
`intra` inside a node (NVLink) and `inter` between nodes (InfiniBand), each a model of
collectives (`Links`, links.py).

A layout's grid is dp x cp x tp x pp = GPUs, placed as Megatron-Core and minimp's trainer place
it: tensor-parallel ranks adjacent, then context-parallel ranks, then replicas, then pipeline
stages (rank = stage x dp cp tp + replica x cp tp + context x tp + shard). A group of ranks spans
the consecutive devices of its own and the inner dimensions (a context-parallel group cp x tp of
them, the gradients' dp x cp group dp x cp x tp) and uses the intra-node network when that span
fits in a node, else the inter-node one (steptime.py). An expert-parallel group is ep adjacent
replicas (minimp/parallel/expert/, Megatron-Core's): it spans ep x cp x tp devices; ep divides dp.
"""

import math
from dataclasses import dataclass

from minimp.plan.links import Links
from minimp.precision.wire import Fp8Wire, grad_wire

PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes of an activation and a compute copy
GRAD_COMM_DTYPES = ("fp32", "fp16", "bf16", "fp8")  # the trainer's --grad-comm-dtype (wire_fields)
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "sgd": 1}  # float32 slots per parameter (SGD: momentum)
# The schedules of minimp's registry (parallel/pipeline/schedules, by their --schedule names) that
# the planner prices: a step of (M + P - 1) slots (steptime.py), micro-batches in flight as
# memory.in_flight counts them; the interleaved and zero-bubble schedules are neither
PRICED_SCHEDULES = ("1f1b", "gpipe")
# How context parallelism splits attention (minimp/parallel/context/, the trainer's --cp-mode):
# key/value blocks around a ring, or all-to-alls to head shards (Ulysses)
CP_MODES = ("ring", "ulysses")


class PlanError(ValueError):
    """Input the planner cannot work with; the message names the fix (one line)."""


@dataclass(frozen=True)
class ModelShape:
    """A GPT: blocks, width, heads, tokens per sample, vocabulary; dropout or not (its masks)."""

    layers: int
    hidden: int
    heads: int
    context: int
    vocab: int
    dropout: bool = True  # Korthikanti et al.'s 34 sbh counts the dropout masks
    experts: int = 0  # E: each block's MLP a mixture of E experts; 0: the dense MLP
    top_k: int = 2  # K: experts per token
    expert_hidden: int = 0  # f: each expert's width; 0: the dense MLP's 4h

    @property
    def expert_width(self) -> int:
        """f, each expert's hidden width (4h unless given)."""
        return self.expert_hidden or 4 * self.hidden

    def expert_parameters(self) -> int:
        """One expert (c_fc and c_proj with their biases): 2hf + f + h."""
        h, f = self.hidden, self.expert_width
        return 2 * h * f + f + h

    def block_parameters(self) -> int:
        """A block: 12h^2 + 13h dense; with experts attention and LayerNorms 4h^2 + 8h, the
        router E h and E experts (minimp/train/sizes.py's count)."""
        h = self.hidden
        if not self.experts:
            return 12 * h * h + 13 * h
        return 4 * h * h + 8 * h + self.experts * (h + self.expert_parameters())

    def parameters(self) -> int:
        """minimp's GPT: per block 12h^2 + 13h, embeddings (V + s) h, final LayerNorm 2h (the head
        is tied). Narayanan et al.'s Eq. 2, 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)), plus 2h.
        With experts, block_parameters's per block."""
        h = self.hidden
        return self.layers * self.block_parameters() + (self.vocab + self.context) * h + 2 * h


@dataclass(frozen=True)
class Cluster:
    """The machines: how many devices, how they are grouped, what each can hold and compute."""

    gpus: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float  # per device, in the compute precision
    achievable: float  # fraction of peak_flops the matrix products reach
    intra: Links  # collectives inside a node
    inter: Links  # collectives between nodes
    name: str = ""

    @property
    def flops(self) -> float:
        """FLOP/s one device is assumed to compute at."""
        return self.peak_flops * self.achievable


@dataclass(frozen=True)
class Job:
    """What one optimizer step does: samples, rows per micro-batch, precision, optimizer."""

    global_batch: int
    micro_batch_sizes: tuple[int, ...] = (1,)
    precision: str = "bf16"
    optimizer: str = "adam"
    grad_comm_bytes: int = 4  # gradients on the wire (minimp's --grad-comm-dtype fp32)
    # what each ring message of the gradients carries besides its elements: the fp8 wire's
    # float32 scale (minimp/precision/wire.py); 0 for a 16- or 32-bit wire
    grad_scale_bytes: int = 0
    schedule: str = "1f1b"
    # Megatron-LM cuts the token embedding and the head over the vocabulary across the
    # tensor-parallel ranks; minimp keeps both whole on every rank (parallel/tensor/models.py)
    vocabulary_parallel: bool = True

    @property
    def compute_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def slots(self) -> int:
        return OPTIMIZER_SLOTS[self.optimizer]

    @property
    def grad_buffer_bytes(self) -> int:
        """Bytes an element of the gradients' send and receive buffers: the wire's, but for the
        fp8 wire, which packs them in float32 (wire.py's buffer_bytes) and quantizes a message
        at a time."""
        return 4 if self.grad_scale_bytes else self.grad_comm_bytes


def wire_fields(grad_comm_dtype: str) -> dict[str, int]:
    """Job's grad_comm_bytes and grad_scale_bytes for a --grad-comm-dtype (fp32, fp16, bf16 or
    fp8), from the codec the trainer sends with: an fp8 message of n elements is wire.py's
    message_bytes(n) = n + 4 bytes."""
    wire = grad_wire(grad_comm_dtype)
    if isinstance(wire, Fp8Wire):
        return {"grad_comm_bytes": wire.message_bytes(1) - wire.message_bytes(0),
                "grad_scale_bytes": wire.message_bytes(0)}
    return {"grad_comm_bytes": wire.itemsize, "grad_scale_bytes": 0}


MAX_GLOBAL_BATCH = 2**20  # sequences a step; every layout's micro-batch count is searched
MAX_SIMULATED_MICRO_BATCHES = 4096  # --simulate executes each micro-batch of each stage
MAX_PARAMETERS = 1e15  # the largest trained models are ~1e12; above this nothing is meaningful


def check_inputs(model: ModelShape, cluster: Cluster, job: Job) -> None:
    """Raise PlanError with one line for the first input that cannot work."""
    positive = {
        "--layers": model.layers, "--hidden": model.hidden, "--heads": model.heads,
        "--context": model.context, "--vocab": model.vocab, "--gpus": cluster.gpus,
        "--gpus-per-node": cluster.gpus_per_node,
        "--memory-gb": cluster.memory_bytes / 2**30,  # in the flags' units, for the message
        "--peak-tflops": cluster.peak_flops / 1e12, "--global-batch": job.global_batch}
    for flag, value in positive.items():
        if not (value > 0 and math.isfinite(value)):
            raise PlanError(f"{flag} must be a positive finite number, got {value}")
    if job.global_batch > MAX_GLOBAL_BATCH:
        raise PlanError(f"--global-batch {job.global_batch} is beyond what the planner searches "
                        f"(at most {MAX_GLOBAL_BATCH:,} sequences a step)")
    if model.hidden % model.heads:
        raise PlanError(f"--heads {model.heads} must divide --hidden {model.hidden} "
                        f"(try --heads {largest_divisor_at_most(model.hidden, model.heads)})")
    if not 0 < cluster.achievable <= 1:
        raise PlanError(f"--achievable is a fraction of peak in (0, 1], got {cluster.achievable}")
    if cluster.gpus > cluster.gpus_per_node and cluster.gpus % cluster.gpus_per_node:
        raise PlanError(f"--gpus {cluster.gpus} is not a whole number of nodes of "
                        f"--gpus-per-node {cluster.gpus_per_node}")
    if any(size <= 0 for size in job.micro_batch_sizes):
        raise PlanError(f"--micro-batch-size must be positive, got {job.micro_batch_sizes}")
    if min(job.micro_batch_sizes) > job.global_batch:
        raise PlanError(f"--global-batch {job.global_batch} is smaller than the smallest "
                        f"--micro-batch-size {min(job.micro_batch_sizes)}")
    if model.experts < 0 or model.expert_hidden < 0:
        raise PlanError(f"--experts and --expert-hidden must be 0 or more, got {model.experts} "
                        f"and {model.expert_hidden}")
    if model.experts and not 1 <= model.top_k <= model.experts:
        raise PlanError(f"--top-k must be between 1 and --experts {model.experts}, got "
                        f"{model.top_k}")
    if job.precision not in PRECISION_BYTES:
        raise PlanError(f"--precision must be one of {sorted(PRECISION_BYTES)}")
    if job.optimizer not in OPTIMIZER_SLOTS:
        raise PlanError(f"--optimizer must be one of {sorted(OPTIMIZER_SLOTS)}")
    if job.schedule not in PRICED_SCHEDULES:
        raise PlanError(f"--schedule must be one of {list(PRICED_SCHEDULES)}")


def largest_divisor_at_most(number: int, limit: int) -> int:
    """The largest d <= limit that divides number (1 at least)."""
    return max(d for d in range(1, min(number, limit) + 1) if number % d == 0)


def shape_for_parameters(parameters: float, context: int, vocab: int) -> ModelShape:
    """A GPT of about `parameters` with GPT-3's proportions: hidden = 128 x layers, heads of 128
    channels (see the module docstring). The nearest whole number of layers to the cube root of
    12 l h^2 = parameters; at least one layer and one head."""
    layers = max(1, round((parameters / (12 * 128**2)) ** (1 / 3)))
    heads = max(1, layers)  # hidden = 128 x layers = heads x 128
    return ModelShape(layers, 128 * heads, heads, context, vocab)


def divisors(number: int) -> list[int]:
    """Every positive divisor of number, ascending."""
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return sorted(set(small + [number // d for d in small]))


@dataclass(frozen=True)
class Layout:
    """One configuration: the grid (dp x cp x tp x pp: the module docstring places it), ZeRO's
    stage over the dp x cp ranks of a stage, rows per micro-batch and micro-batches per step on
    each replica, full recomputation, sequence parallelism, how the cp ranks split attention
    (cp_mode, one of CP_MODES; nothing to split at cp = 1), and over how many of the dp replicas
    each mixture's experts are split (ep, dividing dp; 1: every replica holds every expert)."""

    dp: int
    tp: int
    pp: int
    zero: int = 0
    micro_batch_size: int = 1
    micro_batches: int = 1
    recompute: bool = False
    sequence_parallel: bool = False
    cp: int = 1
    cp_mode: str = "ring"
    ep: int = 1

    def __str__(self) -> str:
        flags = " recompute" * self.recompute + " sp" * self.sequence_parallel
        flags += f" cp {self.cp} {self.cp_mode}" if self.cp > 1 else ""
        flags += f" ep {self.ep}" if self.ep > 1 else ""
        return (f"dp {self.dp} tp {self.tp} pp {self.pp} zero {self.zero} "
                f"b {self.micro_batch_size} M {self.micro_batches}{flags}")  # fmt: skip

    @property
    def ranks(self) -> int:
        """Devices the grid takes: dp x cp x tp x pp."""
        return self.dp * self.cp * self.tp * self.pp
