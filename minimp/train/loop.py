"""The training loop of `python -m minimp.train`: build, (resume,) step, log, evaluate, save."""

import time

import numpy as np

from minimp import backend, functional, nn, optim
from minimp.data import DATASETS, global_batch_indices
from minimp.dist.comm import world
from minimp.dist.data_parallel import DataParallel, shard
from minimp.dist.topology import Topology
from minimp.function import no_grad
from minimp.precision import (ACTIVATION_DTYPES, DynamicLossScaler, NoLossScaler, StaticLossScaler,
                              mixed_precision_step)
from minimp.tensor import Tensor
from minimp.train import checkpoint, report


def build_model(features, classes, hidden, layers, rng):
    """MLP: features -> hidden (x layers, each Linear + ReLU) -> classes, float32, weights from rng."""
    modules, width = [], features
    for _ in range(layers):
        modules += [nn.Linear(width, hidden, rng=rng), nn.ReLU()]
        width = hidden
    modules.append(nn.Linear(width, classes, rng=rng))
    return nn.Sequential(*modules)


def build_optimizer(config, parameters):
    if config.optimizer == "sgd":
        return optim.SGD(parameters, lr=config.lr, momentum=config.momentum,
                         weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    return optim.Adam(parameters, lr=config.lr, weight_decay=config.weight_decay)


def build_scaler(config):
    kind, value = config.loss_scale_kind()
    if kind == "dynamic":
        return DynamicLossScaler(growth_interval=config.loss_scale_growth_interval)
    if kind == "static":
        return StaticLossScaler(value)
    return NoLossScaler()


def evaluate(model, images, labels, batch_size=512):
    """Fraction of correctly classified samples (forward only, in the model's compute dtype)."""
    correct = 0
    with no_grad():
        for start in range(0, len(labels), batch_size):
            logits = model(Tensor(images[start:start + batch_size])).data
            predictions = backend.to_numpy(logits.astype(np.float32).argmax(axis=1))
            correct += int((predictions == labels[start:start + batch_size]).sum())
    return correct / len(labels)


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
    test accuracy and the final masters. `comm` defaults to the MPI world (size 1 under plain python)."""
    comm = comm or world()
    threads = config.threads or max(1, backend.available_cores() // comm.ranks_on_this_node())
    # Overflow to inf in float16 is expected and handled (skipped steps): no NumPy warning per cast.
    with backend.limit_cpu_threads(threads), np.errstate(over="ignore", invalid="ignore"):
        return _train(config, log, comm)


def _train(config, log, comm):
    if config.device:
        backend.use_device(config.device)
    rank, dp = comm.rank, config.replicas(comm.size)
    log = log if rank == 0 else (lambda line: None)
    topology = Topology(comm, dp=dp, pp=1)
    dataset = DATASETS[config.dataset]()
    if config.batch_size > len(dataset.train_labels):
        raise ValueError(f"--batch-size {config.batch_size} is larger than the training set "
                         f"({len(dataset.train_labels)} samples)")
    dtype = ACTIVATION_DTYPES[config.precision]
    model = build_model(dataset.features, dataset.classes, config.hidden, config.layers,
                        np.random.default_rng(config.seed))
    optimizer = build_optimizer(config, model.parameters())  # masters copied from the fp32 init
    model.to(dtype)  # the compute copies
    scaler = build_scaler(config)
    names = [name for name, _ in model.named_parameters()]
    model_shape = {"dataset": config.dataset, "layers": config.layers, "hidden": config.hidden}
    start_step = 0
    if config.resume:
        start_step = checkpoint.restore(config.resume, seed=config.seed, model_shape=model_shape,
                                        names=names, optimizer=optimizer, scaler=scaler)
        log(f"resumed from {config.resume} after step {start_step}")
    replicas = DataParallel(topology.dp_group, optimizer, bucket_mb=config.bucket_mb,
                            comm_dtype=ACTIVATION_DTYPES[config.grad_comm_dtype],
                            average=config.grad_average)
    replicas.broadcast_parameters()
    # The whole (small) training set lives on the device in the compute dtype: no per-step casts.
    train_images = backend.to_device(dataset.train_images).astype(dtype)
    train_labels = backend.to_device(dataset.train_labels)
    overflow_at, fault_at = config.overflow_injection(comm.size), config.fault_injection(comm.size)
    metrics = report.MetricsWriter(config.metrics if rank == 0 else "", append=bool(config.resume))
    communication = _Timer()
    reduce_gradients = communication.wrap(replicas.reduce_gradients)
    reduce_found_inf = communication.wrap(replicas.reduce_found_inf)
    mean_over_replicas = communication.wrap(lambda value: comm.allreduce_scalars([value], "sum")[0] / dp)
    history, skipped_total, window_start, window_samples = [], 0, time.perf_counter(), 0
    micro_size = config.batch_size // dp // config.micro_batches
    for step in range(start_step + 1, config.steps + 1):
        step_start, communication.seconds = time.perf_counter(), 0.0
        bytes_before = topology.dp_group.bytes_sent
        indices = global_batch_indices(config.seed, step, config.batch_size, len(dataset.train_labels))
        local = shard(indices, topology.dp_rank, dp)
        loss_sum = 0.0
        for micro in range(config.micro_batches):
            rows = backend.to_device(local[micro * micro_size:(micro + 1) * micro_size])
            loss = functional.cross_entropy(model(Tensor(train_images[rows])), Tensor(train_labels[rows]))
            loss_sum += loss.item()
            # Each micro-batch contributes 1/M of the batch-mean gradient; the scale makes fp16 grads big.
            (scaler.scale(loss) * (1.0 / config.micro_batches)).backward()
            optimizer.accumulate_gradients()
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
        step_loss = mean_over_replicas(loss_sum / config.micro_batches)
        record = {"step": step, "loss": step_loss, "loss_scale": result.loss_scale,
                  "skipped": result.skipped,
                  "compute_seconds": time.perf_counter() - step_start - communication.seconds,
                  "communication_seconds": communication.seconds,
                  "bytes_sent": topology.dp_group.bytes_sent - bytes_before}
        history.append(record)
        metrics.write(record)
        window_samples += config.batch_size
        if step % config.log_every == 0 or step == config.steps:
            elapsed = time.perf_counter() - window_start
            log(report.progress_line(step, config.steps, step_loss, scaler.loss_scale, skipped_total,
                                     window_samples / max(elapsed, 1e-9)))
            window_start, window_samples = time.perf_counter(), 0
    test_images = backend.to_device(dataset.test_images).astype(dtype)
    accuracy = evaluate(model, test_images, dataset.test_labels)
    metrics.write({"test_accuracy": accuracy})
    metrics.close()
    log(f"done: {config.steps} steps, {skipped_total} skipped, test accuracy {accuracy:.4f}")
    if config.save:
        if rank == 0:
            checkpoint.save(config.save, step=config.steps, seed=config.seed, model_shape=model_shape,
                            names=names, optimizer=optimizer, scaler=scaler)
            log(f"saved checkpoint {config.save}")
        comm.barrier()  # nobody leaves before the file is complete
    if config.plot and rank == 0:
        report.plot_history(config.plot, history)
        log(f"saved plot {config.plot}")
    return {"history": history, "skipped": skipped_total, "test_accuracy": accuracy,
            "master_weights": {n: backend.to_numpy(m) for n, m in zip(names, optimizer.master_weights)}}
