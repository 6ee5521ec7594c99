"""PipelineStage's values pinned directly (minimp/parallel/pipeline/stage.py): what a new stage
holds, the chunk forward() runs by default, an empty step, the timing of the buffered sends, the
micro-batches peak_stored counts, and the sizes the schedule builders and the stage cutter take."""

import re
import signal

import numpy as np
import pytest

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp import functional as F
from minimp.parallel.pipeline.stage import PipelineStage
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.parallel.pipeline.schedules.actions import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
    gpipe,
    one_f_one_b,
)
from minimp.parallel.pipeline.split import StageChunk, split_counts
from minimp.parallel.topology import Topology

ROWS, WIDTH, CLASSES = 4, 3, 2


def mlp_layers(seed=0):
    rng = np.random.default_rng(seed)
    return [nn.Linear(WIDTH, 5, rng=rng), nn.ReLU(), nn.Linear(5, CLASSES, rng=rng)]


def on_one_rank(fn):
    """fn(Topology) on a one-rank simulated world (--pp 1): first and last stage at once."""
    return dist.simulate(1, lambda comm: fn(Topology(comm, dp=1, pp=1)))[0]


def one_stage(topology, layers=None, **options):
    return PipelineStage(
        layers if layers is not None else mlp_layers(), topology,
        input_shape=(ROWS, WIDTH), output_shape=(ROWS, CLASSES), dtype=np.float32,
        loss_fn=F.cross_entropy, **options,
    )


def half_of_the_mlp(topology, **options):
    """This rank's half of the MLP on --pp 2: (Linear, ReLU) on stage 0, the last Linear on 1."""
    layers, first = mlp_layers(), topology.stage == 0
    return PipelineStage(
        layers[:2] if first else layers[2:], topology,
        input_shape=(ROWS, WIDTH) if first else (ROWS, 5),
        output_shape=(ROWS, 5) if first else (ROWS, CLASSES), dtype=np.float32,
        loss_fn=F.cross_entropy, **options,
    )


def data(micro_batches, seed=1):
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal((ROWS, WIDTH)).astype(np.float32) for _ in range(micro_batches)]
    targets = [rng.integers(0, CLASSES, ROWS) for _ in range(micro_batches)]
    return inputs, targets


# ----- a new stage ----------------------------------------------------------------------------
def test_a_new_stage_lists_every_chunks_groups_in_chunk_order():
    """stage.groups: chunk 0's groups (a Linear with the ReLU after it, then the last Linear),
    then the further chunk's."""
    more = StageChunk([nn.Linear(CLASSES, CLASSES, rng=np.random.default_rng(2))],
                      (ROWS, CLASSES), (ROWS, CLASSES))

    def body(topology):
        stage = one_stage(topology, more_chunks=[more])
        first = stage.chunks[0].layers
        return stage.groups, [[first[0], first[1]], [first[2]], more.layers]

    groups, expected = on_one_rank(body)
    assert groups == expected


def test_a_new_stage_has_held_nothing_yet():
    """Before its first step a stage has stored no micro-batch and kept no activation bytes:
    peak_stored 0 (not 1), activation_bytes an empty dict, peak_activation_bytes the int 0."""
    stage = on_one_rank(one_stage)
    assert stage.peak_stored == 0
    assert stage.activation_bytes == {} and isinstance(stage.activation_bytes, dict)
    assert stage.peak_activation_bytes == 0 and type(stage.peak_activation_bytes) is int


# ----- forward ----------------------------------------------------------------------------------
def test_forward_without_a_chunk_runs_chunk_zero():
    """forward(x) is forward(x, chunk=0): the rank's first chunk, not its second."""
    more = StageChunk([nn.Linear(CLASSES, 7, rng=np.random.default_rng(3))],
                      (ROWS, CLASSES), (ROWS, 7))
    x = np.random.default_rng(4).standard_normal((ROWS, WIDTH)).astype(np.float32)

    def body(topology):
        stage = one_stage(topology, more_chunks=[more])
        return stage.forward(Tensor(x)).data, stage.forward(Tensor(x), 0).data

    default, chunk_zero = on_one_rank(body)
    assert default.shape == (ROWS, CLASSES)
    assert np.array_equal(default, chunk_zero)


# ----- run --------------------------------------------------------------------------------------
def test_an_empty_step_returns_zero_loss_and_resets_the_activation_peak():
    """A step with no actions (a rank with nothing to do) returns 0.0 and reports a peak of 0
    activation bytes, even after a step that kept some: the peak starts at 0 each step."""
    inputs, targets = data(1)

    def body(topology):
        stage = one_stage(topology)
        steps = dict(inputs=inputs, targets=targets, scale_loss=lambda loss: loss,
                     after_backward=lambda: None)
        stage.run([Action(FORWARD, 0), Action(BACKWARD, 0)], **steps)
        after_work = stage.peak_activation_bytes
        loss = stage.run([], **steps)
        return after_work, loss, stage.peak_activation_bytes

    after_work, loss, empty_peak = on_one_rank(body)
    assert after_work > 1
    assert loss == 0.0 and empty_peak == 0


def test_waiting_for_buffered_sends_is_recorded_with_its_start_and_end_times():
    """With buffered sends, the wait for them at the end of the step is recorded as
    ("wait_sends", -1, start, end): two perf_counter floats, start <= end."""
    inputs, targets = data(2)
    schedule = gpipe(2, 2)

    def body(comm):
        topology = Topology(comm, dp=1, pp=2)
        stage = half_of_the_mlp(topology, buffered_sends=True)
        records = []
        stage.run(schedule[topology.stage], inputs=inputs, targets=targets,
                  scale_loss=lambda loss: loss, after_backward=lambda: None,
                  record=lambda *entry: records.append(entry))
        return records

    for records in dist.simulate(2, body):
        waits = [entry for entry in records if entry[0] == "wait_sends"]
        assert len(waits) == 1 and records[-1] is waits[0]
        _, micro_batch, start, end = waits[0]
        assert micro_batch == -1
        assert type(start) is float and type(end) is float and start <= end


def test_a_micro_batch_whose_backward_ran_no_longer_counts_as_stored():
    """peak_stored counts micro-batches from their forward until their backward: on the last
    stage, a micro-batch whose backward ran but whose gradient has not left yet holds no
    activations, so a forward then makes 1 stored, not 2. (The first stage holds both.)"""
    inputs, targets = data(2)
    schedule = [
        [Action(FORWARD, 0), Action(SEND_FORWARD, 0), Action(FORWARD, 1), Action(SEND_FORWARD, 1),
         Action(RECV_BACKWARD, 0), Action(BACKWARD, 0), Action(RECV_BACKWARD, 1),
         Action(BACKWARD, 1)],
        [Action(RECV_FORWARD, 0), Action(FORWARD, 0), Action(BACKWARD, 0), Action(RECV_FORWARD, 1),
         Action(FORWARD, 1), Action(SEND_BACKWARD, 0), Action(BACKWARD, 1),
         Action(SEND_BACKWARD, 1)],
    ]

    def body(comm):
        topology = Topology(comm, dp=1, pp=2)
        stage = half_of_the_mlp(topology)
        stage.run(schedule[topology.stage], inputs=inputs, targets=targets,
                  scale_loss=lambda loss: loss, after_backward=lambda: None)
        return stage.peak_stored

    assert dist.simulate(2, body) == [2, 1]


def test_a_backward_whose_forward_kept_no_bytes_still_runs():
    """Weightless layers on a fixed input keep no graph (no activation bytes are recorded), yet
    scale_loss may hand back a tensor that needs a backward: the step runs it and forgets the
    micro-batch's (absent) bytes without a KeyError."""
    inputs, targets = data(1)
    weight = Tensor(np.float32(2.0), requires_grad=True)
    backwards = []

    def body(topology):
        stage = PipelineStage([nn.ReLU()], topology, input_shape=(ROWS, WIDTH),
                              output_shape=(ROWS, WIDTH), dtype=np.float32,
                              loss_fn=F.cross_entropy)
        loss = stage.run([Action(FORWARD, 0), Action(BACKWARD, 0)], inputs=inputs,
                         targets=[t % WIDTH for t in targets],
                         scale_loss=lambda loss: loss * weight,
                         after_backward=lambda: backwards.append(1))
        return loss, stage.activation_bytes

    loss, kept = on_one_rank(body)
    assert loss > 0 and kept == {}
    assert backwards == [1] and weight.grad is not None


# ----- schedules and stages -----------------------------------------------------------------
def test_build_schedule_defaults_to_one_virtual_stage():
    """build_schedule(name, P, M) is the schedule with V = 1: interleaved then uses one chunk a
    rank (every action on chunk 0), as interleaved(P, M, 1) does."""
    schedule = build_schedule("interleaved", 2, 4)
    assert schedule == build_schedule("interleaved", 2, 4, 1)
    assert {action.chunk for actions in schedule for action in actions} == {0}


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("stages, micro_batches", [(0, 3), (2, 0)])
def test_gpipe_and_1f1b_refuse_zero_sizes_with_a_message(build, stages, micro_batches):
    message = (f"a schedule needs stages >= 1 and micro_batches >= 1, got {stages}, "
               f"{micro_batches}")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build(stages, micro_batches)


def test_stage_cuts_are_found_for_counts_past_float_precision():
    """The search for the cheapest largest stage bisects integers: parameter counts above 2**53
    (where floats lose units) still give the exact cut, at once (a float midpoint never ends)."""

    def too_slow(signum, frame):
        raise TimeoutError("split_counts did not finish within 2 s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        cuts = split_counts([2**53 + 1, 2**53], 2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert cuts == [(0, 1), (1, 2)]
