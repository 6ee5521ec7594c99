"""What the model a configuration describes weighs, before it is built: layers, parameters per
layer, ZeRO's units per stage, and whether the ranks on this machine have the memory for it."""

from typing import TYPE_CHECKING

from minimp.checkpoints.errors import ConfigError
from minimp.parallel.pipeline.split import split_counts
from minimp.parallel.tensor.models import paired_counts
from minimp.parallel.zero.formulas import memory_formula, peak_formula
from minimp.precision.casting import ACTIVATION_DTYPES

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
        return [embeddings] + [12 * width * width + 13 * width] * layers + [2 * width]
    features, classes = DIGITS_SHAPE
    counts, inputs = [], features
    for _ in range(layers):
        counts += [inputs * width + width, 0]
        inputs = width
    return counts + [inputs * classes + classes]


def rank_layer_counts(config: "TrainConfig") -> list[int]:
    """layer_parameter_counts of one tensor-parallel rank: a GPT block keeps 1/tp of its
    matrices and of the cut biases (12 C^2/tp + 7 C/tp) and whole LayerNorms and row biases (6 C);
    an MLP pair keeps 1/tp of both matrices and of the first bias, the second bias whole."""
    counts, tp, width = layer_parameter_counts(config), config.tp, config.hidden
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


def zero_unit_sizes(config: "TrainConfig") -> list[list[int]]:
    """The sizes of ZeRO's units (minimp/parallel/zero/layout.py) on each pipeline stage: one
    per layer with weights, the GPT's token and position embeddings apart (the head reads the
    first too), and the last stage's copy of the token embedding (whole with --tp too)."""
    counts = rank_layer_counts(config)
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


def parameter_count(config: "TrainConfig") -> int:
    """Parameters of the model these flags build (before it is built)."""
    return sum(layer_parameter_counts(config))


def check_memory(config: "TrainConfig", ranks_on_this_node: int, available: int) -> None:
    """Refuse, before anything is allocated, a model that cannot fit this machine. Every rank
    builds the whole model in float32 and in the compute dtype (6 bytes a parameter; with --tp a
    second float32 copy to cut, 4 more); its stage's model states are ZeRO's formulas
    (minimp/parallel/zero/formulas.py: what a rank holds between steps, and the most it adds inside
    one), on the largest stage; its activations at most the whole batch, bounded by 12 bytes per
    row, width and layer for the MLP and by the GPT block's 34 sbh + 5 a s^2 b (models/gpt.py)
    with room for float32."""
    parameters, dp = parameter_count(config), max(1, config.dp)
    compute = config.activation_dtype().itemsize
    wire = ACTIVATION_DTYPES[config.grad_comm_dtype].itemsize
    slots = 1 if config.optimizer == "sgd" else 2  # SGD's momentum buffer, Adam's two moments
    states = []
    for units in zero_unit_sizes(config):  # each pipeline stage's units
        held = memory_formula(config.zero, unit_sizes=units, rank=0, world_size=dp,
                              compute_bytes=compute, wire_bytes=wire, slots=slots)
        peak = peak_formula(config.zero, unit_sizes=units, compute_bytes=compute)
        states.append(sum(held.values()) + peak)
    per_rank = 6 * parameters + max(states)
    if config.tp > 1:  # the copy that is cut, whole in float32 until it is
        per_rank += 4 * parameters
    rows, width, layers = config.batch_size, config.hidden, config.layers
    if config.model == "gpt":
        s, a = config.context, config.heads
        per_rank += layers * (70 * s * rows * width + 10 * a * s * s * rows)
    else:
        per_rank += 12 * rows * width * (layers + 1)
    needed = per_rank * ranks_on_this_node
    if needed > available:
        raise ConfigError(f"the model has {parameters:,} parameters: about {needed / 2**30:.1f} "
                          f"GiB for the {ranks_on_this_node} rank(s) on this machine, which has "
                          f"{available / 2**30:.1f} GiB free (lower --hidden or --layers)")
