"""What a run leaves behind: its stages gathered onto rank 0, checkpoints (at the end and every
--save-every steps), the test accuracy, the timeline and the plot.

Every function here is called by every rank of the job (the gathers are collectives); only rank 0
writes files. Checkpoints are gathered into the one-process format (the same array names whatever
the layout), so any layout resumes any other.
"""

from typing import Any

import numpy as np

from minimp import backend
from minimp.distributed import gather_named_arrays
from minimp.train import checkpoint, report
from minimp.train.build import evaluate


def gather_state(run: Any) -> dict | None:
    """Replica 0's stages send their masters and optimizer slots to rank 0 (replicas are
    identical, so replica 0 speaks for all); None on every other rank."""
    if run.topology.dp_rank != 0:
        return None
    state = checkpoint.state_arrays(run.names, run.optimizer)
    return gather_named_arrays(run.topology.pp_group, state)


def save_checkpoint(run: Any, step: int, merged: dict | None = None) -> None:
    """Write --save as of `step` (all ranks call this; `merged` if already gathered)."""
    merged = gather_state(run) if merged is None else merged
    if run.comm.rank == 0:
        checkpoint.save(
            run.config.save,
            step=step,
            flags=run.resume_flags,
            optimizer=run.optimizer,
            scaler=run.scaler,
            arrays=merged,
        )
        run.log(f"saved checkpoint {run.config.save} after step {step}")


def finish(run: Any) -> dict:
    """Gather every stage onto rank 0; evaluate, save the checkpoint, the timeline and the plot
    there; returns the run's summary (history, skipped count, test accuracy, rank 0's masters)."""
    config = run.config
    merged = gather_state(run)
    events = _gather_timeline(run)
    accuracy = _test_accuracy(run, merged)
    run.history.close({"test_accuracy": accuracy})
    skipped = run.history.skipped
    run.log(f"done: {config.steps} steps, {skipped} skipped, test accuracy {accuracy:.4f}")
    if config.save:
        save_checkpoint(run, config.steps, merged)
    if run.comm.rank == 0:
        _write_reports(run, events)
    run.comm.barrier()  # nobody leaves before the files are complete
    masters = {
        name[len("master/") :]: array
        for name, array in (merged or {}).items()
        if name.startswith("master/")
    }
    return {
        "history": run.history.records,
        "skipped": skipped,
        "test_accuracy": accuracy,
        "master_weights": masters,
    }


def _gather_timeline(run: Any) -> dict | None:
    topology = run.topology
    if topology.dp_rank != 0:
        return None
    timeline = {
        f"stage{topology.stage}": run.timeline.array(),
        f"peak{topology.stage}": np.array([run.stage.peak_stored], np.int64),
    }
    return gather_named_arrays(topology.pp_group, timeline)


def _test_accuracy(run: Any, merged: dict | None) -> float:
    """Rank 0 evaluates the whole model on the test set; every rank returns its accuracy."""
    accuracy = 0.0
    if run.comm.rank == 0:
        run.model.load_state_dict(
            {name: merged[f"master/{name}"] for name, _ in run.model.named_parameters()}
        )
        test_images = backend.to_device(run.dataset.test_images).astype(run.dtype)
        accuracy = evaluate(run.model, test_images, run.dataset.test_labels)
    return float(run.comm.allreduce_scalars([accuracy], "sum")[0])


def _write_reports(run: Any, events: dict) -> None:
    config = run.config
    if config.timeline:
        report.write_timeline(
            config.timeline, config.schedule, config.pp, config.micro_batches, events
        )
        run.log(f"saved timeline {config.timeline}")
    if config.plot:
        report.plot_history(config.plot, run.history.records)
        run.log(f"saved plot {config.plot}")
