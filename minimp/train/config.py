"""Training configuration: one dataclass, each field a flag of the command line (cli.py builds it).

Fields whose default depends on the dataset are None in the dataclass and filled from
DATASET_DEFAULTS when the config is made: the digits get the small MLP's settings, shakespeare
gets nanoGPT's CPU configuration of its shakespeare_char example. `--help` lists both; rank 0
prints at start what runs and the flags that differ from the dataset's defaults. The checks live
in checks.py.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minimp.checkpoints.errors import ConfigError
from minimp.parallel.apply import Parallelism
from minimp.parallel.pipeline.schedules import CHOICES as SCHEDULE_CHOICES
from minimp.precision.casting import ACTIVATION_DTYPES, BFLOAT16
from minimp.precision.scaler import positive_scale
from minimp.train.checks import FP8_RECIPES, MASTER_WEIGHTS, flag, validate

# The settings that differ by dataset. shakespeare: nanoGPT's README command for a CPU
# (`--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
# --lr_decay_iters=2000 --dropout=0.0 --eval_iters=20`) on top of config/train_shakespeare_char.py
# (lr 1e-3 to 1e-4, 100 warmup iterations, beta2 0.99, eval every 250) and train.py's defaults
# (AdamW, weight decay 0.1, gradient clipping at 1.0).
DATASET_DEFAULTS = {
    "digits": dict(
        model="mlp", layers=4, hidden=128, heads=0, context=0, batch_size=64, steps=500,
        lr=1e-3, optimizer="adam", beta2=0.999, weight_decay=0.0,
        max_grad_norm=0.0, warmup=0, lr_schedule="constant", eval_every=0, eval_batches=0,
        dropout=0.0, log_every=50,
    ),  # fmt: skip
    "shakespeare": dict(
        model="gpt", layers=4, hidden=128, heads=4, context=64, batch_size=12, steps=2000,
        lr=1e-3, optimizer="adamw", beta2=0.99, weight_decay=0.1,
        max_grad_norm=1.0, warmup=100, lr_schedule="cosine", eval_every=250, eval_batches=20,
        dropout=0.0, log_every=50,
    ),  # fmt: skip
}


def _flag(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def _by_dataset(help: str, **extra: Any) -> Any:
    """A flag whose default comes from DATASET_DEFAULTS."""
    return field(default=None, metadata={"help": help, "by_dataset": True, **extra})


@dataclass
class TrainConfig:
    """The training command's configuration: one field per flag of `python -m minimp.train`
    (`--batch-size` sets batch_size), parsed by minimp.train.parse_config. Each field's meaning
    is its flag's `--help` line, kept once, in the field's metadata["help"]; a default of None
    stands for one that depends on the dataset or on another flag (`--help` says which)."""

    dataset: str = _flag("digits", "dataset shipped with minimp", choices=tuple(DATASET_DEFAULTS))
    model: str = _by_dataset("mlp (digits) or gpt (shakespeare)", choices=("mlp", "gpt"))
    precision: str = _flag(
        "fp16", "activation dtype; masters are fp32 (but see --master-weights). fp8: bf16 "
        "activations, and every Linear multiplies fp8 inputs (E4M3 forward, E5M2 backward, a "
        "scale per tensor). nvfp4: bf16 activations, and the GPT's Linears but those of its last "
        "blocks (15 percent, rounded up: nanoGPT's last one) multiply NVFP4 inputs (E2M1 "
        "values, E4M3 scales per 16, a float32 scale per tensor; "
        "stochastic rounding of gradients; a Hadamard transform in the weight gradient)",
        choices=("fp32", "fp16", "bf16", "fp8", "nvfp4"))
    fp8_recipe: str = _flag(None, "fp8 scaling: delayed (from the largest amax of the last "
                            "--fp8-amax-history steps), current (from each tensor's own amax) or "
                            "none (scale 1), one scale per tensor; or a scale per group along "
                            "each GEMM's K: rowwise (per row), blockwise (DeepSeek-V3's 1x128 "
                            "and 128x128, E4M3 everywhere, 14-bit sums promoted every 128), "
                            "mxfp8 (E8M0 per 32, OCP MX floor rule), mxfp8-round-up (NVIDIA's "
                            "rule) (default: delayed with --precision fp8)",
                            choices=FP8_RECIPES)
    fp8_amax_history: int = _flag(
        None, "steps of amax history delayed scaling keeps (default: 16 with --fp8-recipe delayed)")
    fp8_margin: int = _flag(
        None, "delayed scaling aims the amax at fp8's max / 2^margin (default: 0, as TE's)")
    # --master-weights and --stochastic-rounding (issue 41; checks.py's _check_master_weights)
    master_weights: str = _flag(
        "fp32", "fp32: the optimizer updates float32 masters and rounds them into the compute "
        "copies; none (with --precision bf16): the weights live in bf16 only, each update is "
        "computed in float32 and rounded back (optimizer state stays float32)",
        choices=MASTER_WEIGHTS)
    stochastic_rounding: bool = _flag(
        False, "with --master-weights none: round each updated weight into bf16 stochastically "
        "(random bits from --seed, the step and the parameter), so updates below half a bf16 ulp "
        "survive on average instead of rounding away")
    loss_scale: str = _flag(
        "auto", "'dynamic', 'none' or a number; auto = dynamic for fp16, none otherwise")
    loss_scale_growth_interval: int = _flag(2000, "clean steps before the dynamic scale doubles")
    steps: int = _by_dataset("total optimizer steps (numbered from 1; a resume continues to it)")
    batch_size: int = _by_dataset("global batch size (samples per optimizer step, over all ranks)")
    micro_batches: int = _flag(
        1, "split each batch into this many micro-batches (gradient accumulation)")
    lr: float = _by_dataset("peak learning rate")
    lr_schedule: str = _by_dataset("constant, or cosine: linear warmup, cosine decay to --min-lr",
                                   choices=("constant", "cosine"))
    warmup: int = _by_dataset("warmup steps of the cosine schedule")
    min_lr: float = _flag(None, "learning rate at the end of the cosine decay (default: --lr / 10)")
    lr_decay_steps: int = _flag(
        0, "steps of the cosine decay (0 = --steps, or the checkpoint's when resuming)")
    optimizer: str = _by_dataset(
        "optimizer updating the fp32 masters", choices=("sgd", "adam", "adamw"))
    momentum: float = _flag(0.9, "SGD momentum")
    beta2: float = _by_dataset("Adam's second-moment decay")
    weight_decay: float = _by_dataset(
        "weight decay (L2 for sgd/adam, decoupled for adamw; the GPT decays 2-D weights only)")
    max_grad_norm: float = _by_dataset("clip the unscaled gradient norm to this (0 = no clipping)")
    seed: int = _flag(0, "seed of the initial weights, the batch order and dropout")
    layers: int = _by_dataset("hidden layers (MLP: Linear + ReLU each) or transformer blocks")
    hidden: int = _by_dataset("width of every hidden layer (the GPT's residual stream)")
    heads: int = _by_dataset("attention heads (GPT; must divide --hidden)")
    context: int = _by_dataset("characters per sample (GPT)")
    dropout: float = _by_dataset("dropout probability (GPT)")
    experts: int = _flag(0, "E: each block's MLP becomes a mixture of E expert MLPs, top-k routed "
                         "per sample (GPT; 0 = the dense MLP)")
    top_k: int = _flag(2, "with --experts: experts each token is sent to, gates renormalised")
    capacity_factor: float = _flag(
        0.0, "with --experts: each expert admits ceil(F x context x top-k / experts) (token, "
        "choice) pairs per sample, the rest pass through the residual (0 = dropless)")
    aux_loss_coef: float = _flag(
        0.01, "with --experts: weight of the load-balancing loss added to the training loss")
    router_z_loss_coef: float = _flag(
        0.0, "with --experts: weight of the router z-loss added to the training loss")
    expert_hidden: int = _flag(
        0, "with --experts: each expert's width (0 = the dense MLP's 4 x --hidden)")
    ep: int = _flag(
        1, "with --experts: expert parallelism, the experts split over this many data-parallel "
        "ranks (E/ep each; divides --dp)")
    eval_every: int = _by_dataset("validation loss every this many steps (GPT; 0 = at the end)")
    eval_batches: int = _by_dataset("random validation batches per evaluation during training")
    device: str = _flag(
        "", "cpu or gpu (default: $MINIMP_DEVICE, else cpu)", choices=("", "cpu", "gpu"))
    save: str = _flag("", "write a checkpoint (.npz) here at the end")
    save_every: int = _flag(0, "also save --save every this many steps (0 = only at the end)")
    resume: str = _flag("", "continue from this checkpoint (.npz)")
    metrics: str = _flag("", "write one JSON object per step to this .jsonl file")
    plot: str = _flag("", "draw loss and loss scale to this image (needs matplotlib)")
    force: bool = _flag(False, "let --save, --metrics, --timeline, --plot replace a file that "
                        "holds another kind of output (never --resume's checkpoint)")
    log_every: int = _by_dataset("print a progress line every this many steps")
    threads: int = _flag(
        0, "BLAS threads per rank; 0 = one per 2^30 multiply-adds of the step's largest matrix "
        "product, at least 1, at most this machine's cores / its ranks (so 1 for every model the "
        "README runs: a second thread spins, and loses badly where the cores are shared)")
    dp: int = _flag(0, "data-parallel replicas (0 = the job's ranks / (--tp x --pp))")
    pp: int = _flag(1, "pipeline stages: the layers are split into this many contiguous stages")
    tp: int = _flag(1, "tensor-parallel ranks: every block's Linears are cut across them (GPT: "
                    "heads and the MLP's features; MLP: hidden layers in column -> row pairs)")
    sequence_parallel: bool = _flag(
        False, "with --tp: the GPT's LayerNorms, residual adds and dropouts run on 1/tp of the "
        "sequence (the all-reduces become reduce-scatters and all-gathers)")
    cp: int = _flag(1, "context-parallel ranks: every sample's sequence is split across them, "
                    "attention runs as ring attention over them (GPT)")
    cp_layout: str = _flag("zigzag", "with --cp: which positions each rank holds: zigzag (chunks r "
                           "and 2N-1-r of 2N, equal causal work) or contiguous (the r-th of N "
                           "pieces)", choices=("zigzag", "contiguous"))
    cp_mode: str = _flag("ring", "with --cp: ring (key/value blocks travel a ring) or ulysses (an "
                         "all-to-all to head shards; with --cp-layout contiguous)",
                         choices=("ring", "ulysses"))
    schedule: str = _flag("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved (1F1B over "
                          "--virtual-stages chunks per rank) or zb-h1 (backward split into input "
                          "and weight gradients, Qi et al. 2023)", choices=tuple(SCHEDULE_CHOICES))
    virtual_stages: int = _flag(
        1, "with --schedule interleaved: chunks of layers per pipeline rank (the model is cut "
        "into --pp x this many; rank r holds chunks r, r + pp, ...)")
    timeline: str = _flag("", "write each stage's forward/backward times to this .json file")
    zero: int = _flag(
        0, "ZeRO stage: 0 replicates everything on every replica; 1 shards the optimizer state "
        "and fp32 masters over the replicas, 2 the gradients too, 3 the parameters too")
    recompute: bool = _flag(
        False, "keep only each block's input for backward and rerun its forward there")
    bucket_mb: float = _flag(
        25.0, "gradient bucket size in MiB for the all-reduce of --zero 0 (ZeRO moves layers)")
    overlap: bool = _flag(
        None, "all-reduce each gradient bucket (--zero 0) or reduce-scatter each layer (--zero "
        "1-3) during backward, as soon as its gradients are final (same bits as --no-overlap)")
    straggler_barrier: bool = _flag(
        False, "diagnostic: a barrier of the replicas between backward and the gradients' wait, "
        "timed apart as straggler_seconds (overlap cannot hide a slower replica)")
    grad_comm_dtype: str = _flag(
        "fp32", "dtype of gradients on the wire; fp8: E4M3 values and a float32 scale per chunk, "
        "requantized at every hop of the ring (precision/wire.py)",
        choices=("fp32", "fp16", "bf16", "fp8"))
    param_gather_dtype: str = _flag(
        "compute", "dtype of ZeRO-3's parameter all-gathers: the compute dtype, or fp8 (E4M3 and "
        "a float32 scale per chunk, ZeRO++'s qwZ; needs --zero 3)", choices=("compute", "fp8"))
    grad_average: str = _flag("before", "divide by the number of replicas before or after the "
                              "all-reduce", choices=("before", "after"))
    check_replicas: int = _flag(
        0, "every this many steps, compare the replicas' weights (0 = never)")
    max_consecutive_skips: int = _flag(
        100, "stop with an error after this many skipped steps in a row (0 = never)")
    timeout: float = _flag(
        600.0, "abort the job when one message waits longer than this many seconds (0 = never; "
        "at least 1)")
    inject_overflow: str = _flag(
        "", "STEP:RANK: make that rank's gradients non-finite at that step")
    inject_fault: str = _flag(
        "", "STEP:RANK: raise an error on that rank at that step (see a failure)")

    def __post_init__(self) -> None:
        """Fill the dataset's defaults into the fields left unset."""
        if self.dataset not in DATASET_DEFAULTS:
            raise ConfigError(
                f"unknown dataset {self.dataset!r}: use one of {', '.join(DATASET_DEFAULTS)}")
        for name, value in DATASET_DEFAULTS[self.dataset].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.overlap is None:  # every ZeRO stage overlaps too (issue 17)
            self.overlap = True
        if self.min_lr is None:  # nanoGPT's rule: the decay ends at a tenth of the peak
            self.min_lr = self.lr / 10
        if self.precision == "fp8" and self.fp8_recipe is None:
            self.fp8_recipe = "delayed"
        if self.precision == "fp8" and self.fp8_recipe == "delayed":
            self.fp8_amax_history = 16 if self.fp8_amax_history is None else self.fp8_amax_history
            self.fp8_margin = 0 if self.fp8_margin is None else self.fp8_margin

    def data_parallel_size(self, world_size: int) -> int:
        """The resolved --dp: the job's ranks divided by --tp x --cp x --pp unless given."""
        return self.dp or max(1, world_size // max(self.pp * self.tp * self.cp, 1))

    def activation_dtype(self) -> np.dtype:
        """The dtype activations are stored in: --precision's, and bf16 for fp8 and nvfp4 runs
        (fp8 and NVFP4 are only what the Linears multiply)."""
        low = ("fp8", "nvfp4")  # (nvfp4: checks.py's _check_nvfp4)
        return BFLOAT16 if self.precision in low else ACTIVATION_DTYPES[self.precision]

    def validate(self, world_size: int = 1) -> None:
        """Raise ConfigError naming the flag and the fix for the first value that cannot work
        (checks.py)."""
        validate(self, world_size)

    def parallelism(self) -> Parallelism:
        """The strategies' settings these flags give (minimp/parallel/apply.py): the fields of
        the same names."""
        names = [setting.name for setting in dataclasses.fields(Parallelism)]
        return Parallelism(**{name: getattr(self, name) for name in names})

    def loss_scale_kind(self) -> tuple[str, float | None]:
        """('dynamic'|'none'|'static', value) after resolving 'auto' by precision."""
        text = self.loss_scale.strip().lower()
        if text == "auto":
            return ("dynamic", None) if self.precision == "fp16" else ("none", None)
        if text in ("dynamic", "none"):
            return text, None
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"--loss-scale must be 'dynamic', 'none' or a number, got "
                              f"{self.loss_scale!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(
                f"--loss-scale must be a positive finite number, got {self.loss_scale}")
        try:
            positive_scale("--loss-scale", value)  # the scaler's own rule: one in float32's range
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return "static", value

    def injection(self, name: str, world_size: int, after: int = 0) -> tuple[int, int] | None:
        """(step, rank) from STEP:RANK of --inject-overflow or --inject-fault (name:
        "inject_overflow" or "inject_fault"), or None; `after`: the step a resumed run starts
        after (an injection that can never fire is an error, not silence)."""
        text = getattr(self, name)
        if not text:
            return None
        try:
            step, rank = (int(part) for part in text.split(":"))
        except ValueError:
            raise ConfigError(f"{flag(name)} takes STEP:RANK (e.g. 5:0), got {text!r}") from None
        if not 0 <= rank < world_size:
            raise ConfigError(f"{flag(name)} {text}: the rank must lie in 0..{world_size - 1}")
        if not after < step <= self.steps:
            raise ConfigError(f"{flag(name)} {text} can never fire: this run takes steps "
                              f"{after + 1}..{self.steps}")
        return step, rank

    def describe(self, world_size: int = 1) -> str:
        """The resolved configuration, as rank 0 prints it at start: a headline (what trains, in
        what precision, how long, on how many ranks), then every flag whose resolved value
        differs from the dataset's defaults, written as the flags that repeat the run."""
        kind, value = self.loss_scale_kind()
        scaling = {"dynamic": "a dynamic loss scale", "none": "no loss scaling"}.get(kind)
        if value is not None:
            scaling = f"a static loss scale of {value:g}"
        if self.model == "gpt":
            model = (f"a GPT of {self.layers} blocks x {self.hidden} ({self.heads} heads, "
                     f"context {self.context})")
        else:
            model = f"an MLP of {self.layers} hidden layers x {self.hidden}"
        ranks = f"{world_size} rank" + ("s" if world_size > 1 else "")
        headline = (f"{self.dataset}: {model}, {self.precision} with {scaling}, {self.optimizer} "
                    f"lr {self.lr:g}, batch {self.batch_size}, {self.steps} steps, {ranks}")
        changed = self.changed_flags()
        if not changed:
            return f"{headline}\n  every flag at the {self.dataset} defaults (--help lists them)"
        return f"{headline}\n  differs from the {self.dataset} defaults: {' '.join(changed)}"

    def changed_flags(self) -> list[str]:
        """`--name value` for each field whose resolved value differs from what the dataset's
        defaults resolve to (a switch alone, or --no-overlap), in the fields' order. A field
        derived from another (--min-lr from --lr, fp8's settings from --precision) is compared
        with what that field's value derives, so the line lists what was chosen, not its echoes."""
        defaults = TrainConfig(dataset=self.dataset)
        derived = TrainConfig(dataset=self.dataset, lr=self.lr, precision=self.precision)
        shown = []
        for setting in dataclasses.fields(self):
            value = getattr(self, setting.name)
            base = defaults if setting.name in ("lr", "precision") else derived
            if value == getattr(base, setting.name):
                continue
            if isinstance(value, bool):
                shown.append(flag(setting.name) if value else f"--no-{flag(setting.name)[2:]}")
            elif isinstance(value, float):
                shown.append(f"{flag(setting.name)} {value:g}")
            else:
                shown.append(f"{flag(setting.name)} {value}")
        return shown
