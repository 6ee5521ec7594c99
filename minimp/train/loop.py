"""Training loop of `python -m minimp.train`: build this rank's stage, (resume,) step, log, save.

Every rank builds the whole float32 model from the seed, keeps the layers of its pipeline stage, and
runs the schedule's actions for that stage each step (with one stage, the schedule is the plain
micro-batch loop). Data-parallel replicas of a stage then average their gradients; every rank of the
job takes part in the one decision to skip an overflowing step.
"""

import time
from typing import Any, Callable

import numpy as np

from minimp import backend
from minimp.data import DATASETS, global_batch_indices
from minimp.distributed import gather_named_arrays, world
from minimp.distributed.protocol import Communicator
from minimp.parallel import SCHEDULES, DataParallel, Topology, shard
from minimp.precision import ACTIVATION_DTYPES, mixed_precision_step
from minimp.train import checkpoint, report
from minimp.train.build import build_scaler, build_stage, evaluate
from minimp.train.config import ConfigError, TrainConfig


def train(config: TrainConfig, log: Callable = print, comm: Communicator | None = None) -> dict:
    """Run the configured training on this process's rank; returns a dict with history,
    skipped count, test accuracy and the masters (all stages' on rank 0).
    `comm` defaults to the MPI world."""
    comm = comm or world()
    threads = config.threads or max(1, backend.available_cores() // comm.ranks_on_this_node())
    # Overflow to inf in float16 is expected and handled (skipped steps): no NumPy warning per cast.
    with backend.limit_cpu_threads(threads), np.errstate(over="ignore", invalid="ignore"):
        run = Run(config, comm, log)
        for step in range(run.start_step + 1, config.steps + 1):
            run.step(step)
        return run.finish()


class Run:
    """One rank's share of a training run: its stage of the model, its optimizer, its groups."""

    def __init__(self, config: TrainConfig, comm: Communicator, log: Callable):
        if config.device:
            backend.use_device(config.device, local_rank=comm.node_rank_and_size()[0])
        self.config, self.comm, self.dp = config, comm, config.data_parallel_size(comm.size)
        self.log = log if comm.rank == 0 else (lambda line: None)
        self.topology = Topology(comm, dp=self.dp, pp=config.pp)
        self.dataset = DATASETS[config.dataset]()
        if config.batch_size > len(self.dataset.train_labels):
            raise ConfigError(
                f"--batch-size {config.batch_size} is larger than the training set "
                f"({len(self.dataset.train_labels)} samples)"
            )
        self.dtype = ACTIVATION_DTYPES[config.precision]
        stage = build_stage(config, self.dataset, self.topology, self.dtype)
        self.model, self.names, self.optimizer, self.stage = (
            stage.model,
            stage.names,
            stage.optimizer,
            stage.runner,
        )
        self.scaler = build_scaler(config)
        self.model_shape = {"dataset": config.dataset, "layers": config.layers}
        self.model_shape["hidden"] = config.hidden
        schedule = SCHEDULES[config.schedule](config.pp, config.micro_batches)
        self.actions = schedule[self.topology.stage]
        self.start_step = self._resume() if config.resume else 0
        self.data_parallel = DataParallel(
            self.topology.dp_group,
            self.optimizer,
            bucket_mb=config.bucket_mb,
            comm_dtype=ACTIVATION_DTYPES[config.grad_comm_dtype],
            average=config.grad_average,
            decision_comm=comm,
            stages_comm=self.topology.pp_group,
        )
        self.data_parallel.broadcast_parameters()
        self.communication = report.Stopwatch()
        self.sync = report.TimedCalls(self.data_parallel, self.communication)
        # The whole (small) training set sits on the device in the compute dtype: no per-step casts.
        self.train_images = backend.to_device(self.dataset.train_images).astype(self.dtype)
        self.train_labels = backend.to_device(self.dataset.train_labels)
        self.overflow_at = config.overflow_injection(comm.size)
        self.fault_at = config.fault_injection(comm.size)
        metrics_path = config.metrics if comm.rank == 0 else ""
        self.history = report.History(
            self.log,
            metrics_path,
            append=bool(config.resume),
            steps=config.steps,
            log_every=config.log_every,
            batch_size=config.batch_size,
        )
        self.timeline = report.Timeline()

    # ----- setup ------------------------------------------------------------------------------
    def _resume(self) -> int:
        """Masters, optimizer and scaler state from --resume; returns the step it was saved at."""
        step = checkpoint.restore(
            self.config.resume,
            seed=self.config.seed,
            model_shape=self.model_shape,
            names=self.names,
            optimizer=self.optimizer,
            scaler=self.scaler,
        )
        self.log(f"resumed from {self.config.resume} after step {step}")
        return step

    # ----- one step ---------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """One optimizer step: the schedule's forwards and backwards,
        then one shared skip-or-step."""
        step_start, bytes_before = self._start_step()
        inputs, targets = self._micro_batches(step)
        overflow = self._arm_overflow_injection(step)
        loss_sum = self.stage.run(
            self.actions,
            inputs=inputs,
            targets=targets,
            scale_loss=self._scale_loss,
            after_backward=self.optimizer.accumulate_gradients,
            record=self._timeline_recorder(step, step_start),
        )
        if overflow is not None:
            overflow.remove()
        self._inject_fault(step)
        max_norm = self.config.max_grad_norm or None
        result = mixed_precision_step(self.optimizer, self.scaler, max_norm, sync=self.sync)
        self._warn_if_stuck_at_min_scale(step)
        self._check_replicas(step)
        self.history.add(
            {
                "step": step,
                "loss": self._mean_loss(loss_sum),
                "loss_scale": result.loss_scale,
                "skipped": result.skipped,
                "compute_seconds": time.perf_counter() - step_start - self.communication.seconds,
                "communication_seconds": self.communication.seconds,
                "bytes_sent": self._bytes_sent() - bytes_before,
            },
            loss_scale=self.scaler.loss_scale,
        )

    def _start_step(self) -> tuple[float, int]:
        """(start time, bytes sent so far); with --timeline all ranks start the step together, so
        the stages' clocks line up."""
        if self.config.timeline:
            self.comm.barrier()
        self.communication.seconds = 0.0
        return time.perf_counter(), self._bytes_sent()

    def _micro_batches(self, step: int) -> tuple[list | None, list | None]:
        """This replica's shard of the step's global batch, cut into micro-batches: the inputs (on
        the first stage) and the targets (on the last stage)."""
        config = self.config
        indices = global_batch_indices(
            config.seed, step, config.batch_size, len(self.dataset.train_labels)
        )
        local = shard(indices, self.topology.dp_rank, self.dp)
        rows = [backend.to_device(part) for part in np.split(local, config.micro_batches)]
        inputs = [self.train_images[r] for r in rows] if self.topology.is_first_stage else None
        targets = [self.train_labels[r] for r in rows] if self.topology.is_last_stage else None
        return inputs, targets

    def _scale_loss(self, loss: Any) -> Any:
        """Each micro-batch carries 1/M of the batch mean; the loss scale lifts fp16 gradients."""
        return self.scaler.scale(loss) * (1.0 / self.config.micro_batches)

    def _arm_overflow_injection(self, step: int) -> Any:
        """--inject-overflow: on that step and rank, a gradient hook turns the first parameter's
        gradient into inf, as if backward had overflowed. Returns the hook's handle, or None."""
        if self.overflow_at != (step, self.comm.rank):
            return None
        xp = backend.array_module(self.optimizer.master_weights[0])
        return self.optimizer.params[0].register_hook(lambda grad: xp.full_like(grad, np.inf))

    def _inject_fault(self, step: int) -> None:
        if self.fault_at == (step, self.comm.rank):
            raise RuntimeError(
                f"injected fault at step {step} on rank {self.comm.rank} (--inject-fault)"
            )

    def _warn_if_stuck_at_min_scale(self, step: int) -> None:
        if self.scaler.hit_min_scale:
            self.log(
                f"step {step}: gradients overflow at the minimum loss scale "
                f"{self.scaler.loss_scale:g}; training is diverging in fp16 "
                "(lower --lr, clip with --max-grad-norm, or use bf16)"
            )

    def _check_replicas(self, step: int) -> None:
        every = self.config.check_replicas
        if every and step % every == 0:
            self.communication.wrap(self.data_parallel.check_replicas)()

    def _mean_loss(self, loss_sum: float) -> float:
        """The batch's mean loss on every rank: the last stages' shares, summed over the job."""
        share = 0.0
        if self.topology.is_last_stage:
            share = loss_sum / self.config.micro_batches / self.dp
        total = self.communication.wrap(self.comm.allreduce_scalars)([share], "sum")
        return float(total[0])

    def _timeline_recorder(self, step: int, step_start: float) -> Callable | None:
        """With --timeline, replica 0's stages record every forward and backward of the step."""
        if not self.config.timeline or self.topology.dp_rank != 0:
            return None
        return self.timeline.recorder(step, step_start)

    def _bytes_sent(self) -> int:
        return self.topology.dp_group.bytes_sent + self.topology.pp_group.bytes_sent

    # ----- the end ----------------------------------------------------------------------------
    def finish(self) -> dict:
        """Gather every stage onto rank 0;
        evaluate, save the checkpoint, the timeline and the plot there."""
        merged, events = self._gather_stages()
        accuracy = self._test_accuracy(merged)
        self.history.close({"test_accuracy": accuracy})
        skipped = self.history.skipped
        self.log(
            f"done: {self.config.steps} steps, {skipped} skipped, test accuracy {accuracy:.4f}"
        )
        if self.comm.rank == 0:
            self._write_files(merged, events)
        self.comm.barrier()  # nobody leaves before the files are complete
        masters = {
            name[len("master/") :]: array
            for name, array in (merged or {}).items()
            if name.startswith("master/")
        }
        return {
            "history": self.history.records,
            "skipped": skipped,
            "test_accuracy": accuracy,
            "master_weights": masters,
        }

    def _gather_stages(self) -> tuple[dict | None, dict | None]:
        """Replica 0's stages send their state and timelines to rank 0 (replicas are identical,
        so replica 0 speaks for all); (None, None) elsewhere."""
        topology = self.topology
        if topology.dp_rank != 0:
            return None, None
        state = checkpoint.state_arrays(self.names, self.optimizer)
        merged = gather_named_arrays(topology.pp_group, state)
        timeline = {
            f"stage{topology.stage}": self.timeline.array(),
            f"peak{topology.stage}": np.array([self.stage.peak_stored], np.int64),
        }
        return merged, gather_named_arrays(topology.pp_group, timeline)

    def _test_accuracy(self, merged: dict | None) -> float:
        """Rank 0 evaluates the whole model on the test set; every rank returns its accuracy."""
        accuracy = 0.0
        if self.comm.rank == 0:
            self.model.load_state_dict(
                {name: merged[f"master/{name}"] for name, _ in self.model.named_parameters()}
            )
            test_images = backend.to_device(self.dataset.test_images).astype(self.dtype)
            accuracy = evaluate(self.model, test_images, self.dataset.test_labels)
        return float(self.comm.allreduce_scalars([accuracy], "sum")[0])

    def _write_files(self, merged: dict, events: dict) -> None:
        config = self.config
        if config.save:
            checkpoint.save(
                config.save,
                step=config.steps,
                seed=config.seed,
                model_shape=self.model_shape,
                optimizer=self.optimizer,
                scaler=self.scaler,
                arrays=merged,
            )
            self.log(f"saved checkpoint {config.save}")
        if config.timeline:
            report.write_timeline(
                config.timeline, config.schedule, config.pp, config.micro_batches, events
            )
            self.log(f"saved timeline {config.timeline}")
        if config.plot:
            report.plot_history(config.plot, self.history.records)
            self.log(f"saved plot {config.plot}")
