"""`python -m minimp.plan`: the dp x cp x tp x pp, ZeRO and recompute layouts that fit, best first.

    python -m minimp.plan --model 145.6B --cluster selene --gpus 1536 --global-batch 2304
    python -m minimp.plan --model 7B-128k --gpus 64 --global-batch 16 --top 5
    python -m minimp.plan --model mixtral-8x7b --gpus 64 --global-batch 256 --top 3
    python -m minimp.plan --parameters 7e9 --context 4096 --vocab 32000 --cluster selene \\
        --gpus 64 --global-batch 512 --micro-batch-size 1,2 --json
    python -m minimp.plan --compare-narayanan

What it assumes, where each piece is worked out (minimp/plan/):
- Memory per GPU (memory.py): minimp's own model states, by ZeRO stage over dp
  (parallel/zero/formulas.py: 16-bit parameters, float32 gradient accumulators, masters and Adam's
  two slots, all-reduce buffers, the 16-bit gradients alive inside a step; Rajbhandari et al.
  2020), parameters split over tp as Megatron-LM splits them (Shoeybi et al. 2019) and over pp by
  whole blocks; activations per block from Korthikanti et al. 2022 (sbh (10 + 24/t + 5as/(ht))
  with tp, sbh/t (34 + 5as/h) with sequence parallelism, 2 sbh with full recomputation) plus
  minimp's float32 LayerNorm statistics, times the micro-batches 1F1B keeps in flight (stage 0:
  P, or M if fewer; Narayanan et al. 2021). Not counted: the framework's own memory,
  fragmentation, workspace of the matrix products.
- Step time (steptime.py): FLOPs from Narayanan et al. 2021's Eq. 3 (96 B s l h^2 (1 + s/(6h) +
  V/(16 l h)) with recomputation) at a fixed fraction of peak for every matrix shape; tensor-
  parallel all-reduces (4 per block and micro-batch, 6 with recomputation) on the intra-node
  network; the pipeline's bubble (P - 1)/(M + P - 1) (Huang et al. 2019) or the schedule
  simulator (--simulate); ring collectives (Thakur et al. 2005) for the data-parallel gradients
  and ZeRO, inter-node when the dp x cp group spans nodes; nothing overlaps compute but the
  ring attention's hops, each hidden behind one ring step's attention as far as it is shorter.
- Context parallelism (memory.py, steptime.py): each rank holds s/cp positions; the ring keeps a
  log-sum-exp instead of attention's s x s probabilities, plus its in-flight key/value buffers,
  and sends ring.py's `ring_bytes`; Ulysses keeps the probabilities of a/(t cp) heads and sends
  ulysses.py's `ulysses_bytes` in 8 all-to-alls a block, not overlapped.
- A mixture of experts (--experts, --top-k, --expert-hidden; memory.py, steptime.py): routing
  assumed dropless and balanced; tp = 1 (minimp refuses --experts with --tp); each of ep replicas
  holds E/ep experts, their states sharded over the (dp/ep) x cp replicas holding the same ones;
  the expert FLOPs are K expert MLPs a token; per block the counts and 4 all-to-alls of a rank's
  K rows a token, as parallel/expert/dispatch.py's `dispatch_bytes` counts them. --ep auto
  searches every ep that divides the experts and dp.
- Feasibility (search.py): tp divides the heads and the GPUs per node, pp divides the layers,
  2 cp (ring) or cp (Ulysses) divides the context, cp divides the heads per tp rank (Ulysses),
  dp x micro-batch size divides the batch, memory fits. --cp auto (the default) searches cp > 1
  only when nothing with cp = 1 fits.
- Clusters (presets.py): Selene as the paper describes it, 0.6 of its 312 TFLOP/s; this machine
  from its shipped machine model (machinemodel.py) and a measured FLOP rate.
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import NoReturn

from minimp.backend import available_memory
from minimp.measure.costmodel import Network
from minimp.plan.inputs import CP_MODES, MAX_PARAMETERS, MAX_SIMULATED_MICRO_BATCHES
from minimp.plan.inputs import OPTIMIZER_SLOTS, PRECISION_BYTES, PRICED_SCHEDULES, Cluster, Job
from minimp.plan.inputs import GRAD_COMM_DTYPES, ModelShape, wire_fields
from minimp.plan.inputs import PlanError, check_inputs, shape_for_parameters
from minimp.plan.links import AlphaBeta
from minimp.plan.narayanan import comparison_table
from minimp.plan.presets import GIB, MODELS, selene, this_machine
from minimp.plan.search import Choices, Plan, best_plans, powers_of_two, resimulated

PROGRAM = "minimp.plan"
CHOICE = {"any": (False, True), "on": (True,), "off": (False,)}
# ModelShape's whole-number fields, each given by the flag of its name
SHAPE_FLAGS = {
    "layers": "transformer blocks", "hidden": "width of the residual stream",
    "heads": "attention heads", "context": "tokens per sample", "vocab": "vocabulary size"}
# ModelShape's mixture-of-experts fields, each given by its flag (--top-k for top_k), optional
MIXTURE_FLAGS = {
    "experts": "experts per block (0: the dense MLP)", "top_k": "experts per token (default 2)",
    "expert_hidden": "each expert's width (default 0: 4 x hidden)"}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line, `minimp.plan: error: ...`, like every other error of
    the command (argparse's own would print the whole usage first); exit status 2 all the same."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROGRAM}: error: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    """The command line, one flag per input (the module docstring says what each part assumes)."""
    description = __doc__.splitlines()[0].split(": ", 1)[1]
    p = _Parser(prog=f"python -m {PROGRAM}", description=description,
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--compare-narayanan", action="store_true", help="print the planner against "
                   "Narayanan et al. 2021's Table 1 (docs/planner.md) and stop")  # fmt: skip
    model = p.add_argument_group("model (a named one, --parameters, or every shape flag)")
    model.add_argument("--model", choices=sorted(MODELS), help="a named GPT shape")
    model.add_argument("--parameters", type=float, help="parameters; shape from GPT-3's ratios")
    for name, text in SHAPE_FLAGS.items():
        model.add_argument(f"--{name}", type=int, help=text)
    model.add_argument("--dropout", choices=("on", "off"), help="dropout masks kept (default on)")
    for name, text in MIXTURE_FLAGS.items():
        model.add_argument(f"--{name.replace('_', '-')}", type=int, help=text)
    cluster = p.add_argument_group("cluster (a preset, each flag overriding it)")
    cluster.add_argument("--cluster", choices=("selene", "this-machine"), default="selene")
    cluster.add_argument("--gpus", type=int, help="devices (ranks) in all (required)")
    cluster.add_argument("--gpus-per-node", type=int, help="devices per node")
    cluster.add_argument("--memory-gb", type=float, help="GiB of memory per device")
    cluster.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device")
    cluster.add_argument("--achievable", type=float, help="fraction of peak reached")
    cluster.add_argument("--cores", type=int, help="this-machine: CPU cores the ranks share "
                         "(default: this machine's)")  # fmt: skip
    for where in ("intra", "inter"):
        cluster.add_argument(f"--{where}-alpha-us", type=float, help=f"{where}-node latency (us)")
        cluster.add_argument(f"--{where}-gbs", type=float, help=f"{where}-node GB/s (1 / beta)")
    job = p.add_argument_group("job")
    job.add_argument("--global-batch", type=int, help="samples per step (required)")
    job.add_argument("--micro-batch-size", default="1", help="rows per micro-batch (list: 1,2,4)")
    job.add_argument("--precision", default="bf16", choices=PRECISION_BYTES)
    job.add_argument("--optimizer", default="adam", choices=OPTIMIZER_SLOTS)
    job.add_argument("--grad-comm-dtype", default="fp32", choices=GRAD_COMM_DTYPES)
    job.add_argument("--schedule", default="1f1b", choices=PRICED_SCHEDULES)
    job.add_argument("--vocabulary-parallel", default="on", choices=("on", "off"),
                     help="on: the token embedding and head cut over tp (Megatron-LM); off: "
                     "whole on every rank (minimp)")  # fmt: skip
    search = p.add_argument_group("search")
    search.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider")
    search.add_argument("--recompute", default="any", choices=sorted(CHOICE))
    search.add_argument("--sequence-parallel", default="any", choices=sorted(CHOICE))
    search.add_argument("--cp", default="auto", help="context-parallel sizes to consider: powers "
                        "of 2 (list: 1,2,4), any (every one the GPUs allow), or auto (1, and the "
                        "others only when nothing with 1 fits)")  # fmt: skip
    search.add_argument("--cp-mode", default="any", choices=("any", *CP_MODES),
                        help="how cp > 1 splits attention: a ring of key/value blocks or Ulysses' "
                        "all-to-alls")  # fmt: skip
    search.add_argument("--ep", default="auto", help="expert-parallel sizes to consider, with "
                        "--experts: sizes dividing the experts (list: 1,2,4,8) or auto (every "
                        "one); each kept where it divides dp")  # fmt: skip
    search.add_argument("--top", type=int, default=10, help="rows to print")
    search.add_argument("--simulate", action="store_true", help="time the top rows' pipelines "
                        "with the schedule simulator")  # fmt: skip
    search.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _integers(text: str, flag: str) -> tuple[int, ...]:
    """The comma-separated integers of a flag, each once (a repeat would list its layouts twice)."""
    try:
        return tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        raise PlanError(f"{flag} takes integers separated by commas, got {text!r}") from None


def context_sizes(text: str, gpus: int) -> tuple[int, ...] | None:
    """--cp's sizes: None for auto, every power of 2 up to the GPUs for any, or the list given,
    each a power of 2 (zig-zag's chunks and the search's grid; see search.py) that divides the
    GPUs."""
    if text == "auto":
        return None
    if text == "any":
        return powers_of_two(gpus)
    sizes = _integers(text, "--cp")
    bad = [size for size in sizes if size < 1 or size & (size - 1) or gpus % size]
    if bad:
        raise PlanError(f"--cp takes powers of 2 (1,2,4,...) that divide --gpus {gpus}, 'any' or "
                        f"'auto', got {bad[0]}")
    return sizes


def expert_sizes(text: str, model: ModelShape) -> tuple[int, ...] | None:
    """--ep's sizes: None for auto, or the list given, each dividing the model's experts."""
    if text == "auto":
        return None
    sizes = _integers(text, "--ep")
    if sizes != (1,) and not model.experts:
        raise PlanError(f"--ep {text} needs a mixture of experts (--experts, or --model "
                        "mixtral-8x7b)")
    bad = [size for size in sizes if size < 1 or model.experts % size]
    if bad:
        raise PlanError(f"--ep takes sizes that divide --experts {model.experts} or 'auto', got "
                        f"{bad[0]}")
    return sizes


def model_from(args: argparse.Namespace) -> ModelShape:
    """The model the flags describe: a name or --parameters, each shape or mixture flag given
    replacing its field; or every shape flag."""
    fields = {name: getattr(args, name) for name in (*SHAPE_FLAGS, *MIXTURE_FLAGS)}
    fields["dropout"] = None if args.dropout is None else args.dropout == "on"
    given = {key: value for key, value in fields.items() if value is not None}
    if args.model and args.parameters is not None:
        raise PlanError(f"--model {args.model} and --parameters {args.parameters:g} each give "
                        "the model: choose one")
    if args.model:
        return replace(MODELS[args.model], **given)
    if args.parameters is not None:
        if not 1 <= args.parameters <= MAX_PARAMETERS:  # also refuses NaN and inf
            raise PlanError(f"--parameters must be between 1 and {MAX_PARAMETERS:g}, got "
                            f"{args.parameters}")
        context, vocab = args.context or 2048, args.vocab or 51200
        return replace(shape_for_parameters(args.parameters, context, vocab), **given)
    missing = [f"--{name}" for name in SHAPE_FLAGS if fields[name] is None]
    if missing:
        raise PlanError(f"name a --model, give --parameters, or give {' '.join(missing)} too")
    return ModelShape(**given)


def cluster_from(args: argparse.Namespace) -> Cluster:
    """The preset, with each flag given replacing its field (for this machine, --peak-tflops is
    one process's measured rate, which the preset shares among the ranks)."""
    if args.gpus is None:
        raise PlanError("--gpus is required (how many devices the job has)")
    memory_bytes = None if args.memory_gb is None else args.memory_gb * GIB
    overrides = {"gpus_per_node": args.gpus_per_node, "memory_bytes": memory_bytes,
                 "achievable": args.achievable}  # fmt: skip
    if args.cluster == "this-machine":
        if args.peak_tflops is None:
            raise PlanError("--cluster this-machine needs --peak-tflops, one process's measured "
                            "rate (the first line of python mpirun_examples/plan_check.py, in "
                            "GFLOP/s)")
        cores = (os.cpu_count() or 1) if args.cores is None else args.cores
        if not args.peak_tflops > 0 or cores < 1:  # `not >`: NaN is refused too
            raise PlanError("--peak-tflops must be positive and --cores at least 1")
        base = this_machine(args.gpus, args.peak_tflops * 1e12, available_memory(), cores)
    else:
        base = selene(args.gpus)
        overrides["peak_flops"] = None if args.peak_tflops is None else args.peak_tflops * 1e12
    for where in ("intra", "inter"):
        alpha, gbs = getattr(args, f"{where}_alpha_us"), getattr(args, f"{where}_gbs")
        if alpha is None and gbs is None:
            continue
        if alpha is None or gbs is None or not (alpha >= 0 and gbs > 0):  # NaN refused too
            raise PlanError(f"--{where}-alpha-us and --{where}-gbs go together (>= 0 and > 0)")
        overrides[where] = AlphaBeta(Network(alpha * 1e-6, 1 / (gbs * 1e9), name=where))
    return replace(base, **{key: value for key, value in overrides.items() if value is not None})


def format_table(plans: list[Plan], cluster: Cluster, experts: bool = False) -> str:
    """The plans as an aligned table: layout, GiB (model states + activations), seconds by part,
    and the context-parallel size and mode last ('-' for none); for a mixture of experts also the
    ep size after dp and the all-to-alls' seconds (ep s) after cp."""
    ep, ep_seconds = (f" {'ep':>3}", f" {'ep s':>8}") if experts else ("", "")
    header = (f"{'#':>3} {'dp':>5}{ep} {'tp':>3} {'pp':>4} {'zero':>4} {'b':>3} {'M':>5} {'rc':>3} "
              f"{'sp':>3} {'GiB':>7} {'states':>7} {'activ':>7} {'step s':>9} {'compute':>9} "
              f"{'tp':>8} {'cp':>8}{ep_seconds} {'bubble':>8} {'dp':>8} {'other':>8} "
              f"{'TFLOP/s':>8} {'context':>10}")
    lines = [header]
    for rank, plan in enumerate(plans, 1):
        layout, memory, time = plan.layout, plan.memory, plan.time
        activations = memory.by_kind["activations"]
        states = memory.total - activations
        context = f"{layout.cp_mode} {layout.cp}" if layout.cp > 1 else "-"
        ep = f" {layout.ep:>3}" if experts else ""
        ep_seconds = f" {time.expert_parallel:>8.3g}" if experts else ""
        lines.append(
            f"{rank:>3} {layout.dp:>5}{ep} {layout.tp:>3} {layout.pp:>4} {layout.zero:>4} "
            f"{layout.micro_batch_size:>3} {layout.micro_batches:>5} "
            f"{'y' if layout.recompute else '-':>3} {'y' if layout.sequence_parallel else '-':>3} "
            f"{memory.total / GIB:>7.2f} {states / GIB:>7.2f} {activations / GIB:>7.2f} "
            f"{time.total:>9.4g} {time.compute:>9.4g} {time.tensor_parallel:>8.3g} "
            f"{time.context_parallel:>8.3g}{ep_seconds} {time.bubble:>8.3g} "
            f"{time.data_parallel + time.zero_in_step:>8.3g} {time.other:>8.3g} "
            f"{plan.tflops_per_device(cluster.gpus):>8.4g} {context:>10}")
    return "\n".join(lines)


def describe(model: ModelShape, cluster: Cluster, job: Job) -> str:
    """Two lines: the model and the job, then the cluster, as the planner resolved them."""
    mixture = (f", {model.experts} experts of {model.expert_width}, top-{model.top_k}"
               if model.experts else "")
    return (
        f"model: {model.layers} blocks of {model.hidden}, {model.heads} heads{mixture}, context "
        f"{model.context}, vocabulary {model.vocab}, dropout {'on' if model.dropout else 'off'} "
        f"({model.parameters():,} parameters); global batch {job.global_batch}, {job.precision}\n"
        f"cluster: {cluster.name}; {cluster.gpus} GPUs, {cluster.gpus_per_node} a node, "
        f"{cluster.memory_bytes / GIB:.1f} GiB and {cluster.flops / 1e12:.4g} TFLOP/s each")


def main(argv: list[str] | None = None) -> int:
    """Parse, check, search, print; a user error is one line and exit status 2."""
    args = parser().parse_args(argv)
    if args.compare_narayanan:
        print(comparison_table())
        return 0
    try:
        if args.global_batch is None:
            raise PlanError("--global-batch is required (samples per optimizer step)")
        if args.top < 1:
            raise PlanError(f"--top must be at least 1, got {args.top}")
        model, cluster = model_from(args), cluster_from(args)
        job = Job(
            args.global_batch, _integers(args.micro_batch_size, "--micro-batch-size"),
            precision=args.precision, optimizer=args.optimizer,
            **wire_fields(args.grad_comm_dtype), schedule=args.schedule,
            vocabulary_parallel=args.vocabulary_parallel == "on")
        zero_stages = _integers(args.zero, "--zero")
        cp_modes = CP_MODES if args.cp_mode == "any" else (args.cp_mode,)
        choices = Choices(zero_stages, CHOICE[args.recompute], CHOICE[args.sequence_parallel],
                          context_sizes(args.cp, cluster.gpus), cp_modes,
                          expert_sizes(args.ep, model))
        if not set(choices.zero_stages) <= {0, 1, 2, 3}:
            raise PlanError(f"--zero takes stages 0-3, got {args.zero}")
        check_inputs(model, cluster, job)
        most = MAX_SIMULATED_MICRO_BATCHES * min(job.micro_batch_sizes)
        if args.simulate and job.global_batch > most:
            raise PlanError(f"--simulate runs every micro-batch of a step, at most "
                            f"{MAX_SIMULATED_MICRO_BATCHES}: use --global-batch {most} or less, "
                            "or leave out --simulate")
        plans = best_plans(model, cluster, job, choices)[: args.top]
    except PlanError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        return 2
    if args.simulate:
        plans = resimulated(model, cluster, job, plans)
    if args.json:
        document = {"model": vars(model), "cluster": cluster.name, "job": vars(job),
                    "plans": [plan.as_dict(cluster.gpus) for plan in plans]}  # fmt: skip
        print(json.dumps(document, indent=1, default=str))
    else:
        print(describe(model, cluster, job))
        print(format_table(plans, cluster, experts=model.experts > 0))
    return 0
