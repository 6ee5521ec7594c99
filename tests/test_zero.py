"""ZeRO stages 1-3 through the trainer on the simulated world: the training of --zero 0, the same
skipped step, memory and bytes equal to the formulas, checkpoints in the one-process format, the
GPT's tied embedding, and the flags it refuses."""

import numpy as np
import pytest
from test_train_gpt import TINY, assert_same_weights

from minimp import distributed as dist
from minimp.parallel.zero.formulas import bytes_sent_formula, memory_formula, peak_formula
from minimp.train import TrainConfig, saving, train
from minimp.checkpoints.errors import ConfigError
from minimp.train.loop import Run
from minimp.train.sizes import zero_unit_sizes

SMALL = dict(hidden=32, layers=2, batch_size=32, log_every=1000)


def simulated_config(world_size, **overrides):
    config = TrainConfig(**{**SMALL, **overrides})
    config.validate(world_size)
    return config


def simulated(world_size, **overrides):
    """Every rank's result of a training run on the simulated world."""
    config = simulated_config(world_size, **overrides)
    return dist.simulate(world_size, lambda comm: train(config, log=lambda line: None, comm=comm))


def same_bits(a, b):
    return all(a[name].tobytes() == b[name].tobytes() for name in a)


@pytest.fixture(scope="module")
def replicated():
    return simulated(2, precision="fp32", steps=10)[0]["master_weights"]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fp32_on_two_replicas_is_bit_identical_to_zero_0(replicated, zero):
    """Two replicas add each element's two halves in one addition, whatever the layout, and the
    update is elementwise: the same bits as data parallelism."""
    sharded = simulated(2, precision="fp32", steps=10, zero=zero)
    assert same_bits(sharded[0]["master_weights"], replicated)



def test_stage_1_averaging_after_the_reduce_scatter_gives_the_same_bits(replicated):
    """--grad-average after: each chunk of the float32 sums is times 1/2 once it arrives (exact,
    as the halving before the reduce-scatter is), so the masters are data parallelism's bits."""
    sharded = simulated(2, precision="fp32", steps=10, zero=1, grad_average="after")
    assert same_bits(sharded[0]["master_weights"], replicated)

@pytest.mark.parametrize("zero", [2, 3])
def test_one_replica_under_zero_2_and_3_trains_as_zero_0(zero):
    """With one replica a unit's chunk is the whole unit: its gradients are concatenated and
    added into the float32 sums with no collective, and the update is the plain one, bit for bit."""
    alone = simulated(1, precision="fp32", steps=3)[0]["master_weights"]
    sharded = simulated(1, precision="fp32", steps=3, zero=zero)[0]["master_weights"]
    assert same_bits(sharded, alone)


def test_four_replicas_and_micro_batches_agree_to_float32_rounding():
    """Four replicas add four terms in an order set by the chunk an element falls in (ZeRO cuts
    layer by layer, data parallelism one bucket); stages 2-3 average every micro-batch before
    adding them up: the last bits differ, nothing more."""
    flags = dict(precision="fp32", steps=10, micro_batches=2)
    replicated = simulated(4, **flags)[0]["master_weights"]
    for zero in (1, 2, 3):
        sharded = simulated(4, zero=zero, **flags)[0]["master_weights"]
        for name, array in sharded.items():
            np.testing.assert_allclose(array, replicated[name], rtol=1e-6, atol=1e-7)


def test_an_injected_overflow_skips_the_same_step_in_every_stage():
    flags = dict(steps=5, inject_overflow="3:1", loss_scale_growth_interval=2)
    runs = [simulated(2, zero=zero, **flags)[0] for zero in range(4)]
    for run in runs:
        assert [r["skipped"] for r in run["history"]] == [False, False, True, False, False]
        assert [r["loss_scale"] for r in run["history"]] == [
            r["loss_scale"] for r in runs[0]["history"]
        ]
        assert same_bits(run["master_weights"], runs[0]["master_weights"])  # fp16, M = 1


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_memory_and_bytes_sent_equal_the_formulas(world_size):
    """Every rank, every kind, every collective, and the peak inside a step; uneven chunks (the
    MLP's units have 2080, 1056 and 330 elements), fp16 compute, fp32 wire, Adam, two
    micro-batches. With overlap ZeRO's rings in flight hold send and receive buffers of their
    own inside the step, which the peak formula leaves out: it is exact without overlap."""
    config = TrainConfig(**SMALL)
    units = zero_unit_sizes(config)[0]
    for zero, overlap in [(zero, overlap) for zero in range(4) for overlap in (True, False)]:
        results = simulated(world_size, steps=2, micro_batches=2, zero=zero, overlap=overlap)
        for rank, result in enumerate(results):
            expected = memory_formula(
                zero,
                unit_sizes=units,
                rank=rank,
                world_size=world_size,
                compute_bytes=2,
                wire_bytes=4,
                slots=2,
            )
            assert result["model_state_by_kind"][rank] == expected, (zero, rank)
            assert result["model_state_bytes"][rank] == sum(expected.values())
            peak = peak_formula(zero, unit_sizes=units, compute_bytes=2)
            if zero == 0 or not overlap or world_size == 1:
                assert result["peak_model_state_bytes"][rank] == sum(expected.values()) + peak
            else:  # how many rings are in flight at a sample depends on the other ranks' pace
                assert result["peak_model_state_bytes"][rank] >= sum(expected.values()) + peak
            sent = bytes_sent_formula(
                zero,
                sizes=[sum(units)] if zero == 0 else units,
                rank=rank,
                world_size=world_size,
                micro_batches=2,
                compute_bytes=2,
                wire_bytes=4,
            )
            measured = result["history"][-1]["bytes_by_collective"]
            assert {k: v for k, v in measured.items() if v} == sent, (zero, rank)
            assert result["history"][-1]["bytes_sent"] == sum(sent.values())


def test_a_zero_3_checkpoint_of_four_replicas_resumes_on_one_process_and_back(tmp_path):
    fp32 = dict(precision="fp32")
    straight = simulated(1, steps=10, **fp32)[0]["master_weights"]
    simulated(4, steps=5, zero=3, save=str(tmp_path / "z3.npz"), **fp32)
    resumed = simulated(1, steps=10, resume=str(tmp_path / "z3.npz"), **fp32)[0]
    simulated(1, steps=5, save=str(tmp_path / "one.npz"), **fp32)
    back = simulated(4, steps=10, zero=3, resume=str(tmp_path / "one.npz"), **fp32)[0]
    for result in (resumed, back):
        for name, array in result["master_weights"].items():
            np.testing.assert_allclose(array, straight[name], rtol=1e-5, atol=1e-7)
    with np.load(tmp_path / "z3.npz") as sharded, np.load(tmp_path / "one.npz") as whole:
        assert sharded.files == whole.files  # the same names, in the same order


def run_steps(world_size, **overrides):
    """Every rank's history and rank 0's masters after the GPT's steps, on the simulated world
    (no final evaluation of the whole validation split: seconds that test nothing here)."""
    config = TrainConfig(**{**TINY, **overrides})
    config.validate(world_size)

    def body(comm):
        training = Run(config, comm, log=lambda line: None)
        for step in range(1, config.steps + 1):
            training.step(step)
        merged = saving.gather_state(training) or {}
        masters = {n[len("master/") :]: a for n, a in merged.items() if n.startswith("master/")}
        return {"history": training.history.records, "master_weights": masters}

    return dist.simulate(world_size, body, eager_limit=0)


def test_the_gpt_with_stage_3_dropout_and_recomputation_trains_as_one_process():
    """Stage 3 gathers the token embedding for the embeddings and again for the head (two layers
    read it) and once for backward: (2 + 1) all-gathers of it per micro-batch."""
    alone = run_steps(1, dropout=0.2, steps=4)[0]
    results = run_steps(2, dp=2, dropout=0.2, zero=3, recompute=True, micro_batches=2, steps=4)
    assert_same_weights(results[0]["master_weights"], alone["master_weights"], steps=4)
    units = zero_unit_sizes(TrainConfig(**TINY))[0]  # [wte, wpe, block, block, ln_f]
    for rank, result in enumerate(results):
        sent = bytes_sent_formula(
            3, sizes=units, rank=rank, world_size=2, micro_batches=2, compute_bytes=4,
            wire_bytes=4, readers=[2, 1, 1, 1, 1],
        )  # fmt: skip
        measured = result["history"][-1]["bytes_by_collective"]
        assert {k: measured[k] for k in sent} == sent


@pytest.mark.parametrize("zero", [2, 3])
def test_the_tied_embedding_s_chunks_stay_identical_across_the_pipeline(zero):
    """--dp 2 --pp 2: each replica's first and last stage hold the same chunk of the token
    embedding (a unit of its own on both) and sum its gradient before updating it."""
    config = TrainConfig(**{**TINY, "dp": 2, "pp": 2, "zero": zero, "steps": 4})
    config.validate(4)

    def body(comm):
        run = Run(config, comm, log=lambda line: None)
        for step in range(1, config.steps + 1):
            run.step(step)
        optimizer, index = run.optimizer, run.names.index("0.wte.weight")
        unit = optimizer.layout.unit_of()[index]
        return optimizer.masters[unit].copy(), optimizer.slots[unit][0]["exp_avg"].copy()

    first, first_1, last, last_1 = dist.simulate(4, body)  # ranks (stage, dp): 00 01 10 11
    for a, b in ((first, last), (first_1, last_1)):
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        (dict(zero=5), 1, "--zero must be 0, 1, 2 or 3"),
        (dict(zero=-1), 1, "--zero must be 0 or more"),
        (dict(zero=float("nan")), 1, "--zero must be 0 or more, got nan"),
        (dict(recompute="yes"), 1, "--recompute is a switch"),
        (dict(zero=1, check_replicas=5), 2, "--check-replicas compares the replicas' masters"),
        (
            dict(zero=2, hidden=1, layers=1, pp=2, batch_size=42),
            42,
            "pipeline stage 1's largest layer has 20 parameters, so some ranks",
        ),
    ],
    ids=["stage-5", "negative", "nan", "recompute-yes", "check-replicas", "empty-shards"],
)
def test_zero_flags_that_cannot_work_are_refused_before_any_work(flags, world_size, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig(**{**SMALL, **flags}).validate(world_size)


def test_between_steps_stage_3_holds_no_compute_copy():
    """After a step every parameter is freed: a read-only broadcast of one NaN of its shape and
    compute dtype (one element of memory); no unit is counted, held or gathered."""

    def body(comm):
        plain = Run(simulated_config(2, steps=1), comm, log=lambda line: None)
        shapes = [parameter.shape for parameter in plain.model.parameters()]
        run = Run(simulated_config(2, steps=1, zero=3), comm, log=lambda line: None)
        run.step(1)
        gatherer = run.sync.gatherer
        for parameter, shape in zip(run.model.parameters(), shapes, strict=True):
            data = parameter.data
            assert data.shape == shape and data.dtype == np.float16
            assert np.isnan(data).all() and set(data.strides) == {0}
            assert not data.flags.writeable
        units = len(gatherer.counts)
        assert gatherer.counts == [0] * units and gatherer.holds == [0] * units
        assert gatherer.arrays_by_kind() == {"gathered": []} and units > 1
        return True

    assert dist.simulate(2, body) == [True, True]


def test_one_replica_under_stage_3_times_no_all_gather():
    """With one replica the gatherer copies its chunk (the whole unit) and sends nothing: no
    all-gather is counted or timed, so the step's report shows no communication that never ran."""

    def body(comm):
        run = Run(simulated_config(1, steps=1, zero=3), comm, log=lambda line: None)
        run.step(1)
        sent = run.sync.gatherer.sent
        return "all_gather" in sent.seconds, sent.by_collective.get("all_gather", 0)

    assert dist.simulate(1, body) == [(False, 0)]


def test_stage_3_runs_a_layer_it_holds_no_units_for_without_gathering():
    """A layer the gatherer was not given (one with no parameters of the stage's) reads no unit:
    it runs as it is, and nothing is gathered or held for it."""
    from minimp import Tensor

    def body(comm):
        run = Run(simulated_config(1, steps=1, zero=3), comm, log=lambda line: None)
        gatherer = run.sync.gatherer
        x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
        y = gatherer.run([object()], x, lambda layers, tensor: tensor * 2.0)
        counts = len(gatherer.counts)
        return y.data.tolist(), gatherer.counts == [0] * counts, gatherer.holds == [0] * counts

    assert dist.simulate(1, body) == [([[2.0] * 3] * 2, True, True)]
