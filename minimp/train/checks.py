"""The checks of a training configuration, of every flag, run before anything is built.

Every number in its range (NaN and inf included), the fp8 flags, the model against its data, the
parallel layout (--tp's cuts: whole heads, the MLP's pairs, sequence parallelism's slices; the dp x
tp x pp grid against the job's ranks; the pipeline schedule against the layers and micro-batches),
the batch split, ZeRO's shards, the files, the injections. (What the model weighs, and whether it
fits in memory: sizes.py.) Each check raises ConfigError naming the flag and the fix; nothing here
allocates or communicates.
"""

import dataclasses
import math
import os
from typing import TYPE_CHECKING

from minimp.backend import DEVICE_ENVIRONMENT_VARIABLE
from minimp.checkpoints.errors import ConfigError
from minimp.parallel.context.ulysses import check_ulysses
from minimp.parallel.pipeline.schedules import schedule_problem
from minimp.parallel.pipeline.stage import FIRST_TAG
from minimp.parallel.zero.stages import zero_stage
from minimp.train.checks_nvfp4 import NVFP4_BLOCK, check_emulated_on_cpu, check_nvfp4
from minimp.train.sizes import weighted_layers, zero_unit_sizes

if TYPE_CHECKING:  # config.py imports this module to validate itself
    from minimp.train.config import TrainConfig

POSITIVE_INTEGERS = ("steps", "batch_size", "micro_batches", "layers", "hidden", "log_every",
                     "loss_scale_growth_interval", "pp", "tp", "cp", "virtual_stages", "top_k",
                     "ep")
NON_NEGATIVE = ("experts", "capacity_factor", "aux_loss_coef", "router_z_loss_coef",
                "expert_hidden", "weight_decay", "max_grad_norm", "dp", "threads", "check_replicas",
                "seed", "save_every", "max_consecutive_skips", "warmup", "lr_decay_steps",
                "eval_every", "eval_batches", "heads", "context", "zero")
# Every number's range, checked in this order: (fields, low, whether low itself is allowed, high
# (never allowed), what the value must do). NaN fails every comparison, so it is caught too.
RANGES = (
    (POSITIVE_INTEGERS, 0, False, math.inf, "be a positive integer"),
    (("lr", "min_lr", "bucket_mb"), 0, False, math.inf, "be a positive number"),
    (NON_NEGATIVE, 0, True, math.inf, "be 0 or more"),
    (("timeout",), 0, True, math.inf, "be 0 (never) or seconds"),
    (("dropout", "beta2", "momentum"), 0.0, True, 1.0, "lie in [0, 1)"),  # optim's rule too
)
# The shortest --timeout (but 0, never): one message may legitimately wait for a whole setup (every
# rank builds its model and loads its data before the first collective) or for a rank that the OS
# descheduled on a busy machine (tens to hundreds of milliseconds); below a second the watchdog
# would abort healthy jobs, blaming a frozen rank.
SHORTEST_TIMEOUT = 1.0


def flag(name: str) -> str:
    """The command-line flag of a field: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")


def validate(config: "TrainConfig", world_size: int) -> None:
    """Raise ConfigError naming the flag and the fix for the first value that cannot work."""
    _check_ranges(config)
    check_nvfp4(config)  # --precision nvfp4's own file: checks_nvfp4.py
    _check_fp8(config)
    _check_master_weights(config)
    _check_companions(config)
    _check_model(config)
    _check_experts(config)
    _check_layout(config, world_size)
    _check_expert_parallel(config, config.data_parallel_size(world_size))
    _check_batch(config, config.data_parallel_size(world_size))
    _check_zero(config, config.data_parallel_size(world_size))
    _check_wire(config)
    _check_fp8_groups(config, config.data_parallel_size(world_size))
    if config.save_every and not config.save:
        raise ConfigError("--save-every needs --save (the path to save to)")
    _check_distinct_files(config)
    config.loss_scale_kind()
    config.injection("inject_overflow", world_size)
    config.injection("inject_fault", world_size)


def _check_ranges(config: "TrainConfig") -> None:
    """Every number inside its range (RANGES; NaN fails every comparison, so it is caught too),
    a --timeout a healthy job can keep, and the decay's end not above its peak."""
    for names, low, low_allowed, high, what in RANGES:
        for name in names:
            value = getattr(config, name)
            above = value >= low if low_allowed else value > low
            if not (above and value < high):
                raise ConfigError(f"{flag(name)} must {what}, got {value}")
    if 0 < config.timeout < SHORTEST_TIMEOUT:
        raise ConfigError(f"--timeout {config.timeout:g} s is shorter than a healthy message can "
                          f"wait (setup, a busy machine): use 0 (never) or at least "
                          f"{SHORTEST_TIMEOUT:g} s")
    if config.min_lr > config.lr:
        raise ConfigError(f"--min-lr {config.min_lr} is above --lr {config.lr}")


FP8_RECIPES = ("delayed", "current", "none", "rowwise", "blockwise", "mxfp8", "mxfp8-round-up")
FP8_FLAGS = ("fp8_recipe", "fp8_amax_history", "fp8_margin")


def _check_fp8(config: "TrainConfig") -> None:
    """fp8 flags only with --precision fp8, a known recipe, delayed scaling's numbers in range,
    and the CPU (the emulation casts with ml_dtypes, on NumPy arrays)."""
    given = [name for name in FP8_FLAGS if getattr(config, name) is not None]
    if config.precision != "fp8":
        if given:
            raise ConfigError(f"{flag(given[0])} needs --precision fp8")
        return
    if config.fp8_recipe not in FP8_RECIPES:
        raise ConfigError(
            f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {config.fp8_recipe!r}")
    check_emulated_on_cpu(config)
    if config.fp8_recipe != "delayed":
        for name in ("fp8_amax_history", "fp8_margin"):  # delayed scaling's numbers
            if getattr(config, name) is not None:
                raise ConfigError(f"{flag(name)} applies to --fp8-recipe delayed only")
        return
    if config.fp8_amax_history < 1:
        raise ConfigError(
            f"--fp8-amax-history must be a positive integer, got {config.fp8_amax_history}")
    if not 0 <= config.fp8_margin <= 64:
        raise ConfigError(f"--fp8-margin must lie in 0..64, got {config.fp8_margin}")


MASTER_WEIGHTS = ("fp32", "none")
# Layouts --master-weights none is built for: one process and --dp at --zero 0, whose replicas
# draw the same stochastic-rounding bits (from --seed, the step and the parameter's index).
# (flag, its value that leaves it off, why it is not built)
NOT_WITHOUT_MASTERS = (("zero", 0, "ZeRO shards the float32 masters, and there are none"),
                       ("pp", 1, "a pipeline's tied embedding copies would draw different bits"),
                       ("tp", 1, "its shards' stochastic rounding is not checked"),
                       ("cp", 1, "its shards' stochastic rounding is not checked"))


def _check_master_weights(config: "TrainConfig") -> None:
    """--master-weights none keeps bf16 weights only: with --precision bf16, on the layouts it is
    built for; --stochastic-rounding only without masters, on the CPU (stochastic.py is NumPy's)."""
    if config.master_weights not in MASTER_WEIGHTS:
        raise ConfigError(f"--master-weights must be one of {', '.join(MASTER_WEIGHTS)}, got "
                          f"{config.master_weights!r}")
    if not isinstance(config.stochastic_rounding, bool):
        raise ConfigError("--stochastic-rounding is a switch (True or False), got "
                          f"{config.stochastic_rounding!r}")
    if config.master_weights == "fp32":
        if config.stochastic_rounding:
            raise ConfigError("--stochastic-rounding rounds weights kept without float32 masters; "
                              "with --master-weights fp32 the masters hold every update exactly "
                              "(add --master-weights none, or leave --stochastic-rounding out)")
        return
    if config.precision != "bf16":
        raise ConfigError(f"--master-weights none keeps the weights in bf16 only: it needs "
                          f"--precision bf16, got {config.precision} (fp32 weights are their own "
                          "masters; fp16 and fp8 runs keep fp32 masters)")
    for name, off, why in NOT_WITHOUT_MASTERS:
        value = getattr(config, name)
        if value != off:
            raise ConfigError(f"--master-weights none with {flag(name)} {value}: not built ({why}; "
                              f"use --master-weights fp32, or --dp without {flag(name)})")
    device = config.device or os.environ.get(DEVICE_ENVIRONMENT_VARIABLE, "").strip().lower()
    if config.stochastic_rounding and device == "gpu":
        raise ConfigError("--stochastic-rounding is emulated on the CPU (NumPy bit patterns, "
                          "minimp/precision/stochastic.py); use --device cpu")


# The block-scaled recipes (precision/recipes.py) and how many values along K share a scale
# (rowwise: all of K, any size).
FP8_BLOCK_SCALED = {"rowwise": None, "blockwise": 128, "mxfp8": 32, "mxfp8-round-up": 32}


def _check_fp8_groups(config: "TrainConfig", dp: int) -> None:
    """A block-scaled recipe or --precision nvfp4: the GPT's Linears under --dp and --pp (a
    shard's or an expert's groups would not be one process's), each GEMM's K a multiple of its
    K block. A group is never padded (blocks.py), so a size it does not tile is refused here,
    before any work."""
    if config.precision == "nvfp4":  # (its other checks: checks_nvfp4.py)
        recipe, block = "--precision nvfp4", NVFP4_BLOCK
        fix = "--precision fp8 --fp8-recipe current"
    elif config.precision == "fp8" and config.fp8_recipe in FP8_BLOCK_SCALED:
        recipe, fix = f"--fp8-recipe {config.fp8_recipe}", "--fp8-recipe current or delayed"
        block = FP8_BLOCK_SCALED[config.fp8_recipe]
    else:
        return
    for name, used in (("--tp", config.tp > 1), ("--cp", config.cp > 1),
                       ("--experts", config.experts > 0)):
        if used:
            raise ConfigError(f"{recipe} with {name} is not built (its groups would cut across "
                              f"shards or expert batches): use {fix}")
    if block is None:
        return
    if config.model != "gpt":
        raise ConfigError(f"{recipe} scales {block} values along K together, and the MLP's "
                          f"input and class counts are not multiples of {block}: use --model "
                          f"gpt or --fp8-recipe rowwise")
    if config.hidden % block:  # then K = hidden, 3 hidden, 4 hidden all are multiples
        raise ConfigError(f"{recipe} needs --hidden a multiple of {block} (every Linear's K), "
                          f"got {config.hidden}")
    rows = config.batch_size // dp // config.micro_batches
    if rows * config.context % block:  # the weight gradient sums over a micro-batch's tokens
        raise ConfigError(f"{recipe} needs a micro-batch's tokens, {rows} rows x --context "
                          f"{config.context} = {rows * config.context}, to be a multiple of "
                          f"{block} (the weight-gradient GEMM's K): change --batch-size, "
                          f"--micro-batches or --context")


# Flags that act only beside another (fields, the flag they need, whether the config has it).
COMPANIONS = (
    (("top_k", "capacity_factor", "aux_loss_coef", "router_z_loss_coef", "expert_hidden"),
     "--experts E", lambda config: config.experts > 0),
    (("cp_layout", "cp_mode"), "--cp N", lambda config: config.cp > 1),
)


def _check_companions(config: "TrainConfig") -> None:
    """A flag moved from its default without the flag it acts beside would do nothing: a typo
    or a forgotten flag, said in one line (as the fp8 flags without --precision fp8)."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    for names, needed, present in COMPANIONS:
        if present(config):
            continue
        for name in names:
            if getattr(config, name) != defaults[name]:
                raise ConfigError(f"{flag(name)} {getattr(config, name)} does nothing without "
                                  f"{needed}: add {needed.split()[0]}, or leave {flag(name)} out")


def _check_model(config: "TrainConfig") -> None:
    """The model fits its data: the GPT reads text, the MLP images; heads divide the width."""
    wanted = {"digits": "mlp", "shakespeare": "gpt"}[config.dataset]
    if config.model != wanted:
        raise ConfigError(f"--model {config.model} does not train on --dataset {config.dataset} "
                          f"(use --model {wanted})")
    if config.model == "gpt":
        if config.heads < 1 or config.hidden % config.heads:
            raise ConfigError(f"--heads {config.heads} must divide --hidden {config.hidden} (each "
                              "head takes an equal slice of the width)")
        if config.context < 1:
            raise ConfigError(f"--context must be a positive integer, got {config.context}")
    else:  # the MLP has no heads, context, dropout or validation set: a flag for them does nothing
        for name in GPT_ONLY:
            if getattr(config, name):
                raise ConfigError(f"{flag(name)} applies to the GPT (--dataset shakespeare); the "
                                  "digits MLP has none")


GPT_ONLY = ("heads", "context", "dropout", "eval_every", "eval_batches", "experts")


def _check_experts(config: "TrainConfig") -> None:
    """--top-k within --experts, and the two layouts the mixture refuses, one line each. It runs
    on one process and with --dp, --ep, --pp (every schedule), --recompute, --zero 1-3 and every
    precision. Not built: --tp, which would cut each expert's matrices over the tensor-parallel
    ranks (minimp splits the experts whole, with --ep), and --cp, which would cut a routing group
    (one sample's sequence, whose capacity and auxiliary loss count all its T tokens) over ranks."""
    if not config.experts:
        return
    if config.top_k > config.experts:
        raise ConfigError(f"--top-k {config.top_k} is more than --experts {config.experts} (each "
                          "token goes to top-k distinct experts)")
    if config.tp > 1:
        raise ConfigError(f"--experts with --tp {config.tp}: not built (minimp does not cut an "
                          "expert's matrices over tensor-parallel ranks; split the experts over "
                          "ranks with --ep, or use --tp without --experts)")
    if config.cp > 1:
        raise ConfigError(f"--experts with --cp {config.cp}: not built (a routing group is a "
                          "sample's whole sequence, which --cp would cut over ranks; use --ep, or "
                          "--cp without --experts)")


def _check_expert_parallel(config: "TrainConfig", dp: int) -> None:
    """--ep splits the experts over data-parallel ranks (Megatron-Core's): it needs experts, must
    divide --dp and the experts."""
    if config.ep == 1:
        return
    if not config.experts:
        raise ConfigError(f"--ep {config.ep} needs --experts (it splits the experts over ranks)")
    if dp % config.ep:
        raise ConfigError(f"--ep {config.ep} does not divide --dp {dp} (expert-parallel ranks are "
                          "data-parallel ranks: choose an --ep that divides --dp)")
    if config.experts % config.ep:
        raise ConfigError(f"--experts {config.experts} is not divisible by --ep {config.ep} (each "
                          "rank holds experts / ep of them)")


def _check_batch(config: "TrainConfig", dp: int) -> None:
    """Each replica takes an equal share of the batch, cut into equal micro-batches."""
    if config.batch_size % dp:
        raise ConfigError(f"--batch-size {config.batch_size} is not divisible by the {dp} "
                          f"data-parallel replicas (use a multiple of {dp})")
    local = config.batch_size // dp
    if local % config.micro_batches:
        raise ConfigError(f"each replica's batch of {local} is not divisible by --micro-batches "
                          f"{config.micro_batches} (pick a batch size that is a multiple of "
                          f"{dp * config.micro_batches})")


def _check_zero(config: "TrainConfig", dp: int) -> None:
    """A ZeRO stage that exists, sharding that leaves no replica empty-handed, and no flag that
    needs the replicas to hold the same state."""
    try:
        stage = zero_stage(config.zero)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not isinstance(config.recompute, bool):
        raise ConfigError(f"--recompute is a switch (True or False), got {config.recompute!r}")
    if not stage.shards_optimizer_state:
        return
    if config.check_replicas:
        raise ConfigError(
            f"--check-replicas compares the replicas' masters, and --zero {config.zero} gives "
            "each replica a different part of them (use --zero 0 to check replicas)")
    # With --cp the context shards of a replica share its optimizer too: dp x cp shards.
    shards, over = dp * config.cp, f"--dp {dp}" + (f" x --cp {config.cp}" if config.cp > 1 else "")
    for index, sizes in enumerate(zero_unit_sizes(config)):
        if max(sizes) < shards:
            raise ConfigError(
                f"--zero {config.zero} over {over}: pipeline stage {index}'s largest layer "
                f"has {max(sizes)} parameters, so some ranks would hold none of that stage "
                f"(use {'--dp x --cp' if config.cp > 1 else '--dp'} {max(sizes)} or fewer, a "
                "wider model, or --zero 0)")


def _check_wire(config: "TrainConfig") -> None:
    """The fp8 wire (minimp/precision/wire.py, minimp/distributed/ring_fp8.py): what it is not
    built for, one line each, before any work."""
    fp8 = [name for name in ("grad_comm_dtype", "param_gather_dtype")
           if getattr(config, name) == "fp8"]
    if config.param_gather_dtype == "fp8" and config.zero != 3:
        raise ConfigError(f"--param-gather-dtype fp8 needs --zero 3 (only stage 3 gathers the "
                          f"parameters; --zero {config.zero} all-gathers updated compute copies)")
    device = config.device or os.environ.get(DEVICE_ENVIRONMENT_VARIABLE, "").strip().lower()
    if fp8 and device == "gpu":
        raise ConfigError(f"{flag(fp8[0])} fp8 quantizes NumPy arrays (ml_dtypes casts); use "
                          f"--device cpu")


def _check_distinct_files(config: "TrainConfig") -> None:
    """Every file the run writes has a path of its own, and none is the checkpoint it resumes
    from (except --save, which may continue a checkpoint in place): one would overwrite another."""
    files = [(flag(name), os.path.realpath(getattr(config, name)))
             for name in ("resume", "save", "metrics", "timeline", "plot") if getattr(config, name)]
    for index, (one, path) in enumerate(files):
        for other, other_path in files[index + 1 :]:
            if path == other_path and {one, other} != {"--resume", "--save"}:
                raise ConfigError(f"{other} {getattr(config, other[2:])} is also {one}'s file, and "
                                  "one would overwrite the other: give each its own path")


def _check_layout(config: "TrainConfig", world_size: int) -> None:
    """The layout's own checks, --tp first: a grid larger than the job is said as such, and so
    is a --cp x --tp that does not divide it (a --context cut for it would not make it run)."""
    if config.tp > world_size:  # said as such, before what it would cut
        raise ConfigError(f"--tp {config.tp} is more than the {world_size} ranks of this job "
                          f"(start at least {config.tp} ranks with mpirun -n)")
    _check_tensor_parallel(config)
    if world_size % (config.cp * config.tp):  # said as such, before the chunks --cp would cut
        _check_grid(config, world_size)
    _check_context_parallel(config)
    _check_grid(config, world_size)
    _check_schedule(config)


def _check_tensor_parallel(config: "TrainConfig") -> None:
    """--tp cuts whole heads (GPT) or hidden layers in pairs (MLP); --sequence-parallel needs
    --tp, a sequence, and a context the ranks share equally."""
    if not isinstance(config.sequence_parallel, bool):
        raise ConfigError(
            f"--sequence-parallel is a switch (True or False), got {config.sequence_parallel!r}")
    tp = config.tp
    if config.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel ranks: "
                          "it needs --tp 2 or more")
    if tp == 1:
        return
    if config.model == "gpt":
        if config.heads % tp:
            raise ConfigError(
                f"--tp {tp} splits the attention heads across ranks, and --heads {config.heads} "
                f"does not divide by {tp} (use --heads divisible by --tp)")
        if config.sequence_parallel and config.context % tp:
            raise ConfigError(f"--sequence-parallel gives each of the --tp {tp} ranks an equal "
                              f"slice of the sequence, and --context {config.context} does not "
                              f"divide by {tp} (use a multiple of --tp)")
        return
    if config.sequence_parallel:
        raise ConfigError(
            "--sequence-parallel splits a sequence: it needs the GPT (--dataset shakespeare)")
    if config.layers % 2:
        raise ConfigError(
            f"--tp {tp} pairs the MLP's hidden layers (column-parallel, then row-parallel), and "
            f"--layers {config.layers} is odd (use an even --layers)")
    if config.hidden % tp:
        raise ConfigError(f"--tp {tp} splits each hidden layer's {config.hidden} features, which "
                          f"do not divide by {tp} (use --hidden divisible by --tp)")


def _check_context_parallel(config: "TrainConfig") -> None:
    """--cp splits the GPT's sequence: into 2N chunks for the ring, into N contiguous pieces of
    H/(tp N) heads each for Ulysses (the heads a tensor-parallel rank holds, over the cp ranks);
    with --sequence-parallel each context rank's T/N positions split again over the --tp ranks;
    no dropout (its masks are drawn per position held). It composes with everything else: --tp,
    --pp (every schedule), --zero, every precision, --recompute, overlap and micro-batches."""
    cp = config.cp
    if cp == 1:
        return
    if config.model != "gpt":
        raise ConfigError(f"--cp {cp} splits a sequence: it needs the GPT (--dataset shakespeare)")
    if config.cp_mode == "ulysses":
        if config.cp_layout != "contiguous":
            raise ConfigError(f"--cp-mode ulysses takes --cp-layout contiguous, got "
                              f"{config.cp_layout} (every rank attends the whole sequence of its "
                              "heads, so there is no imbalance to zig-zag away)")
        try:  # the heads a tensor-parallel rank holds (--tp divides them: checked before)
            check_ulysses(config.heads // config.tp, config.context, cp)
        except ValueError as error:
            raise ConfigError(f"--cp-mode {error}") from None
    elif config.context % (2 * cp):
        raise ConfigError(
            f"--cp {cp} cuts the sequence into 2N = {2 * cp} chunks (the ring computes in chunks "
            f"with either --cp-layout), and --context {config.context} does not divide by "
            f"{2 * cp} (use a multiple of {2 * cp})")
    if config.sequence_parallel and config.context // cp % config.tp:
        raise ConfigError(
            f"--sequence-parallel gives each of the --tp {config.tp} ranks an equal slice of its "
            f"context rank's {config.context // cp} positions (--context {config.context} / --cp "
            f"{cp}), which do not divide by {config.tp} (use a --context that is a multiple of "
            f"{math.lcm(cp * config.tp, 2 * cp if config.cp_mode == 'ring' else cp)})")
    if config.dropout:
        raise ConfigError(f"--cp {cp} with --dropout {config.dropout:g}: dropout masks are drawn "
                          "per position a rank holds, not per global position (use --dropout 0)")


def _check_grid(config: "TrainConfig", world_size: int) -> None:
    """--dp x --tp x --pp must tile the job's ranks, and the model must have a layer per stage."""
    if config.pp > weighted_layers(config):
        what = "embeddings, blocks and head" if config.model == "gpt" else "hidden + output"
        if config.model == "mlp" and config.tp > 1:
            what = "hidden pairs + output: --tp keeps each pair on one stage"
        raise ConfigError(f"--pp {config.pp} needs at least {config.pp} layers with weights, the "
                          f"model has {weighted_layers(config)} ({what}; use --layers)")
    model_parallel = config.pp * config.tp * config.cp
    if world_size % model_parallel:
        what = f"--pp {config.pp}" if config.tp == 1 else f"--tp {config.tp} x --pp {config.pp}"
        if config.cp > 1:
            what = f"--cp {config.cp} x --tp {config.tp} x --pp {config.pp}"
        raise ConfigError(f"{what} does not divide the {world_size} ranks of this job (start a "
                          f"multiple of {model_parallel} ranks with mpirun -n)")
    dp = config.data_parallel_size(world_size)
    if dp * model_parallel != world_size:
        raise ConfigError(
            f"--dp {dp} does not match the {world_size} ranks of this job (use --dp "
            f"{world_size // model_parallel}, or start {dp * model_parallel} ranks with mpirun -n)")


def _check_schedule(config: "TrainConfig") -> None:
    """The schedule exists for these sizes, the layers cut into --pp x --virtual-stages chunks,
    every message has a tag MPI guarantees (up to 32767), and zb-h1's split backward meets no
    recomputed block."""
    problem = schedule_problem(config.schedule, config.pp, config.micro_batches,
                               config.virtual_stages)
    if problem:
        raise ConfigError(problem)
    chunks = config.pp * config.virtual_stages
    if chunks > weighted_layers(config):
        raise ConfigError(
            f"--pp {config.pp} x --virtual-stages {config.virtual_stages} needs {chunks} layers "
            f"with weights, the model has {weighted_layers(config)} (use --layers)")
    if config.pp > 1 and FIRST_TAG + 2 * config.virtual_stages * config.micro_batches > 32767:
        raise ConfigError(
            f"--micro-batches {config.micro_batches} x --virtual-stages {config.virtual_stages} "
            "needs more message tags than MPI guarantees (32767): use fewer micro-batches")
    if config.schedule == "zb-h1" and config.recompute:
        raise ConfigError(
            "--schedule zb-h1 does not work with --recompute: a recomputed block's backward "
            "computes its weights' gradients together with its input's, so they cannot be split "
            "into B and W (use --schedule 1f1b with --recompute)")
