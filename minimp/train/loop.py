"""Training loop of `python -m minimp.train`: build this rank's stage, (resume,) step, log, save.

Every rank builds the whole float32 model from the seed, keeps its share of it
(minimp/parallel/apply.py: tensor, pipeline, recompute, data or ZeRO), and runs the schedule's
actions for its stage each step (with one stage, the schedule is the plain micro-batch loop).
Data-parallel replicas of a stage then average their gradients; every rank of the job takes part in
the one decision to skip an overflowing step.
"""

import math
import time
from typing import Callable

import numpy as np

from minimp import backend, nn
from minimp.checkpoints import checkpoint
from minimp.checkpoints.errors import agree_on_error
from minimp.distributed import world
from minimp.distributed.protocol import Communicator
from minimp.optim import lr_scheduler
from minimp.parallel.apply import replicate
from minimp.parallel.data.data_parallel import DataParallel, shard
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.parallel.topology import Topology
from minimp.precision import mixed_precision_step
from minimp.tensor import Tensor
from minimp.train import progress, saving
from minimp.train.build import build_scaler, build_stage
from minimp.train.config import TrainConfig
from minimp.train.fp8 import Fp8Run, quantizes_linears
from minimp.train.guards import Guards
from minimp.train.meter import Meter
from minimp.train.tasks import TASKS, resume_flags
from minimp.train.threads import ThreadChoice, choose_threads


def train(config: TrainConfig, log: Callable[[str], None] = print, comm: Communicator | None = None,
          interactive: bool = False, threads: ThreadChoice | None = None) -> dict:
    """Run the configured training on this process's rank; returns a dict with history, skipped
    count, the final score (test_accuracy or val_loss), the masters (all stages' on rank 0) and
    the BLAS threads this rank ran with (`threads`, `threads_reason`: minimp/train/threads.py).
    `comm` defaults to the MPI world; `interactive`: show a progress bar instead of lines;
    `threads`: rank_threads' choice when the caller made it already (it printed it)."""
    comm = comm or world()
    chosen = threads or rank_threads(config, comm)
    # Overflow to inf in float16 is expected and handled (skipped steps): no NumPy warning per cast.
    with backend.limit_cpu_threads(chosen.threads), np.errstate(over="ignore", invalid="ignore"):
        run = Run(config, comm, log, interactive, chosen)
        for step in range(run.start_step + 1, config.steps + 1):
            run.step(step)
        return saving.finish(run)


def rank_threads(config: TrainConfig, comm: Communicator) -> ThreadChoice:
    """The BLAS threads this rank runs (threads.py's rule on this machine's cores and ranks)."""
    return choose_threads(config, backend.available_cores(), comm.ranks_on_this_node(), comm.size)


class Run:
    """One rank's share of a training run: its stage of the model, its optimizer, its groups."""

    def __init__(self, config: TrainConfig, comm: Communicator, log: Callable[[str], None],
                 interactive: bool = False, threads: ThreadChoice | None = None):
        """interactive: a person watches this process's terminal (a progress bar, not lines).
        threads: the BLAS threads train() runs it with (the final metrics row says them)."""
        self.started = time.perf_counter()  # the summary's wall time counts the setup too
        self.threads = threads or rank_threads(config, comm)
        self.config, self.comm, self.dp = config, comm, config.data_parallel_size(comm.size)
        self.log = log if comm.rank == 0 else (lambda line: None)
        self.topology = Topology(comm, dp=self.dp, pp=config.pp, tp=config.tp, cp=config.cp,
                                 ep=config.ep)
        if comm.size > 1:
            self.log(self.topology.describe())
        # Everything that can fail for a user's reason, with no message in between: one rank says
        # what failed, every rank stops here.
        agree_on_error(comm, lambda: self._set_up_locally(comm.node_rank_and_size()[0]))
        if config.resume:
            self.log(f"resumed from {config.resume} after step {self.start_step}")
        self.sync = replicate(self.share, self.topology, config.parallelism(), comm)
        self.optimizer = self.sync.optimizer  # ZeRO's sharded one, with --zero
        self.meter = Meter(config, comm, self.topology, self.sync, self.runner)
        self.history = progress.History(
            self.log, config.metrics if comm.rank == 0 else "",
            resume_step=self.start_step if config.resume else None, steps=config.steps,
            log_every=config.log_every, units_per_step=config.batch_size * (config.context or 1),
            unit=self.task.unit, interactive=comm.size == 1 and interactive)

    # ----- setup ------------------------------------------------------------------------------
    def _set_up_locally(self, local_rank: int) -> None:
        """Device, data, this rank's stage, optimizer, scaler, and the checkpoint to resume from:
        every step that can fail for a user's reason, and none that sends a message."""
        config = self.config
        if config.device:
            backend.use_device(config.device, local_rank=local_rank)
        self.dtype = config.activation_dtype()
        self.task = TASKS[config.dataset](config, self.dtype)
        self.share = build_stage(config, self.task, self.topology, self.dtype)
        self.model, self.names, self.runner = self.share.model, self.share.names, self.share.runner
        self.fp8 = (Fp8Run(self.share.trained, self.share.ranges, self.topology, self.model)
                    if quantizes_linears(config) else None)
        self.scaler = build_scaler(config)
        schedule = build_schedule(config.schedule, config.pp, config.micro_batches,
                                  config.virtual_stages)
        self.actions = schedule[self.topology.stage]
        self.resume_flags = resume_flags(config)  # what a resume must repeat
        self.lr_decay_steps = config.lr_decay_steps or config.steps
        self.start_step: int = self._resume() if config.resume else 0
        self.stuck = False  # the steps overflow at the minimum loss scale (said once)
        self.guards = Guards(config, self.comm.rank, self.start_step, self.comm.size)

    def _resume(self) -> int:
        """Masters, optimizer and scaler state from --resume; returns the step it was saved at.
        The schedule's length continues the checkpoint's unless --lr-decay-steps is given."""
        step, schedule = checkpoint.restore(
            self.config.resume, flags=self.resume_flags, steps=self.config.steps, names=self.names,
            optimizer=self.share.optimizer, scaler=self.scaler, fp8=self.fp8,
            select=self.share.select)
        if not self.config.lr_decay_steps and "lr_decay_steps" in schedule:
            self.lr_decay_steps = int(schedule["lr_decay_steps"])
        return step

    # ----- one step ---------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """One optimizer step, as nanoGPT's loop reads: the batch, the schedule's forwards and
        backwards, one shared skip-or-step, then the metrics, evaluations and saves."""
        self.meter.start(step)
        inputs, targets, rows = self._micro_batches(step)
        self.optimizer.lr = self.learning_rate(step)
        if self.fp8 is not None:  # NVFP4's random bits are drawn from the step
            self.fp8.begin_step(step)
        self._tell_aux_losses()
        with self.guards.overflow_injected(step, self.optimizer.params[0]):
            loss_sum = self.runner.run(
                self.actions, inputs=inputs, targets=targets, scale_loss=self._scale_loss,
                after_backward=self.sync.after_backward, record=self.meter.recorder(),
                before_forward=self._dropout_rows(step, rows))
        self.guards.inject_fault(step)
        self.meter.straggler_barrier()
        with self.meter.exposed():
            max_norm = self.config.max_grad_norm or None
            result = mixed_precision_step(self.optimizer, self.scaler, max_norm, self.meter.sync)
        self._say_skipped_or_stuck(step, result.skipped, result.loss_scale)
        fp8 = {} if self.fp8 is None else {"fp8": self.fp8.end_step(self.comm, self.meter.timed)}
        self._check_replicas(step)
        decisions = dict(lr=self.optimizer.lr, loss_scale=result.loss_scale,
                         skipped=result.skipped)
        entry = self.meter.finish(step, decisions, loss_sum, fp8)
        if self.config.eval_every and step % self.config.eval_every == 0:
            started = time.perf_counter()
            entry["val_loss"] = saving.evaluate(self, batches=self.config.eval_batches or None)
            entry["eval_seconds"] = time.perf_counter() - started
        self.history.add(entry, loss_scale=self.scaler.loss_scale)
        self.guards.stop_if_diverging(step, entry["loss"], result.skipped, self.scaler.loss_scale)
        if not math.isfinite(entry["loss"]):  # a skipped step too: are the weights lost?
            agree_on_error(self.comm, lambda: self.guards.check_weights(
                step, self.sync.arrays_by_kind()["masters"]))
        every = self.config.save_every
        if every and step % every == 0 and step < self.config.steps:
            if math.isfinite(entry["loss"]):
                saving.save_checkpoint(self, step, saving.gather_state(self))
            else:  # weights that cannot compute the loss are no checkpoint; the run may recover
                self.history.say(f"step {step}: not saved, its loss is {entry['loss']} (--save "
                                 "keeps the last checkpoint whose loss was finite)")

    def learning_rate(self, step: int) -> float:
        """The schedule's learning rate at this step."""
        config = self.config
        if config.lr_schedule == "constant":
            return lr_scheduler.constant(step, config.lr)
        return lr_scheduler.warmup_cosine(step, config.lr, config.min_lr, config.warmup,
                                          self.lr_decay_steps)

    def _micro_batches(self, step: int) -> tuple[list | None, list | None, list]:
        """This replica's rows of the step's global batch, cut into micro-batches: the inputs (on
        the first stage), the targets (on the last stage) and every micro-batch's global row
        numbers (what dropout draws its masks from). With --cp, of every row this rank's
        positions only (its inputs and their targets: minimp/parallel/context/layout.py)."""
        config, topology = self.config, self.topology
        inputs, targets = self.task.global_batch(step)
        layout = self.share.context
        if layout is not None:  # (B, T) -> (B, T/N): this context shard's positions
            inputs = layout.shard(inputs, topology.cp_rank)
            targets = layout.shard(targets, topology.cp_rank)
        local = shard(np.arange(config.batch_size), topology.dp_rank, self.dp)
        rows = np.split(local, config.micro_batches)
        first, last = topology.is_first_stage, topology.is_last_stage
        inputs_by_mb = [inputs[r[0] : r[-1] + 1] for r in rows] if first else None
        targets_by_mb = [targets[r[0] : r[-1] + 1] for r in rows] if last else None
        return inputs_by_mb, targets_by_mb, rows

    def _dropout_rows(self, step: int, rows: list) -> Callable[[int], None] | None:
        """With dropout, the callback that tells this stage's dropouts which global samples a
        micro-batch holds, before its forward (every layout then draws the same masks)."""
        if not self.config.dropout:
            return None

        def tell(micro_batch: int) -> None:
            for layer in self.runner.layers:
                nn.set_dropout_state(layer, self.config.seed, step, rows[micro_batch])

        return tell

    def _scale_loss(self, loss: Tensor) -> Tensor:
        """Each micro-batch carries 1/M of the batch mean; the loss scale lifts fp16 gradients."""
        return self.scaler.scale(loss) * (1.0 / self.config.micro_batches)

    def _tell_aux_losses(self) -> None:
        """The gradient _scale_loss's root gives the loss, S x 1/M, to the model's auxiliary
        losses (the mixtures'), which reach backward through their blocks, not the loss."""
        if self.task.aux_weights is not None:
            share = 1.0 / self.config.micro_batches
            self.task.aux_weights.grad_scale = self.scaler.loss_scale * share

    def _say_skipped(self, step: int, scale_before: float) -> None:
        """The lesson of a skipped step, as it happens: whose gradients overflowed (every rank
        takes part in finding out), and what the loss scaler made of it. Each rank is named for
        what its own check found: where backward reduces the gradients (--overlap, the default,
        and ZeRO's stages 2-3) the replicas check the reduced mean (or their piece of it), so
        the line names those that found the inf or NaN, not the one that produced it, and says
        so; with --no-overlap and --zero 0 or 1 it names that one."""
        ranks = self.meter.overflowed_ranks()
        who = "rank" if len(ranks) == 1 else "ranks"
        config = self.config
        where = ""
        if self.dp > 1 and (config.overlap or config.zero >= 2):
            where = f" (found after the {'reduce-scatter' if config.zero else 'all-reduce'} "
            where += "in backward)"
        self.history.say(f"step {step}: skipped, non-finite gradients on {who} "
                         f"{', '.join(map(str, ranks))}{where}; loss scale {scale_before:g} -> "
                         f"{self.scaler.loss_scale:g}")

    def _say_skipped_or_stuck(self, step: int, skipped: bool, scale_before: float) -> None:
        """A line per skipped step, until the scale can fall no further: then one line says the
        run is diverging, and the overflows that follow at that scale are only counted (the
        progress lines' `skipped`) until a step is taken again."""
        if not skipped:
            self.stuck = False
        elif not self.stuck:
            self._say_skipped(step, scale_before)
            if self.scaler.hit_min_scale:
                self.stuck = True
                self.log(f"step {step}: gradients overflow at the minimum loss scale "
                         f"{self.scaler.loss_scale:g}; training is diverging in fp16 (lower "
                         "--lr, clip with --max-grad-norm, or use bf16); the steps skipped "
                         "after this one at that scale are counted, not printed")

    def _check_replicas(self, step: int) -> None:
        every = self.config.check_replicas
        if every and step % every == 0:
            fp8_state = list(self.fp8.state_arrays().values()) if self.fp8 else []
            assert isinstance(self.sync, DataParallel)  # checks.py refuses it with ZeRO
            self.meter.timed(self.sync.check_replicas)(fp8_state)  # raises
            what = " and fp8 scaling state" if fp8_state else ""
            masters = "float32 masters" if self.config.master_weights == "fp32" else "bf16 weights"
            if self.dp > 1:
                self.log(f"step {step}: replicas identical (the {self.dp} replicas' {masters}"
                         f"{what} have the same checksum)")
            if self.share.tensor_parallel is not None:
                check = self.meter.timed(self.share.tensor_parallel.check_replicated)
                check(self.share.optimizer.master_weights, fp8_state)  # raises
                self.log(f"step {step}: the {self.config.tp} shards' whole parameters{what} agree")
