"""The pipeline's message tags, read from the simulated world's message trace: the layout
minimp/parallel/pipeline/stage.py's FIRST_TAG and minimp/train/checks.py promise."""

from collections import Counter

from minimp import distributed as dist
from minimp.parallel.pipeline.stage import FIRST_TAG
from minimp.train import TrainConfig
from minimp.train.loop import Run

STAGES, VIRTUAL_STAGES, MICRO_BATCHES = 2, 2, 4


def one_interleaved_step():
    """The message trace of one interleaved step: --pp 2, two chunks a rank, four micro-batches."""
    config = TrainConfig(hidden=32, layers=3, batch_size=32, precision="fp32", steps=1)
    config.pp, config.schedule = STAGES, "interleaved"
    config.virtual_stages, config.micro_batches = VIRTUAL_STAGES, MICRO_BATCHES
    config.validate(STAGES)

    def body(comm):
        Run(config, comm, log=lambda line: None).step(1)

    return dist.simulate(STAGES, body).trace


def test_every_pipeline_message_has_a_tag_of_its_own_in_the_promised_range():
    """Each of the P x V - 1 boundaries between virtual stages carries one activation and one
    gradient per micro-batch; no two messages to one rank share a tag (so receives posted in any
    order match the right send). Pipeline tags start at FIRST_TAG, above protocol.Tag's, and
    train/checks.py refuses a run only when FIRST_TAG + 2 x V x M passes MPI's 32767: every tag of
    a step lies below that."""
    trace = one_interleaved_step()
    boundaries = STAGES * VIRTUAL_STAGES - 1
    assert len(trace) == 2 * boundaries * MICRO_BATCHES
    per_receiver = Counter((message.dest, message.tag) for message in trace)
    assert set(per_receiver.values()) == {1}, per_receiver
    tags = [message.tag for message in trace]
    assert all(type(tag) is int for tag in tags), tags
    end = FIRST_TAG + 2 * VIRTUAL_STAGES * MICRO_BATCHES
    assert FIRST_TAG <= min(tags) and max(tags) < end, (min(tags), max(tags), end)
