"""What the model a configuration describes weighs, before it is built: layers, parameters per
layer, ZeRO's units per stage, and whether the ranks on this machine have the memory for it and
for every buffer a flag sizes."""

import math
from typing import TYPE_CHECKING

from minimp.checkpoints.errors import ConfigError
from minimp.parallel.context.ring import ring_memory
from minimp.parallel.pipeline.split import split_counts
from minimp.parallel.tensor.models import paired_counts
from minimp.parallel.zero.formulas import memory_formula, peak_formula
from minimp.plan.inputs import ModelShape
from minimp.plan.memory import mixture_bytes
from minimp.precision.wire import buffer_bytes
from minimp.train.progress import size_text  # the summary's sizes: 1.5 KiB, 2.0 GiB

if TYPE_CHECKING:  # config.py imports this module's callers (checks.py)
    from minimp.train.config import TrainConfig

# (input features, classes) of the digits, and the characters of shakespeare: known before the
# data is loaded (tests check they match the data).
DIGITS_SHAPE = (64, 10)
SHAKESPEARE_VOCABULARY = 65


def weighted_layers(config: "TrainConfig") -> int:
    """How many layers with parameters the model has: where the pipeline may cut (with --tp, an
    MLP's hidden layers in pairs, which stay together)."""
    if config.model == "mlp" and config.tp > 1:
        return config.layers // 2 + 1
    return config.layers + (2 if config.model == "gpt" else 1)


def layer_parameter_counts(config: "TrainConfig") -> list[int]:
    """Parameters of each layer of the model these flags build, in order (ReLUs hold none)."""
    width, layers = config.hidden, config.layers
    if config.model == "gpt":  # embeddings (tied head), per block 12 C^2 + 13 C, final LayerNorm
        embeddings = (SHAKESPEARE_VOCABULARY + config.context) * width
        block = gpt_shape(config).block_parameters()  # with experts: the router and E experts
        return [embeddings] + [block] * layers + [2 * width]
    features, classes = DIGITS_SHAPE
    counts, inputs = [], features
    for _ in range(layers):
        counts += [inputs * width + width, 0]
        inputs = width
    return counts + [inputs * classes + classes]


def gpt_shape(config: "TrainConfig") -> ModelShape:
    """The GPT these flags build, as the planner describes a model (its parameter counts)."""
    return ModelShape(config.layers, config.hidden, config.heads, config.context,
                      SHAKESPEARE_VOCABULARY, dropout=config.dropout > 0, experts=config.experts,
                      top_k=config.top_k, expert_hidden=config.expert_hidden)


def rank_layer_counts(config: "TrainConfig") -> list[int]:
    """layer_parameter_counts of one tensor-parallel rank: a GPT block keeps 1/tp of its
    matrices and of the cut biases (12 C^2/tp + 7 C/tp) and whole LayerNorms and row biases (6 C);
    an MLP pair keeps 1/tp of both matrices and of the first bias, the second bias whole. With
    --ep a block keeps E/ep of its experts (minimp/parallel/expert/layout.py)."""
    counts, tp, width = layer_parameter_counts(config), config.tp, config.hidden
    if config.ep > 1:  # the other ranks' experts are freed once the model is cut
        others = config.experts - config.experts // config.ep
        freed = others * gpt_shape(config).expert_parameters()
        return [counts[0]] + [count - freed for count in counts[1:-1]] + [counts[-1]]
    if tp == 1:
        return counts
    if config.model == "gpt":
        block = 12 * width * width // tp + 7 * width // tp + 6 * width
        return [counts[0]] + [block] * config.layers + [counts[-1]]
    weighted = [index for index, count in enumerate(counts) if count]
    hidden = weighted[:-1]
    for first, second in zip(hidden[0::2], hidden[1::2]):
        counts[first] = (counts[first] - width) // tp + width // tp  # weight and bias cut
        counts[second] = (counts[second] - width) // tp + width  # weight cut, bias whole
    return counts


def stage_bounds(config: "TrainConfig") -> list[tuple[int, int]]:
    """The pipeline's split of the layers into --pp x --virtual-stages chunks (the stages, with
    one virtual stage), as minimp/parallel/apply.py cuts the built model; chunk i is pipeline rank
    i % pp's."""
    counts = layer_parameter_counts(config)
    if config.model == "mlp" and config.tp > 1:
        counts = paired_counts(counts)
    return split_counts(counts, config.pp * config.virtual_stages)


def zero_unit_sizes(config: "TrainConfig", experts_apart: bool = False) -> list[list[int]]:
    """The sizes of ZeRO's units (minimp/parallel/zero/layout.py) on each pipeline stage: one
    per layer with weights, the GPT's token and position embeddings apart (the head reads the
    first too), and the last stage's copy of the token embedding (whole with --tp too).
    experts_apart: each block without the experts it holds (their units: expert_unit_sizes)."""
    counts = rank_layer_counts(config)
    if experts_apart and config.experts:
        held = expert_unit_sizes(config)[0][:1] or [0]  # every block holds the same experts
        counts = [counts[0]] + [count - held[0] for count in counts[1:-1]] + [counts[-1]]
    token = SHAKESPEARE_VOCABULARY * config.hidden
    sizes: list[list[int]] = [[] for _ in range(config.pp)]
    for index, (start, stop) in enumerate(stage_bounds(config)):
        units = [count for count in counts[start:stop] if count]
        if config.model == "gpt":
            if start == 0:  # the embeddings' two tables are two units
                units[0:1] = [token, config.context * config.hidden]
            elif stop == len(counts):  # the head reads the tied copy of the token embedding
                units.append(token)
        sizes[index % config.pp] += units
    return sizes


def expert_unit_sizes(config: "TrainConfig") -> list[list[int]]:
    """ZeRO's expert units on each pipeline stage: with --experts each block's experts are a unit
    of their own (E/ep of them with --ep), cut over the replicas holding them (parallel/zero/)."""
    sizes: list[list[int]] = [[] for _ in range(config.pp)]
    if not config.experts:
        return sizes
    held = config.experts // config.ep * gpt_shape(config).expert_parameters()
    for index, (start, stop) in enumerate(stage_bounds(config)):  # layers 1 .. L are the blocks
        sizes[index % config.pp] += [held] * len(range(max(start, 1), min(stop, config.layers + 1)))
    return sizes


def parameter_count(config: "TrainConfig") -> int:
    """Parameters of the model these flags build (before it is built)."""
    return sum(layer_parameter_counts(config))


# What the run keeps per step beyond the model (each a buffer a flag sizes, counted up front):
# every rank keeps each step's record for the summary and the plot (measured 2.4 KB, 4.8 KB with
# fp8's statistics: twice that leaves room), and with --timeline each timed call's row, and rank 0
# its event and JSON text when it writes them (measured 1.2 KB in all).
RECORD_BYTES, FP8_RECORD_BYTES = 4096, 8192
TIMELINE_EVENT_BYTES = 2048
FP8_QUANTIZERS_PER_LINEAR = 3  # input and weight (E4M3), output gradient (E5M2)


def linear_count(config: "TrainConfig") -> int:
    """fp8 Linears of the whole model: each hidden layer and the output (MLP), four per block (GPT:
    attention's c_attn and c_proj, the MLP's c_fc and c_proj; the head reuses the embedding),
    2 + 2E with --experts E (each expert's two; the router multiplies in float32, no fp8)."""
    if config.model != "gpt":
        return config.layers + 1
    return (2 + 2 * config.experts if config.experts else 4) * config.layers


def fp8_history_bytes(config: "TrainConfig") -> int:
    """The float32 amax histories of delayed scaling one rank holds: three per Linear of the
    whole model every rank builds (and of the copy --tp cuts or --ep dispatches from), twice with
    --save (a checkpoint copies them), and the one history np.roll copies at a time."""
    if config.precision != "fp8" or config.fp8_recipe != "delayed":
        return 0
    history = 4 * config.fp8_amax_history
    models = 2 if config.tp > 1 or config.ep > 1 else 1
    copies = 2 if config.save else 1
    return history * (FP8_QUANTIZERS_PER_LINEAR * linear_count(config) * models * copies + 1)


def gpt_activation_bytes(config: "TrainConfig", rows: int) -> int:
    """The most bytes a GPT rank keeps for backward, for `rows` samples of its replica, with s its
    positions (T, or T/cp with --cp), b = rows, h = --hidden, a = --heads, V the vocabulary:

        layers x (70 sbh + attention) + 4 sb (V + 2h + 8) + buffers

    70 sbh: a block's position-wise activations, models/gpt.py's block_activation_bytes
    (Korthikanti et al.'s 34 sbh in 16 bits): 16 d sbh + 16 sb for d-byte values without dropout,
    (16 d + 2) sbh + 16 sb with; the ring adds its output O, d sbh, so 68 sbh + 16 sb in float32,
    within 70 sbh for h >= 8. attention: one process's softmax, d a T^2 b ((2 d + 1) a T^2 b with
    dropout), within 10 a T^2 b; --cp ring, its float32 log-sum-exp 4 a s b (ring.py: no s x s
    array); --cp-mode ulysses, its a/cp heads' whole T x T, 10 (a/cp) T^2 b. 4 sb (V + 2h + 8):
    the head and the loss, d <= 4 bytes a value: the logits the loss keeps (V), ln_f's input and
    the head's (2h), then the int64 ids and targets and ln_f's float32 mean and 1/std (24 sb).
    buffers: with --cp ring, ring_memory's backward_buffers, the most in flight in one call (its
    k, v and float32 dK, dV; one call at a time). With --experts the MLP's 36 sbh (its float32
    input, 4h and 4h) give way to the mixture's, the planner's count of what the block keeps
    (minimp/plan/memory.py's mixture_bytes: dropless; with --ep balanced routing, each rank
    computing as many rows as it sends). The trainer's measured peak stays within this
    (tests/test_train_context_parallel_metrics.py, tests/test_train_moe.py)."""
    tokens, heads, width, cp = config.context, config.heads, config.hidden, config.cp
    s = tokens // cp
    if cp == 1:
        attention = 10 * heads * tokens * tokens * rows
    elif config.cp_mode == "ulysses":
        attention = 10 * (heads // cp) * tokens * tokens * rows
    else:
        attention = 4 * heads * s * rows
    buffers = 0
    if cp > 1 and config.cp_mode == "ring":
        shape = (rows, heads, s, width // heads)  # a rank's q
        buffers = ring_memory(shape, config.activation_dtype(), cp).backward_buffers
    head = 4 * s * rows * (SHAKESPEARE_VOCABULARY + 2 * width + 8)
    block = 70 * s * rows * width
    if config.experts:
        d = config.activation_dtype().itemsize
        block += math.ceil(mixture_bytes(gpt_shape(config), rows, d, cp)) - 36 * s * rows * width
    return config.layers * (block + attention) + head + buffers


def memory_parts(config: "TrainConfig", world_size: int = 1) -> list[tuple[str, int, str]]:
    """What one rank needs at most, as (what, bytes, the flags that lower it), before anything is
    allocated. Every rank builds the whole model in float32 and in the compute dtype (6 bytes a
    parameter; with --tp a second float32 copy to cut, 4 more); its stage's model states are
    ZeRO's formulas (minimp/parallel/zero/formulas.py: what a rank holds between steps, and the
    most it adds inside one), on the largest stage; its activations at most its replica's whole
    batch, bounded by 12 bytes per row, width and layer for the MLP and for the GPT by
    gpt_activation_bytes (with --cp, of the rank's T/cp positions); then every buffer another flag
    sizes: fp8's amax histories, the per-step records and timeline rows, the evaluation's draws.
    world_size: the job's ranks, which resolve --dp 0 (ZeRO's shards, the buckets, each replica's
    share of the batch)."""
    parameters, dp = parameter_count(config), config.data_parallel_size(world_size)
    compute = config.activation_dtype().itemsize
    wire = buffer_bytes(config.grad_comm_dtype)  # the buckets' bytes per element (fp8: float32)
    slots = 1 if config.optimizer == "sgd" else 2  # SGD's momentum buffer, Adam's two moments
    states = []
    # each pipeline stage's units; with --experts the experts' cut over the dp/ep holding them
    for units, experts in zip(zero_unit_sizes(config, experts_apart=True),
                              expert_unit_sizes(config)):
        held = memory_formula(config.zero, unit_sizes=units, rank=0, world_size=dp,
                              compute_bytes=compute, wire_bytes=wire, slots=slots,
                              expert_unit_sizes=experts, expert_world_size=dp // config.ep)
        peak = peak_formula(config.zero, unit_sizes=units + experts, compute_bytes=compute)
        states.append(sum(held.values()) + peak)
    per_parameter = 6 + (4 if config.tp > 1 else 0)  # the copy --tp cuts, float32 until it is
    rows, width, layers = max(1, config.batch_size // dp), config.hidden, config.layers
    gpt = config.model == "gpt"
    model = "--hidden, --layers or --context" if gpt else "--hidden or --layers"
    if gpt:
        activations = gpt_activation_bytes(config, rows)
    else:
        activations = 12 * rows * width * (layers + 1)
    record = FP8_RECORD_BYTES if config.precision == "fp8" else RECORD_BYTES
    events = 3 * config.micro_batches * config.virtual_stages + 8  # a step's timed calls at most
    evaluation = 8 * config.eval_batches * config.batch_size if gpt else 0  # int64 window starts
    return [
        (f"weights ({parameters:,} parameters x {per_parameter} bytes: float32 and "
         f"{config.activation_dtype().name})", per_parameter * parameters, model),
        ("gradients and optimizer state", max(states), model),
        ("activations", activations,
         "--context, --batch-size or --layers" if gpt else "--batch-size, --hidden or --layers"),
        ("fp8 amax histories", fp8_history_bytes(config), "--fp8-amax-history"),
        ("per-step records", record * config.steps, "--steps"),
        ("timeline rows", TIMELINE_EVENT_BYTES * events * config.steps if config.timeline else 0,
         "--steps, or leave out --timeline"),
        ("evaluation windows", evaluation, "--eval-batches"),
    ]


def check_memory(config: "TrainConfig", ranks_on_this_node: int, available: int,
                 world_size: int = 1) -> None:
    """Refuse, before anything is allocated, a run that cannot fit this machine: memory_parts of
    each of its ranks on this machine against the memory free. The line names each part and the
    flags that lower the largest."""
    parts = memory_parts(config, world_size)
    needed = sum(size for _, size, _ in parts) * ranks_on_this_node
    if needed > available:
        listed = ", ".join(f"{size_text(size)} of {what}" for what, size, _ in parts if size)
        _, _, lower = max(parts, key=lambda part: part[1])
        raise ConfigError(f"this run needs about {size_text(needed)} for the {ranks_on_this_node} "
                          f"rank(s) on this machine, which has {size_text(available)} free; each "
                          f"rank: {listed} (lower {lower})")
