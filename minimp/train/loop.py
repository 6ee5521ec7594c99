"""The training loop of `python -m minimp.train`: build this rank's stage, (resume,) step, log,
save.

Every rank builds the whole float32 model from the seed, keeps the layers of its pipeline stage, and
runs the schedule's actions for that stage each step (with one stage, the schedule is the plain
micro-batch loop). Data-parallel replicas of a stage then average their gradients; every rank of the
job takes part in the one decision to skip an overflowing step.
"""

import time

import numpy as np

from minimp import backend
from minimp.data import DATASETS, global_batch_indices
from minimp.dist.comm import world
from minimp.dist.data_parallel import DataParallel, shard
from minimp.dist.gather import gather_named_arrays
from minimp.dist.pipeline import PipelineStage
from minimp.dist.schedules import SCHEDULES
from minimp.dist.topology import Topology
from minimp.precision import ACTIVATION_DTYPES, mixed_precision_step
from minimp.train import checkpoint, report
from minimp.train.build import build_model, build_optimizer, build_scaler, evaluate, stage_of
from minimp.train.config import ConfigError


def train(config, log=print, comm=None):
    """Run the configured training on this process's rank; returns a dict with history, skipped
    count, test accuracy and the masters (all stages' on rank 0). `comm` defaults to the MPI
    world."""
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

    def __init__(self, config, comm, log):
        if config.device:
            backend.use_device(config.device, local_rank=comm.node_rank_and_size()[0])
        self.config, self.comm, self.dp = config, comm, config.replicas(comm.size)
        self.log = log if comm.rank == 0 else (lambda line: None)
        self.topology = Topology(comm, dp=self.dp, pp=config.pp)
        self.dataset = DATASETS[config.dataset]()
        if config.batch_size > len(self.dataset.train_labels):
            raise ConfigError(
                f"--batch-size {config.batch_size} is larger than the training set "
                f"({len(self.dataset.train_labels)} samples)"
            )
        self.dtype = ACTIVATION_DTYPES[config.precision]
        self._build_stage()
        self.start_step = 0
        if config.resume:
            self.start_step = checkpoint.restore(
                config.resume,
                seed=config.seed,
                model_shape=self.model_shape,
                names=self.names,
                optimizer=self.optimizer,
                scaler=self.scaler,
            )
            self.log(f"resumed from {config.resume} after step {self.start_step}")
        self.replicas = DataParallel(
            self.topology.dp_group,
            self.optimizer,
            bucket_mb=config.bucket_mb,
            comm_dtype=ACTIVATION_DTYPES[config.grad_comm_dtype],
            average=config.grad_average,
            decision_comm=comm,
        )
        self.replicas.broadcast_parameters()
        # The whole (small) training set lives on the device in the compute dtype: no per-step
        # casts.
        self.train_images = backend.to_device(self.dataset.train_images).astype(self.dtype)
        self.train_labels = backend.to_device(self.dataset.train_labels)
        self.overflow_at = config.overflow_injection(comm.size)
        self.fault_at = config.fault_injection(comm.size)
        self.metrics = report.MetricsWriter(
            config.metrics if comm.rank == 0 else "", append=bool(config.resume)
        )
        self.communication = report.Stopwatch()
        self.timeline, self.history, self.skipped = [], [], 0
        self.window_start, self.window_samples = time.perf_counter(), 0

    def _build_stage(self):
        """The whole float32 model from the seed, then this rank's stage of it, its optimizer
        (masters from the float32 init), the float16/bfloat16 compute copies, the scaler and the
        runner."""
        config, topology = self.config, self.topology
        self.model = build_model(
            self.dataset.features,
            self.dataset.classes,
            config.hidden,
            config.layers,
            np.random.default_rng(config.seed),
        )
        layers, named, input_width, output_width = stage_of(self.model, config.pp, topology.stage)
        self.names = [name for name, _ in named]
        self.optimizer = build_optimizer(config, [p for _, p in named])
        self.model.to(self.dtype)
        self.scaler = build_scaler(config)
        self.model_shape = {
            "dataset": config.dataset,
            "layers": config.layers,
            "hidden": config.hidden,
        }
        micro_rows = config.batch_size // self.dp // config.micro_batches
        self.stage = PipelineStage(
            layers,
            topology.pp_group,
            topology.stage,
            config.pp,
            input_width,
            output_width,
            self.dtype,
            micro_rows,
        )
        self.actions = SCHEDULES[config.schedule](config.pp, config.micro_batches)[topology.stage]

    def _scale_loss(self, loss):
        """Each micro-batch carries 1/M of the batch mean; the loss scale lifts the fp16
        gradients."""
        return self.scaler.scale(loss) * (1.0 / self.config.micro_batches)

    def _bytes_sent(self):
        return self.topology.dp_group.bytes_sent + self.topology.pp_group.bytes_sent

    def step(self, step):
        """One optimizer step: the schedule's forwards and backwards, then one shared
        skip-or-step."""
        config, comm, communication = self.config, self.comm, self.communication
        if config.timeline:
            comm.barrier()  # a common start, so the stages' clocks line up in the timeline
        step_start, communication.seconds, bytes_before = (
            time.perf_counter(),
            0.0,
            self._bytes_sent(),
        )
        indices = global_batch_indices(
            config.seed, step, config.batch_size, len(self.dataset.train_labels)
        )
        local = shard(indices, self.topology.dp_rank, self.dp)
        rows = [backend.to_device(part) for part in np.split(local, config.micro_batches)]
        record = None
        if config.timeline and self.topology.dp_rank == 0:

            def record(kind, mb, start, end):
                self.timeline.append(
                    [step, kind == "backward", mb, start - step_start, end - step_start]
                )

        loss_sum = self.stage.run(
            self.actions,
            [self.train_images[r] for r in rows] if self.stage.first else None,
            [self.train_labels[r] for r in rows] if self.stage.last else None,
            self._scale_loss,
            self.optimizer.accumulate_gradients,
            record,
        )
        if self.fault_at == (step, comm.rank):
            raise RuntimeError(
                f"injected fault at step {step} on rank {comm.rank} (--inject-fault)"
            )
        if self.overflow_at == (step, comm.rank):
            self.optimizer.master_gradients[0].reshape(-1)[0] = (
                np.inf
            )  # as if backward had overflowed
        result = mixed_precision_step(
            self.optimizer,
            self.scaler,
            max_grad_norm=config.max_grad_norm or None,
            reduce_gradients=communication.wrap(self.replicas.reduce_gradients),
            reduce_found_inf=communication.wrap(self.replicas.reduce_found_inf),
        )
        if self.scaler.hit_min_scale:
            self.log(
                f"step {step}: gradients overflow at the minimum loss scale "
                f"{self.scaler.loss_scale:g}; "
                "training is diverging in fp16 (lower --lr, clip with --max-grad-norm, or use bf16)"
            )
        if config.check_replicas and step % config.check_replicas == 0:
            communication.wrap(self.replicas.check_replicas)()
        share = loss_sum / config.micro_batches / self.dp if self.stage.last else 0.0
        loss = communication.wrap(lambda value: comm.allreduce_scalars([value], "sum")[0])(share)
        self._record(
            {
                "step": step,
                "loss": loss,
                "loss_scale": result.loss_scale,
                "skipped": result.skipped,
                "compute_seconds": time.perf_counter() - step_start - communication.seconds,
                "communication_seconds": communication.seconds,
                "bytes_sent": self._bytes_sent() - bytes_before,
            }
        )

    def _record(self, entry):
        self.history.append(entry)
        self.metrics.write(entry)
        self.skipped += entry["skipped"]
        self.window_samples += self.config.batch_size
        step = entry["step"]
        if step % self.config.log_every == 0 or step == self.config.steps:
            elapsed = time.perf_counter() - self.window_start
            self.log(
                report.progress_line(
                    step,
                    self.config.steps,
                    entry["loss"],
                    self.scaler.loss_scale,
                    self.skipped,
                    self.window_samples / max(elapsed, 1e-9),
                )
            )
            self.window_start, self.window_samples = time.perf_counter(), 0

    def finish(self):
        """Gather every stage onto rank 0; evaluate, save the checkpoint, the timeline and the
        plot there."""
        config, comm, topology = self.config, self.comm, self.topology
        merged = events = None
        if topology.dp_rank == 0:  # replicas are identical: replica 0's stages speak for all
            merged = gather_named_arrays(
                topology.pp_group, checkpoint.state_arrays(self.names, self.optimizer)
            )
            events = gather_named_arrays(
                topology.pp_group,
                {
                    f"stage{topology.stage}": np.array(self.timeline, np.float64).reshape(-1, 5),
                    f"peak{topology.stage}": np.array([self.stage.peak_stored], np.int64),
                },
            )
        accuracy = 0.0
        if comm.rank == 0:
            self.model.load_state_dict(
                {name: merged[f"master/{name}"] for name, _ in self.model.named_parameters()}
            )
            test_images = backend.to_device(self.dataset.test_images).astype(self.dtype)
            accuracy = evaluate(self.model, test_images, self.dataset.test_labels)
        accuracy = comm.allreduce_scalars([accuracy], "sum")[0]
        self.metrics.write({"test_accuracy": accuracy})
        self.metrics.close()
        self.log(
            f"done: {config.steps} steps, {self.skipped} skipped, test accuracy {accuracy:.4f}"
        )
        if comm.rank == 0:
            self._write_files(merged, events)
        comm.barrier()  # nobody leaves before the files are complete
        masters = {
            name[len("master/") :]: array
            for name, array in (merged or {}).items()
            if name.startswith("master/")
        }
        return {
            "history": self.history,
            "skipped": self.skipped,
            "test_accuracy": accuracy,
            "master_weights": masters,
        }

    def _write_files(self, merged, events):
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
            report.plot_history(config.plot, self.history)
            self.log(f"saved plot {config.plot}")
