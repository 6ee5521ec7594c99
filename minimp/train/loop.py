"""Training loop of `python -m minimp.train`: build this rank's stage, (resume,) step, log, save.

Every rank builds the whole float32 model from the seed, keeps the layers of its pipeline stage, and
runs the schedule's actions for that stage each step (with one stage, the schedule is the plain
micro-batch loop). Data-parallel replicas of a stage then average their gradients; every rank of the
job takes part in the one decision to skip an overflowing step.
"""

import time
from typing import Any, Callable

import numpy as np

from minimp import backend, nn
from minimp.optim import lr_scheduler as lr_schedule
from minimp.distributed import world
from minimp.distributed.protocol import Communicator
from minimp.parallel import Topology, shard
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.parallel.pipeline.tied import TiedGradients, tied_group, tied_indices
from minimp.precision import mixed_precision_step
from minimp.train import accounts, progress, report, saving
from minimp.checkpoints import checkpoint
from minimp.train.build import build_scaler, build_stage, build_sync
from minimp.train.config import TrainConfig
from minimp.checkpoints.errors import USER_ERRORS, agree_on_error
from minimp.train.guards import Guards
from minimp.train.tasks import TASKS
from minimp.measure.trace import TraceRecorder, common_origin


def train(
    config: TrainConfig,
    log: Callable = print,
    comm: Communicator | None = None,
    interactive: bool = False,
) -> dict:
    """Run the configured training on this process's rank; returns a dict with history, skipped
    count, the final score (test_accuracy or val_loss) and the masters (all stages' on rank 0).
    `comm` defaults to the MPI world; `interactive`: show a progress bar instead of lines."""
    comm = comm or world()
    threads = config.threads or max(1, backend.available_cores() // comm.ranks_on_this_node())
    # Overflow to inf in float16 is expected and handled (skipped steps): no NumPy warning per cast.
    with backend.limit_cpu_threads(threads), np.errstate(over="ignore", invalid="ignore"):
        run = Run(config, comm, log, interactive)
        for step in range(run.start_step + 1, config.steps + 1):
            run.step(step)
        return saving.finish(run)


class Run:
    """One rank's share of a training run: its stage of the model, its optimizer, its groups."""

    optimizer: Any  # the stage's optimizer, or (--zero) its ShardedOptimizer once set up

    def __init__(
        self, config: TrainConfig, comm: Communicator, log: Callable, interactive: bool = False
    ):
        """interactive: a person watches this process's terminal (a progress bar, not lines)."""
        self.config, self.comm, self.dp = config, comm, config.data_parallel_size(comm.size)
        self.interactive = interactive
        self.log = log if comm.rank == 0 else (lambda line: None)
        self.topology = Topology(comm, dp=self.dp, pp=config.pp, tp=config.tp)
        if comm.size > 1:
            self.log(self.topology.describe())
        local_rank = comm.node_rank_and_size()[0]
        error = None
        try:  # everything that can fail for a user's reason, with no message in between
            self._set_up_locally(local_rank)
        except USER_ERRORS as caught:
            error = caught
        agree_on_error(comm, error)  # one rank says what failed; every rank stops here
        if config.resume:
            self.log(f"resumed from {config.resume} after step {self.start_step}")
        tied = self._tied_gradients()
        self.data_parallel: Any = build_sync(config, self.topology, self.built, tied, comm)
        self.optimizer = self.data_parallel.optimizer  # ZeRO's sharded one, with --zero
        self.counters = accounts.StepCounters(self)
        self.communication = report.Stopwatch()
        self.sync = report.TimedCalls(self.data_parallel, self.communication)
        self.in_backward_before = self.data_parallel.backward_communication_seconds()
        self.history = progress.History(
            self.log,
            config.metrics if comm.rank == 0 else "",
            resume_step=self.start_step if config.resume else None,
            steps=config.steps,
            log_every=config.log_every,
            units_per_step=config.batch_size * (config.context or 1),
            unit=self.task.unit,
            interactive=comm.size == 1 and self.interactive,
        )
        self.trace = TraceRecorder(common_origin(comm)) if config.timeline else None
        if self.trace is not None:  # the sync's collectives go into the trace's communication lane
            self.communication.listener = self._record_communication

    # ----- setup ------------------------------------------------------------------------------
    def _set_up_locally(self, local_rank: int) -> None:
        """Device, data, this rank's stage, optimizer, scaler, and the checkpoint to resume from:
        every step that can fail for a user's reason, and none that sends a message."""
        config = self.config
        if config.device:
            backend.use_device(config.device, local_rank=local_rank)
        self.dtype = config.activation_dtype()
        self.task = TASKS[config.dataset](config, self.dtype)
        self.built = build_stage(config, self.task, self.topology, self.dtype)
        self.model, self.names = self.built.model, self.built.names
        # The stage's whole optimizer; with --zero, replaced by its sharded one after setup.
        self.optimizer = self.built.optimizer
        self.stage = self.built.runner
        self.tied_names = self.built.tied_names
        self.tensor_parallel = self.built.tensor_parallel  # --tp's part of the step, or None
        self.fp8 = self.built.fp8
        self.scaler = build_scaler(config)
        schedule = build_schedule(
            config.schedule, config.pp, config.micro_batches, config.virtual_stages
        )
        self.actions = schedule[self.topology.stage]
        # What a resume must repeat: the model, the batch order, the optimizer state's shapes and
        # the fp8 scaling state depend on these (the learning rate and --steps may change).
        names = (*self.task.model_flags, "seed", "batch_size", "optimizer")
        if self.fp8 is not None:  # the shape and meaning of the saved scaling state
            names += ("fp8_recipe", "fp8_amax_history", "fp8_margin")
        self.resume_flags = {f"--{n.replace('_', '-')}": getattr(config, n) for n in names}
        self.lr_decay_steps = config.lr_decay_steps or config.steps
        self.start_step: int = self._resume() if config.resume else 0
        self.guards = Guards(config, self.comm.rank, self.start_step, self.comm.size)

    def _resume(self) -> int:
        """Masters, optimizer and scaler state from --resume; returns the step it was saved at.
        The schedule's length continues the checkpoint's unless --lr-decay-steps is given."""
        step, schedule = checkpoint.restore(
            self.config.resume,
            flags=self.resume_flags,
            steps=self.config.steps,
            names=self.names,
            optimizer=self.optimizer,
            scaler=self.scaler,
            fp8=self.fp8,
            select=self.built.select,
        )
        if not self.config.lr_decay_steps and "lr_decay_steps" in schedule:
            self.lr_decay_steps = int(schedule["lr_decay_steps"])
        return step

    def _tied_gradients(self) -> TiedGradients | None:
        """The copies of parameters this stage shares with another (every stage calls this: the
        group is split from the pipeline's); None where there are none."""
        topology = self.topology
        if topology.pp == 1 or not getattr(self.model, "tied_parameters", None):
            return None
        group = tied_group(topology.pp_group, topology.stage, topology.pp)
        if group is None:
            return None
        indices = tied_indices(self.names, self.tied_names)
        return TiedGradients(group, indices, counts_in_norm=topology.is_first_stage)

    # ----- one step ---------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """One optimizer step: the schedule's forwards and backwards,
        then one shared skip-or-step."""
        step_start = self._start_step()
        inputs, targets, rows = self._micro_batches(step)
        self.optimizer.lr = self.learning_rate(step)
        overflow = self.guards.arm_overflow(step, self.optimizer.params[0])
        loss_sum = self.stage.run(
            self.actions,
            inputs=inputs,
            targets=targets,
            scale_loss=self._scale_loss,
            after_backward=self.data_parallel.after_backward,
            record=self._timeline_recorder(step),
            before_forward=self._dropout_rows(step, rows),
        )
        if overflow is not None:
            overflow.remove()
        self.guards.inject_fault(step)
        straggler = accounts.straggler_barrier(self)
        max_norm = self.config.max_grad_norm or None
        before_step = self.communication.seconds  # what follows the last backward is exposed
        result = mixed_precision_step(self.optimizer, self.scaler, max_norm, sync=self.sync)
        exposed = self.communication.seconds - before_step
        self.held = self.data_parallel.held()  # what this rank keeps until the next step
        self.data_parallel.peak.sample(self.held)
        self._warn_if_stuck_at_min_scale(step)
        fp8_entry = self._end_fp8_step()
        self._check_replicas(step)
        loss, activation_bytes = accounts.step_scalars(self, loss_sum)
        entry = {
            "step": step,
            "loss": loss,
            "lr": self.optimizer.lr,
            "loss_scale": result.loss_scale,
            "skipped": result.skipped,
            **accounts.step_seconds(self, step_start, exposed, straggler),
            **self.counters.finish(),
            "peak_activation_bytes": activation_bytes,
            **fp8_entry,
        }
        every = self.config.eval_every
        if every and step % every == 0:
            started = time.perf_counter()
            entry["val_loss"] = saving.evaluate(self, batches=self.config.eval_batches or None)
            entry["eval_seconds"] = time.perf_counter() - started
        self.history.add(entry, loss_scale=self.scaler.loss_scale)
        self.guards.stop_if_diverging(step, loss, result.skipped, self.scaler.loss_scale)
        every = self.config.save_every
        if every and step % every == 0 and step < self.config.steps:
            saving.save_checkpoint(self, step)

    def learning_rate(self, step: int) -> float:
        """The schedule's learning rate at this step."""
        config = self.config
        if config.lr_schedule == "constant":
            return lr_schedule.constant(step, config.lr)
        warmup, decay = config.warmup, self.lr_decay_steps
        return lr_schedule.warmup_cosine(step, config.lr, config.min_lr, warmup, decay)

    def _start_step(self) -> float:
        """The start time (the counters start too); with --timeline all ranks start the step
        together, so the stages' clocks line up."""
        if self.config.timeline:
            self.comm.barrier()
        self.communication.seconds = 0.0
        self.counters.start()
        return time.perf_counter()

    def _micro_batches(self, step: int) -> tuple[list | None, list | None, list]:
        """This replica's rows of the step's global batch, cut into micro-batches: the inputs (on
        the first stage), the targets (on the last stage) and every micro-batch's global row
        numbers (what dropout draws its masks from)."""
        config, topology = self.config, self.topology
        inputs, targets = self.task.global_batch(step)
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
            for layer in self.stage.layers:
                nn.set_dropout_state(layer, self.config.seed, step, rows[micro_batch])

        return tell

    def _scale_loss(self, loss: Any) -> Any:
        """Each micro-batch carries 1/M of the batch mean; the loss scale lifts fp16 gradients."""
        return self.scaler.scale(loss) * (1.0 / self.config.micro_batches)

    def _warn_if_stuck_at_min_scale(self, step: int) -> None:
        if self.scaler.hit_min_scale:
            self.log(
                f"step {step}: gradients overflow at the minimum loss scale "
                f"{self.scaler.loss_scale:g}; training is diverging in fp16 "
                "(lower --lr, clip with --max-grad-norm, or use bf16)"
            )

    def _end_fp8_step(self) -> dict:
        """fp8: the watched tensors' scales and lost fractions for the metrics row, then the next
        step's scales (delayed scaling agrees on the amaxes across the replicas first)."""
        if self.fp8 is None:
            return {}
        return {"fp8": self.fp8.end_step(self.comm, timed=self.communication.wrap)}

    def _check_replicas(self, step: int) -> None:
        every = self.config.check_replicas
        if every and step % every == 0:
            fp8_state = list(self.fp8.state_arrays().values()) if self.fp8 else []
            self.communication.wrap(self.data_parallel.check_replicas)(fp8_state)  # raises
            what = " and fp8 scaling state" if fp8_state else ""
            if self.dp > 1:
                self.log(
                    f"step {step}: replicas identical (the {self.dp} replicas' float32 masters"
                    f"{what} have the same checksum)"
                )
            if self.tensor_parallel is not None:
                check = self.communication.wrap(self.tensor_parallel.check_replicated)
                check(self.optimizer.master_weights, fp8_state)  # raises
                self.log(f"step {step}: the {self.config.tp} shards' whole parameters{what} agree")

    def _timeline_recorder(self, step: int) -> Callable | None:
        """With --timeline, every action of the step goes into this rank's trace."""
        if self.trace is None:
            return None
        trace = self.trace
        self.current_step = step
        return lambda op, micro_batch, start, end: trace.record(op, step, micro_batch, start, end)

    def _record_communication(self, op: str, start: float, end: float) -> None:
        self.trace.record(op, self.current_step, -1, start, end)
