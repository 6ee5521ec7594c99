"""--cp through the training loop, in the simulated world: every layout and mode (ring, Ulysses)
ends at the one-process weights and losses, rank by rank its attention's bytes equal ring_bytes'
(ulysses_bytes') every step and the gradients' bytes the all-reduce's formula over dp x cp ranks,
the work balance is in the metrics, an fp16 overflow on one context shard skips the step on every
rank, Ulysses' context needs N where the ring's needs 2N, and what --cp refuses is one line.
The grid: --cp with --tp (+ --sequence-parallel), --pp (every schedule), --zero 1-3, --recompute,
overlap on and off and micro-batches ends at the one-process weights, every group's bytes equal
to its formula (attention's, tensor parallelism's and the pipeline's on T/cp positions, the
gradients' over the dp x cp group); fp8 (every recipe), fp16 and bf16 follow one process's loss
with the ranks' copies and skip decisions agreeing."""

import numpy as np
import pytest

from minimp import backend
from minimp import distributed as dist
from minimp.checkpoints.errors import ConfigError
from minimp.measure.tensor_parallel_accounts import gpt_tensor_parallel_bytes, pipeline_bytes
from minimp.parallel import amax
from minimp.parallel.context import ring_bytes, ulysses_bytes
from minimp.parallel.replicas import ReplicaMismatchError
from minimp.parallel.zero.formulas import bytes_sent_formula
from minimp.train import TrainConfig
from minimp.train.loop import train
from minimp.train.sizes import parameter_count, stage_bounds, zero_unit_sizes

# The small fp32 GPT (dropout 0: --cp refuses dropout).
GPT = dict(
    dataset="shakespeare", layers=2, hidden=32, heads=4, context=16, batch_size=8, steps=3,
    eval_every=0, log_every=1000, precision="fp32",
)  # fmt: skip


def run(world_size, **flags):
    """Every rank's train() result on the simulated world (eager limit 0: every send waits for
    its receive, so a message posted in the wrong order deadlocks here)."""
    config = TrainConfig(**{**GPT, **flags})
    config.validate(world_size)
    with backend.limit_cpu_threads(1):
        return dist.simulate(
            world_size, lambda comm: train(config, lambda line: None, comm), eager_limit=0)


@pytest.fixture(scope="module")
def one_process():
    return run(1)[0]


LAYOUTS = [
    (2, dict(cp=2)),
    pytest.param(4, dict(cp=4), marks=pytest.mark.slow),
    (4, dict(cp=2, dp=2)),
    pytest.param(2, dict(cp=2, cp_layout="contiguous"), marks=pytest.mark.slow),
    pytest.param(2, dict(cp=2, micro_batches=2), marks=pytest.mark.slow),  # the M factor
    (2, dict(cp=2, cp_mode="ulysses", cp_layout="contiguous")),
    pytest.param(4, dict(cp=4, cp_mode="ulysses", cp_layout="contiguous"),  # 1 head a rank
                 marks=pytest.mark.slow),
]


def ring_bytes_per_step(flags):
    """One rank's context-parallel bytes a step: every block's attention (ring_bytes, or
    ulysses_bytes with --cp-mode ulysses), forward and backward, once per micro-batch, its q
    (B/(dp M), H, T/cp, D) in float32."""
    cp, dp, micro_batches = flags["cp"], flags.get("dp", 1), flags.get("micro_batches", 1)
    heads = GPT["heads"]
    shape = (GPT["batch_size"] // dp // micro_batches, heads, GPT["context"] // cp,
             GPT["hidden"] // heads)
    formula = ulysses_bytes if flags.get("cp_mode") == "ulysses" else ring_bytes
    per_call = formula(shape, np.dtype(np.float32), cp)
    return GPT["layers"] * micro_batches * (per_call.forward + per_call.backward)


@pytest.mark.parametrize("world_size, flags", LAYOUTS, ids=str)
def test_every_layout_ends_with_the_one_process_weights_and_sends_the_formula_s_bytes(
    one_process, world_size, flags
):
    results = run(world_size, **flags)
    weights, expected = results[0]["master_weights"], one_process["master_weights"]
    assert weights.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_allclose(weights[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    losses = [record["loss"] for record in results[0]["history"]]
    np.testing.assert_allclose(losses, [r["loss"] for r in one_process["history"]], rtol=1e-6)
    # The gradients' all-reduce runs over the dp x cp ranks: one bucket of every parameter.
    group = flags["cp"] * flags.get("dp", 1)
    contiguous_ring = flags.get("cp_layout") == "contiguous" and "cp_mode" not in flags
    imbalance = 2 * flags["cp"] - 1 if contiguous_ring else 1.0  # Ulysses: H/N heads, all of T
    for rank, result in enumerate(results):
        gradients = bytes_sent_formula(
            0, sizes=[parameter_count(TrainConfig(**GPT))], rank=rank % group, world_size=group,
            micro_batches=1, compute_bytes=4, wire_bytes=4)["all_reduce"]
        for record in result["history"]:
            assert record["bytes_by_group"]["context_parallel"] == ring_bytes_per_step(flags)
            assert record["bytes_by_collective"]["context_parallel"] == ring_bytes_per_step(flags)
            assert record["bytes_by_group"]["data_parallel"] == gradients
            assert record["context_work_imbalance"] == imbalance


def test_a_context_parallel_checkpoint_resumes_to_the_one_process_weights(one_process, tmp_path):
    """Saved after 2 steps in the one-process format, resumed for the third: where 3 steps go."""
    path = str(tmp_path / "cp.npz")
    run(2, cp=2, steps=2, save=path)
    result = run(2, cp=2, resume=path)[0]
    for name, array in one_process["master_weights"].items():
        np.testing.assert_allclose(result["master_weights"][name], array, rtol=1e-5, atol=1e-7,
                                   err_msg=name)


def test_the_layout_line_places_context_ranks_between_shards_and_replicas():
    def body(comm):
        lines = []
        train(TrainConfig(**{**GPT, "steps": 1, "cp": 2, "dp": 2}), log=lines.append, comm=comm)
        return lines

    lines = dist.simulate(4, body)[0]
    assert lines[0] == (
        "layout: --dp 2 x --cp 2 x --tp 1 x --pp 1 = 4 ranks (tensor-parallel ranks adjacent, "
        "then context-parallel ranks, then replicas, then stages)\n"
        "  rank 0: replica 0, context 0\n  rank 1: replica 0, context 1\n"
        "  rank 2: replica 1, context 0\n  rank 3: replica 1, context 1"
    )


def test_an_fp16_overflow_on_one_context_shard_skips_the_step_on_every_rank():
    """Rank 1 is context shard 1 of replica 0: its gradients alone turn non-finite at step 3
    (checked before the all-reduce, --no-overlap, so only rank 1 finds it); every rank skips it
    and halves the scale, and the ranks' losses stay one."""
    flags = dict(precision="fp16", steps=4, inject_overflow="3:1", check_replicas=1, overlap=False)
    results = run(4, **flags, cp=2, dp=2)
    for result in results:
        history = result["history"]
        assert [r["skipped"] for r in history] == [False, False, True, False]
        assert history[3]["loss_scale"] == history[2]["loss_scale"] / 2
        assert [r["loss"] for r in history] == [r["loss"] for r in results[0]["history"]]


@pytest.mark.slow  # 4 trainings of 6 steps
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16_bit_context_shards_keep_their_copies_equal_and_follow_one_process(precision):
    """--check-replicas compares the dp x cp ranks' masters after every step (it raises on one
    differing bit); the loss follows one process's (measured: within 2.9e-6 in fp16, 3.3e-5 in
    bf16: the ring merges its blocks in another order and rounds its output once)."""
    flags = {"precision": precision, "steps": 6, "check_replicas": 1, "lr": 1e-2}
    one = [r["loss"] for r in run(1, **flags)[0]["history"]]
    results = run(2, **flags, cp=2)
    history = results[0]["history"]
    assert history[-1]["loss"] < history[0]["loss"]
    assert [r["loss"] for r in results[1]["history"]] == [r["loss"] for r in history]
    np.testing.assert_allclose([r["loss"] for r in history], one, rtol=1e-4)


REFUSED = [
    (dict(dataset="digits", cp=2), "--cp 2 splits a sequence: it needs the GPT"),
    (dict(cp=2, context=10), "--context 10 does not divide by 4 (use a multiple of 4)"),
    (dict(cp=2, context=10, cp_layout="contiguous"), "--context 10 does not divide by 4"),
    (dict(cp=2, cp_mode="ulysses"), "--cp-mode ulysses takes --cp-layout contiguous, got zigzag"),
    (dict(cp=2, cp_mode="ulysses", cp_layout="contiguous", context=9),
     "--cp-mode ulysses: the sequence's 9 positions do not split over --cp 2 ranks: choose a "
     "context divisible by 2"),
    (dict(cp=4, cp_mode="ulysses", cp_layout="contiguous", heads=2, hidden=32, dp=1),
     "--cp-mode ulysses: the 2 attention heads a rank holds (with tensor parallelism, heads / tp) "
     "do not split over --cp 4 ranks: choose a --cp that divides 2, or --cp-mode ring"),
    (dict(cp=2, tp=2, heads=2, cp_mode="ulysses", cp_layout="contiguous", dp=1),
     "--cp-mode ulysses: the 1 attention heads a rank holds (with tensor parallelism, heads / tp) "
     "do not split over --cp 2 ranks"),
    (dict(cp=2, tp=2, sequence_parallel=True, context=6, cp_mode="ulysses",
          cp_layout="contiguous"),
     "--sequence-parallel gives each of the --tp 2 ranks an equal slice of its context rank's 3 "
     "positions (--context 6 / --cp 2), which do not divide by 2 (use a --context that is a "
     "multiple of 4)"),
    (dict(cp=2, dropout=0.1), "--cp 2 with --dropout 0.1: dropout masks are drawn per position"),
    (dict(cp=3, context=18), "--cp 3 x --tp 1 x --pp 1 does not divide the 4 ranks of this job"),
    # a --cp the job cannot hold is said as such, before the chunks it would cut: not "use a
    # --context that is a multiple of 6" (or of 2,000,000), which would not make it run
    (dict(cp=3), "--cp 3 x --tp 1 x --pp 1 does not divide the 4 ranks of this job (start a "
     "multiple of 3 ranks with mpirun -n)"),
    (dict(cp=1_000_000), "--cp 1000000 x --tp 1 x --pp 1 does not divide the 4 ranks of this job"),
    (dict(cp=8, cp_mode="ulysses", cp_layout="contiguous"),
     "--cp 8 x --tp 1 x --pp 1 does not divide the 4 ranks of this job"),
    (dict(cp=2, tp=4, sequence_parallel=True, context=20),
     "--cp 2 x --tp 4 x --pp 1 does not divide the 4 ranks of this job (start a multiple of 8"),
    (dict(cp=2, dp=1), "--dp 1 does not match the 4 ranks of this job (use --dp 2"),
]


def test_ulysses_needs_the_context_to_divide_by_n_where_the_ring_needs_2n():
    """context 18 over --cp 2: 9 positions a rank for Ulysses, but not 4 chunks for the ring."""
    flags = dict(GPT, cp=2, context=18, cp_layout="contiguous")
    TrainConfig(**flags, cp_mode="ulysses").validate(2)
    with pytest.raises(ConfigError, match="does not divide by 4"):
        TrainConfig(**flags).validate(2)


@pytest.mark.parametrize("flags, message", REFUSED, ids=lambda value: str(value)[:40])
def test_what_context_parallelism_refuses_is_one_line_naming_the_fix(flags, message):
    digits = flags.get("dataset") == "digits"
    base = dict(dataset="digits", steps=1) if digits else GPT
    config = TrainConfig(**{**base, **flags})
    with pytest.raises(ConfigError) as error:
        config.validate(4)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_sequence_parallel_slices_of_a_context_rank_s_positions_name_the_ring_s_multiple():
    """--cp 2 --tp 4 on the 8 ranks it needs: context 20 is 10 positions a context rank, which
    4 tensor-parallel ranks cannot slice; 8 divides both the ring's 2N and cp x tp."""
    with pytest.raises(ConfigError) as error:
        TrainConfig(**{**GPT, "context": 20}, cp=2, tp=4, sequence_parallel=True).validate(8)
    assert str(error.value) == (
        "--sequence-parallel gives each of the --tp 4 ranks an equal slice of its context rank's "
        "10 positions (--context 20 / --cp 2), which do not divide by 4 (use a --context that is "
        "a multiple of 8)")


def test_the_heads_a_tensor_parallel_rank_holds_are_what_ulysses_splits():
    """4 heads over --tp 2: 2 a rank, which --cp 2 splits and --cp 4 cannot."""
    flags = dict(GPT, tp=2, cp_mode="ulysses", cp_layout="contiguous")
    TrainConfig(**flags, cp=2).validate(4)
    with pytest.raises(ConfigError, match="the 2 attention heads a rank holds"):
        TrainConfig(**flags, cp=4).validate(8)


# --cp with every other feature: the default tier runs the two and --recompute.
GRIDS = [
    (4, dict(cp=2, tp=2)),
    (4, dict(cp=2, pp=2)),
    (2, dict(cp=2, recompute=True)),  # the ring's forward runs twice per block
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [
        (4, dict(cp=2, tp=2, sequence_parallel=True)),
        (4, dict(cp=2, tp=2, cp_mode="ulysses", cp_layout="contiguous")),
        (4, dict(cp=2, tp=2, sequence_parallel=True, recompute=True, cp_layout="contiguous")),
        (4, dict(cp=2, pp=2, micro_batches=2, schedule="gpipe")),
        (4, dict(cp=2, pp=2, micro_batches=4, schedule="1f1b", cp_mode="ulysses",
                 cp_layout="contiguous")),
        (4, dict(cp=2, pp=2, micro_batches=2, schedule="interleaved", virtual_stages=2)),
        (4, dict(cp=2, pp=2, micro_batches=2, schedule="zb-h1")),
        (4, dict(cp=2, dp=2, zero=1)),
        (4, dict(cp=2, dp=2, zero=2, micro_batches=2)),
        (4, dict(cp=2, dp=2, zero=3, overlap=False)),
        (2, dict(cp=2, zero=3)),
        (4, dict(cp=2, dp=2, overlap=False)),
        (2, dict(cp=2, cp_mode="ulysses", cp_layout="contiguous", recompute=True)),
        (8, dict(cp=2, tp=2, pp=2, micro_batches=2, sequence_parallel=True, recompute=True)),
        (8, dict(cp=2, tp=2, dp=2, zero=3)),
        (8, dict(cp=4, tp=2, zero=2)),
    ]],
]  # fmt: skip


def grid_bytes(world_size, flags, rank):
    """{group: the bytes rank sends in it each step} by the formulas, fp32 on every wire: its
    attention's (ring_bytes or ulysses_bytes of its q (B/(dp M), H/tp, T/cp, D), forward twice
    with --recompute, for each block of its stage and micro-batch), tensor parallelism's and the
    pipeline's on its T/cp positions, and the gradients' over the dp x cp group (ZeRO's formula,
    the group rank dp_rank cp + cp_rank). Ranks are placed as parallel/topology.py places them."""
    config = TrainConfig(**{**GPT, **flags})
    cp, tp, pp, m = config.cp, config.tp, config.pp, config.micro_batches
    dp = world_size // (cp * tp * pp)
    stage, dp_rank, cp_rank = rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp
    bounds = stage_bounds(config)
    chunks = range(stage, len(bounds), pp)  # this rank's chunks (--virtual-stages)
    blocks = sum(1 <= i <= config.layers for c in chunks for i in range(*bounds[c]))
    first, last = 0 in chunks, len(bounds) - 1 in chunks
    rows, tokens, width = config.batch_size // dp // m, config.context // cp, config.hidden
    shape = (rows, config.heads // tp, tokens, width // config.heads)
    formula = ulysses_bytes if config.cp_mode == "ulysses" else ring_bytes
    call = formula(shape, np.dtype(np.float32), cp)
    forwards = 2 if config.recompute else 1
    activation = rows * tokens * width * 4 // (tp if config.sequence_parallel else 1)
    units = zero_unit_sizes(config)[stage]
    readers = [2] + [1] * (len(units) - 1) if pp == 1 else None  # the head reads wte again
    gradients = bytes_sent_formula(
        config.zero, sizes=units if config.zero else [sum(units)], rank=dp_rank * cp + cp_rank,
        world_size=dp * cp, micro_batches=m, compute_bytes=4, wire_bytes=4, readers=readers)
    expected = {
        "context_parallel": blocks * m * (forwards * call.forward + call.backward),
        "data_parallel": sum(gradients.values()),
        "pipeline": sum(pipeline_bytes(activation=activation, micro_batches=m,
                                       first_stage=c == 0, last_stage=c == len(bounds) - 1)
                        for c in chunks),
    }
    if tp > 1:
        expected["tensor_parallel"] = gpt_tensor_parallel_bytes(
            blocks=blocks, rows=rows, context=tokens, width=width, tp=tp, micro_batches=m,
            compute_bytes=4, sequence_parallel=config.sequence_parallel, first_stage=first,
            last_stage=last, recompute=config.recompute)
    return expected, gradients


@pytest.mark.parametrize("world_size, flags", GRIDS, ids=str)
def test_cp_on_every_grid_ends_with_the_one_process_weights_and_the_formulas_bytes(
    one_process, world_size, flags
):
    results = run(world_size, **flags)
    weights = results[0]["master_weights"]  # rank 0 gathers every stage, shard and ZeRO chunk
    assert weights.keys() == one_process["master_weights"].keys()
    for name, array in one_process["master_weights"].items():
        np.testing.assert_allclose(weights[name], array, rtol=1e-5, atol=1e-7, err_msg=name)
    losses = [record["loss"] for record in results[0]["history"]]
    np.testing.assert_allclose(losses, [r["loss"] for r in one_process["history"]], rtol=1e-6)
    for rank, result in enumerate(results):
        expected, gradients = grid_bytes(world_size, flags, rank)
        for record in result["history"]:
            assert {name: record["bytes_by_group"][name] for name in expected} == expected, rank
            assert {name: record["bytes_by_collective"][name] for name in gradients} == gradients


PRECISION_GRIDS = [
    (2, dict(cp=2)),
    (4, dict(cp=2, tp=2, sequence_parallel=True)),
    (4, dict(cp=2, pp=2, micro_batches=2)),
]


def low_precision_runs(world_size, flags, precision, **more):
    """(one process's history, every rank's) over 3 steps in `precision`, the ranks' copies
    compared after every step (--check-replicas raises on one differing bit: masters and, in
    fp8, the scaling state, over the dp x cp ranks and across the tp shards)."""
    common = {"precision": precision, "steps": 3, "lr": 1e-2, **more}
    one = run(1, **common)[0]["history"]
    return one, [result["history"] for result in run(world_size, **common, **flags,
                                                         check_replicas=1)]


@pytest.mark.parametrize("world_size, flags", [
    PRECISION_GRIDS[0],
    *[pytest.param(*case, marks=pytest.mark.slow) for case in PRECISION_GRIDS[1:]],
], ids=str)  # fmt: skip
@pytest.mark.parametrize("recipe", [pytest.param(recipe, marks=pytest.mark.slow)
                                    for recipe in ("delayed", "current", "none")])
def test_fp8_context_shards_agree_and_follow_one_process(world_size, flags, recipe):
    """Every rank's losses are one; they follow one process's (measured over the three grids:
    within 2.4e-5 delayed, 1.5e-4 current, 2.1e-5 with no scaling). Delayed
    scaling's watched activation scales are one process's (the amaxes are agreed over the cp
    ranks too, so a scale is that of every token; one rank says it in the metrics); current
    scaling quantizes with each rank's own amax, as with --dp (its tokens', not every token's)."""
    alone, histories = low_precision_runs(world_size, flags, "fp8", fp8_recipe=recipe)
    for history in histories:
        assert [r["loss"] for r in history] == [r["loss"] for r in histories[0]]
        assert [r["skipped"] for r in history] == [False] * 3
    np.testing.assert_allclose([r["loss"] for r in histories[0]], [r["loss"] for r in alone],
                               rtol=2e-4)
    for record, single in zip(histories[0], alone if recipe == "delayed" else []):
        for name, watched in single["fp8"].items():
            if name.endswith(".input"):
                np.testing.assert_allclose(record["fp8"][name]["scale"], watched["scale"],
                                           rtol=1e-3, err_msg=name)


def test_without_the_amax_agreement_the_context_shards_scales_part(monkeypatch):
    """Each context shard sees other tokens: its own amaxes would give it its own scales."""
    monkeypatch.setattr(amax.AmaxReduction, "__call__", lambda self, amaxes: amaxes)
    with pytest.raises(ReplicaMismatchError, match="master weights or fp8 state"):
        run(2, cp=2, precision="fp8", steps=2, check_replicas=1)


@pytest.mark.slow  # 4 trainings of 3 steps
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("world_size, flags", PRECISION_GRIDS[1:], ids=str)
def test_16_bit_grids_keep_their_copies_equal_and_follow_one_process(world_size, flags,
                                                                     precision):
    """As the --cp 2 test above, with --tp + --sequence-parallel and with --pp (measured: within
    2e-6 in fp16, 1.6e-5 in bf16)."""
    alone, histories = low_precision_runs(world_size, flags, precision)
    for history in histories:
        assert [r["loss"] for r in history] == [r["loss"] for r in histories[0]]
        assert [r["skipped"] for r in history] == [r["skipped"] for r in histories[0]]
    np.testing.assert_allclose([r["loss"] for r in histories[0]], [r["loss"] for r in alone],
                               rtol=1e-4)


@pytest.mark.slow  # 2 trainings of 4 steps on 4 ranks
@pytest.mark.parametrize("flags", [dict(tp=2), dict(pp=2, micro_batches=2)], ids=str)
def test_an_fp16_overflow_on_one_context_shard_of_a_grid_skips_the_step_on_every_rank(flags):
    """Rank 1: with --tp 2 tensor shard 1 of context shard 0, with --pp 2 context shard 1 of
    stage 0; its gradients alone turn non-finite at step 3."""
    results = run(4, **flags, cp=2, precision="fp16", steps=4, inject_overflow="3:1",
                  check_replicas=1, overlap=False)
    for result in results:
        history = result["history"]
        assert [r["skipped"] for r in history] == [False, False, True, False]
        assert history[3]["loss_scale"] == history[2]["loss_scale"] / 2


def test_zero_over_the_context_shards_leaves_no_rank_empty_handed():
    """ZeRO shards over dp x cp ranks: 33 x 2 = 66 shards of a stage whose largest layer (the
    token embedding of a 1-wide GPT) holds 65 parameters would leave a rank none; 32 x 2 do not."""
    tiny = {**GPT, "hidden": 1, "heads": 1, "layers": 1, "context": 4, "zero": 1,
            "batch_size": 32 * 33}
    TrainConfig(**tiny, cp=2).validate(64)
    with pytest.raises(ConfigError) as error:
        TrainConfig(**tiny, cp=2).validate(66)
    assert str(error.value) == (
        "--zero 1 over --dp 33 x --cp 2: pipeline stage 0's largest layer has 65 parameters, so "
        "some ranks would hold none of that stage (use --dp x --cp 65 or fewer, a wider model, "
        "or --zero 0)")
