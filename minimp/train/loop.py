"""The training loop of `python -m minimp.train`: build this rank's stage, (resume,) step, log, save.

Every rank builds the whole float32 model from the seed, keeps the layers of its pipeline stage, and
runs the schedule's actions for that stage each step (with one stage, the schedule is the plain
micro-batch loop). Data-parallel replicas of a stage then average their gradients; every rank of the
job takes part in the one decision to skip an overflowing step.
"""

import json
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


class _Timer:
    """Seconds spent inside wrapped calls (the communication hooks), summed."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, function):
        def timed(*args):
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def train(config, log=print, comm=None):
    """Run the configured training on this process's rank; returns a dict with history, skipped count,
    test accuracy and the masters (all stages' on rank 0). `comm` defaults to the MPI world."""
    comm = comm or world()
    threads = config.threads or max(1, backend.available_cores() // comm.ranks_on_this_node())
    # Overflow to inf in float16 is expected and handled (skipped steps): no NumPy warning per cast.
    with backend.limit_cpu_threads(threads), np.errstate(over="ignore", invalid="ignore"):
        return _train(config, log, comm)


def _train(config, log, comm):
    if config.device:
        backend.use_device(config.device, local_rank=comm.node_rank_and_size()[0])
    rank, dp = comm.rank, config.replicas(comm.size)
    log = log if rank == 0 else (lambda line: None)
    topology = Topology(comm, dp=dp, pp=config.pp)
    dataset = DATASETS[config.dataset]()
    if config.batch_size > len(dataset.train_labels):
        raise ValueError(f"--batch-size {config.batch_size} is larger than the training set "
                         f"({len(dataset.train_labels)} samples)")
    dtype = ACTIVATION_DTYPES[config.precision]
    model = build_model(dataset.features, dataset.classes, config.hidden, config.layers,
                        np.random.default_rng(config.seed))
    layers, named, input_width, output_width = stage_of(model, config.pp, topology.stage)
    names = [name for name, _ in named]
    optimizer = build_optimizer(config, [p for _, p in named])  # masters copied from the fp32 init
    model.to(dtype)  # the compute copies
    scaler = build_scaler(config)
    model_shape = {"dataset": config.dataset, "layers": config.layers, "hidden": config.hidden}
    start_step = 0
    if config.resume:
        start_step = checkpoint.restore(config.resume, seed=config.seed, model_shape=model_shape,
                                        names=names, optimizer=optimizer, scaler=scaler)
        log(f"resumed from {config.resume} after step {start_step}")
    replicas = DataParallel(topology.dp_group, optimizer, bucket_mb=config.bucket_mb,
                            comm_dtype=ACTIVATION_DTYPES[config.grad_comm_dtype],
                            average=config.grad_average, decision_comm=comm)
    replicas.broadcast_parameters()
    micro_batches = config.micro_batches
    micro_rows = config.batch_size // dp // micro_batches
    stage = PipelineStage(layers, topology.pp_group, topology.stage, config.pp, input_width, output_width,
                          dtype, micro_rows)
    actions = SCHEDULES[config.schedule](config.pp, micro_batches)[topology.stage]
    # The whole (small) training set lives on the device in the compute dtype: no per-step casts.
    train_images = backend.to_device(dataset.train_images).astype(dtype)
    train_labels = backend.to_device(dataset.train_labels)
    overflow_at, fault_at = config.overflow_injection(comm.size), config.fault_injection(comm.size)
    metrics = report.MetricsWriter(config.metrics if rank == 0 else "", append=bool(config.resume))
    communication = _Timer()
    reduce_gradients = communication.wrap(replicas.reduce_gradients)
    reduce_found_inf = communication.wrap(replicas.reduce_found_inf)
    sum_over_ranks = communication.wrap(lambda value: comm.allreduce_scalars([value], "sum")[0])
    timeline = []
    history, skipped_total, window_start, window_samples = [], 0, time.perf_counter(), 0

    def scale_loss(loss):  # each micro-batch carries 1/M of the batch mean; the scale lifts fp16 grads
        return scaler.scale(loss) * (1.0 / micro_batches)

    for step in range(start_step + 1, config.steps + 1):
        if config.timeline:
            comm.barrier()  # a common start, so the stages' clocks line up in the timeline
        step_start, communication.seconds = time.perf_counter(), 0.0
        bytes_before = topology.dp_group.bytes_sent + topology.pp_group.bytes_sent
        indices = global_batch_indices(config.seed, step, config.batch_size, len(dataset.train_labels))
        rows = [backend.to_device(part) for part in np.split(shard(indices, topology.dp_rank, dp), micro_batches)]
        record = None
        if config.timeline and topology.dp_rank == 0:
            def record(kind, mb, start, end, step=step):
                timeline.append([step, kind == "backward", mb, start - step_start, end - step_start])
        loss_sum = stage.run(actions, [train_images[r] for r in rows] if stage.first else None,
                             [train_labels[r] for r in rows] if stage.last else None, scale_loss,
                             optimizer.accumulate_gradients, record)
        if fault_at == (step, rank):
            raise RuntimeError(f"injected fault at step {step} on rank {rank} (--inject-fault)")
        if overflow_at == (step, rank):
            optimizer.master_gradients[0].reshape(-1)[0] = np.inf  # as if backward had overflowed
        result = mixed_precision_step(optimizer, scaler, max_grad_norm=config.max_grad_norm or None,
                                      reduce_gradients=reduce_gradients, reduce_found_inf=reduce_found_inf)
        skipped_total += result.skipped
        if scaler.hit_min_scale:
            log(f"step {step}: gradients overflow at the minimum loss scale {scaler.loss_scale:g}; "
                "training is diverging in fp16 (lower --lr, clip with --max-grad-norm, or use bf16)")
        if config.check_replicas and step % config.check_replicas == 0:
            communication.wrap(replicas.check_replicas)()
        step_loss = sum_over_ranks(loss_sum / micro_batches / dp if stage.last else 0.0)
        entry = {"step": step, "loss": step_loss, "loss_scale": result.loss_scale, "skipped": result.skipped,
                 "compute_seconds": time.perf_counter() - step_start - communication.seconds,
                 "communication_seconds": communication.seconds,
                 "bytes_sent": topology.dp_group.bytes_sent + topology.pp_group.bytes_sent - bytes_before}
        history.append(entry)
        metrics.write(entry)
        window_samples += config.batch_size
        if step % config.log_every == 0 or step == config.steps:
            elapsed = time.perf_counter() - window_start
            log(report.progress_line(step, config.steps, step_loss, scaler.loss_scale, skipped_total,
                                     window_samples / max(elapsed, 1e-9)))
            window_start, window_samples = time.perf_counter(), 0
    return _finish(config, log, comm, topology, model, names, optimizer, scaler, model_shape, dataset,
                   dtype, metrics, history, skipped_total, timeline, stage.peak_stored)


def _finish(config, log, comm, topology, model, names, optimizer, scaler, model_shape, dataset, dtype,
            metrics, history, skipped_total, timeline, peak_stored):
    """Gather every stage onto rank 0; evaluate, save the checkpoint, the timeline and the plot there."""
    merged = None
    if topology.dp_rank == 0:  # replicas are identical: replica 0's stages speak for all
        merged = gather_named_arrays(topology.pp_group, checkpoint.state_arrays(names, optimizer))
        events = gather_named_arrays(topology.pp_group, {
            f"stage{topology.stage}": np.array(timeline, np.float64).reshape(-1, 5),
            f"peak{topology.stage}": np.array([peak_stored], np.int64)})
    accuracy = 0.0
    if comm.rank == 0:
        model.load_state_dict({name: merged[f"master/{name}"] for name, _ in model.named_parameters()})
        accuracy = evaluate(model, backend.to_device(dataset.test_images).astype(dtype), dataset.test_labels)
    accuracy = comm.allreduce_scalars([accuracy], "sum")[0]
    metrics.write({"test_accuracy": accuracy})
    metrics.close()
    log(f"done: {config.steps} steps, {skipped_total} skipped, test accuracy {accuracy:.4f}")
    if comm.rank == 0:
        if config.save:
            checkpoint.save(config.save, step=config.steps, seed=config.seed, model_shape=model_shape,
                            optimizer=optimizer, scaler=scaler, arrays=merged)
            log(f"saved checkpoint {config.save}")
        if config.timeline:
            _write_timeline(config, events)
            log(f"saved timeline {config.timeline}")
        if config.plot:
            report.plot_history(config.plot, history)
            log(f"saved plot {config.plot}")
    comm.barrier()  # nobody leaves before the files are complete
    masters = {name[len("master/"):]: array for name, array in (merged or {}).items() if name.startswith("master/")}
    return {"history": history, "skipped": skipped_total, "test_accuracy": accuracy, "master_weights": masters}


def _write_timeline(config, events):
    """One JSON file: every forward and backward of replica 0, per stage, in seconds from its step's start."""
    rows, peaks = [], {}
    for key, array in sorted(events.items()):
        if key.startswith("peak"):
            peaks[int(key[len("peak"):])] = int(array[0])
            continue
        for step, backward, mb, start, end in array.tolist():
            rows.append({"stage": int(key[len("stage"):]), "step": int(step), "micro_batch": int(mb),
                         "kind": "backward" if backward else "forward", "start": start, "end": end})
    with open(config.timeline, "w") as file:
        json.dump({"schedule": config.schedule, "stages": config.pp, "micro_batches": config.micro_batches,
                   "peak_stored_micro_batches": [peaks[s] for s in sorted(peaks)], "events": rows}, file)
