"""The planner (`python -m minimp.plan`): its memory against minimp's own accounts and measured
bytes, its FLOPs against Narayanan et al.'s Eq. 3, its pipeline against the simulator, its rules,
its ranking, its errors, and its comparison with Narayanan et al. 2021's Table 1."""

import json
import math
import os
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import pytest

from minimp import functional as F
from minimp import nn
from minimp.measure.costmodel import Network
from minimp.measure.machinemodel import shipped_model
from minimp.models import GPT, GPTConfig, block_activation_bytes
from minimp.parallel.context import ring_bytes, ulysses_bytes
from minimp.parallel.expert import dispatch_bytes, memory_by_kind
from minimp.parallel.zero.formulas import bytes_sent_formula, memory_formula
from minimp.plan.cli import main
from minimp.plan import memory as mem
from minimp.plan import steptime
from minimp.parallel.pipeline.schedules import CHOICES
from minimp.plan.inputs import Cluster, Job, Layout, ModelShape, PlanError, check_inputs
from minimp.plan.inputs import PRICED_SCHEDULES, shape_for_parameters, wire_fields
from minimp.plan.links import AlphaBeta, Measured
from minimp.plan.narayanan import TABLE_1, compare, comparison_table, format_comparison
from minimp.plan.presets import MEGATRON, MODELS, SHAKESPEARE, selene
from minimp.plan.search import Choices, best_plans, broken_rule, search
from minimp.plan.steptime import SCALAR_BYTES, narayanan_flops, step_flops, step_time
from minimp.precision.casting import BFLOAT16
from minimp.tensor import Tensor, saved_bytes
from minimp.train import TrainConfig
from minimp.train.sizes import parameter_count, zero_unit_sizes

SMALL = ModelShape(layers=4, hidden=32, heads=4, context=16, vocab=50, dropout=False)
FREE = AlphaBeta(Network(alpha=0.0, beta=0.0))
ROOT = os.path.join(os.path.dirname(__file__), "..")


def small_cluster(gpus=8, per_node=8, memory=2**40, intra=FREE, inter=FREE):
    return Cluster(gpus, per_node, memory, 1e12, 1.0, intra, inter, "test")


# ----- memory --------------------------------------------------------------------------------
def test_parameters_are_minimps_gpt_and_narayanans_eq_2_plus_the_final_layernorm():
    config = TrainConfig(dataset="shakespeare", model="gpt", layers=3, hidden=48, heads=4)
    shape = ModelShape(layers=3, hidden=48, heads=4, context=64, vocab=65)
    assert shape.parameters() == parameter_count(config)
    layers, h, s, v = 80, 12288, 2048, 51200
    eq_2 = 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))
    assert MEGATRON["145.6B"].parameters() == pytest.approx(eq_2 + 2 * h, rel=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("dropout", [False, True])
def test_a_block_at_t_1_keeps_what_block_activation_bytes_says(dtype, dropout):
    s, b, h, a = 16, 3, 32, 4
    shape = ModelShape(2, h, a, s, 50, dropout=dropout)
    d = np.dtype(dtype).itemsize
    expected = block_activation_bytes(s, b, h, a, dtype, dropout)
    assert mem.layer_activation_bytes(shape, b, d, tp=1, sp=False) == expected


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_and_sequence_parallel_activations_are_korthikantis(t):
    s, b, h, a = 2048, 1, 12288, 96
    shape = ModelShape(80, h, a, s, 51200, dropout=True)
    sbh, statistics = s * b * h, 16 * s * b
    tensor = sbh * (10 + 24 / t + 5 * a * s / (h * t)) + statistics
    sequence = sbh / t * (34 + 5 * a * s / h) + statistics / t
    assert mem.layer_activation_bytes(shape, b, 2, t, sp=False) == pytest.approx(tensor)
    assert mem.layer_activation_bytes(shape, b, 2, t, sp=True) == pytest.approx(sequence)


PRECISIONS = [(np.float16, 0.0), (np.float32, 0.0), (np.float16, 0.1)]


@pytest.mark.parametrize("dtype, dropout", PRECISIONS)
def test_one_stage_keeps_what_minimps_gpt_keeps_to_the_byte(dtype, dropout):
    b, s, h, a, v, layers = 3, 16, 32, 2, 50, 2
    model = GPT(GPTConfig(v, s, layers, a, h, dropout), np.random.default_rng(0)).to(dtype)
    model.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
    ids = np.random.default_rng(1).integers(0, v, (b, s))
    loss = F.cross_entropy(model(ids).reshape(-1, v), ids.reshape(-1))
    kept = saved_bytes(loss, exclude=[p.data for p in model.parameters()])
    shape = ModelShape(layers, h, a, s, v, dropout=dropout > 0)
    job = Job(b, (b,), precision="fp16" if dtype == np.float16 else "fp32")
    assert mem.activation_bytes(shape, Layout(1, 1, 1, 0, b, 1), job, stage=0) == kept


def test_a_recomputed_block_keeps_its_input():
    b, s, h, a = 3, 16, 32, 2
    block = GPT(GPTConfig(50, s, 1, a, h), np.random.default_rng(0)).to(np.float16)[1]
    x = Tensor(np.ones((b, s, h), np.float16), requires_grad=True)
    out = nn.recompute([block], x)
    kept = saved_bytes(out, exclude=[p.data for p in block.parameters()])
    layout = Layout(1, 1, 1, 0, b, 1, recompute=True)
    assert mem.stored_layer_bytes(replace(SMALL, hidden=h, heads=a, context=s), layout, 2) == kept


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_zero_units_are_minimps(pp):
    config = TrainConfig(dataset="shakespeare", model="gpt", layers=4, hidden=128, heads=4, pp=pp)
    expected = zero_unit_sizes(config)
    shape = ModelShape(4, 128, 4, 64, 65)
    layout = Layout(1, 1, pp)
    assert [mem.stage_units(shape, layout, stage) for stage in range(pp)] == expected


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2), (4, 1)])
def test_tensor_parallel_units_are_minimps_with_whole_embeddings(tp, pp):
    config = TrainConfig(dataset="shakespeare", model="gpt", layers=4, hidden=128, heads=4, pp=pp,
                         tp=tp)
    shape, layout = ModelShape(4, 128, 4, 64, 65), Layout(1, tp, pp)
    minimp_job, megatron_job = Job(1, vocabulary_parallel=False), Job(1)
    units = [mem.stage_units(shape, layout, stage, minimp_job) for stage in range(pp)]
    assert units == zero_unit_sizes(config)
    cut = [mem.stage_units(shape, layout, stage, megatron_job) for stage in range(pp)]
    assert cut[0][0] == math.ceil(65 / tp) * 128 and units[0][0] == 65 * 128


def test_a_whole_head_keeps_and_computes_every_logit_on_every_rank():
    layout = Layout(1, 2, 1, micro_batch_size=2, micro_batches=1)
    minimp_job, megatron_job = Job(2, (2,), vocabulary_parallel=False), Job(2, (2,))
    logits = 2 * SMALL.context * SMALL.vocab * 2  # b s V d
    whole = mem.head_bytes(SMALL, layout, minimp_job)
    assert whole - mem.head_bytes(SMALL, layout, megatron_job) == logits / 2
    cluster = small_cluster(gpus=2, per_node=2)
    head_flops = 2 * 2 * SMALL.context * SMALL.hidden * SMALL.vocab  # 2 b s h V, forward
    extra = step_time(SMALL, cluster, minimp_job, layout).compute
    extra -= step_time(SMALL, cluster, megatron_job, layout).compute
    assert extra == pytest.approx(3 * head_flops / 2 / cluster.flops, rel=1e-9)


def test_in_flight_micro_batches_follow_1f1b_and_gpipe():
    layout = Layout(1, 1, 4, micro_batches=8)
    assert [mem.in_flight(layout, stage, "1f1b") for stage in range(4)] == [4, 3, 2, 1]
    assert mem.in_flight(replace(layout, micro_batches=2), 0, "1f1b") == 2
    assert mem.in_flight(layout, 3, "gpipe") == 8


def test_the_planner_prices_schedules_of_minimps_one_registry():
    assert set(PRICED_SCHEDULES) <= set(CHOICES)
    with pytest.raises(PlanError, match=r"--schedule must be one of \['1f1b', 'gpipe'\]"):
        check_inputs(SMALL, small_cluster(), Job(8, schedule="interleaved"))


def test_stage_zero_needs_p_micro_batches_of_activations():
    job = Job(64, (1,))
    one = mem.activation_bytes(SMALL, Layout(1, 1, 2, micro_batches=1), job, stage=0)
    eight = mem.activation_bytes(SMALL, Layout(1, 1, 2, micro_batches=8), job, stage=0)
    assert eight == 2 * one  # P = 2 in flight, however many micro-batches


# ----- time ----------------------------------------------------------------------------------
def test_flops_are_narayanans_eq_3_with_recomputation():
    for model in MEGATRON.values():
        assert step_flops(model, 512, recompute=True) == pytest.approx(
            narayanan_flops(model, 512), rel=1e-12
        )
    s, h, v = SMALL.context, SMALL.hidden, SMALL.vocab
    without = 72 * 8 * s * SMALL.layers * h * h * (1 + s / (6 * h)) + 6 * 8 * s * h * v
    assert step_flops(SMALL, 8, recompute=False) == pytest.approx(without, rel=1e-12)


class BytesAsSeconds:
    """Links whose "seconds" are the bytes one rank sends in the ring collective (scalars: 0)."""

    def all_reduce(self, nbytes, ranks):
        return 0.0 if nbytes == SCALAR_BYTES else 2 * (ranks - 1) / ranks * nbytes

    def reduce_scatter(self, nbytes, ranks):
        return (ranks - 1) / ranks * nbytes

    all_gather = reduce_scatter

    def send(self, nbytes):
        return 0.0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel_collectives_send_zero_accounts_bytes(stage):
    shape = ModelShape(layers=2, hidden=16, heads=2, context=8, vocab=64)  # units divide by 4
    links = BytesAsSeconds()
    cluster = replace(small_cluster(gpus=4, per_node=4), peak_flops=1e300, intra=links, inter=links)
    layout = Layout(4, 1, 1, stage, micro_batch_size=2, micro_batches=3)
    job = Job(24, (2,), precision="fp16", grad_comm_bytes=4)
    time = step_time(shape, cluster, job, layout)
    units = mem.stage_units(shape, layout, 0)
    sizes = [sum(units)] if stage == 0 else units
    formula = bytes_sent_formula(
        stage, sizes=sizes, rank=0, world_size=4, micro_batches=3, compute_bytes=2, wire_bytes=4
    )
    assert time.data_parallel + time.zero_in_step == pytest.approx(sum(formula.values()))
    assert time.total == pytest.approx(sum(formula.values()), rel=1e-9)  # nothing else sends


def test_the_pipeline_formula_is_the_simulators_span_for_even_stages():
    shape = replace(SMALL, vocab=1)  # a head of almost no work: the stages cost the same
    job = Job(16, (1,), grad_comm_bytes=4)
    layout = Layout(1, 1, 4, micro_batch_size=1, micro_batches=16)
    cluster = small_cluster(gpus=4, per_node=4)
    formula = step_time(shape, cluster, job, layout)
    simulated = step_time(shape, cluster, job, layout, simulate=True)
    assert simulated.total == pytest.approx(formula.total, rel=1e-3)
    assert formula.bubble / formula.total == pytest.approx(3 / (16 + 3), rel=1e-3)
    for alpha in (1e-7, 1e-5, 1e-3):  # the formula's messages block; the simulator's do not
        slow = small_cluster(gpus=4, per_node=4, intra=AlphaBeta(Network(alpha, 0.0)))
        blocking = step_time(shape, slow, job, layout)
        sent = step_time(shape, slow, job, layout, simulate=True)
        filling_only = formula.total + 2 * 3 * alpha + blocking.other - formula.other
        assert filling_only <= sent.total <= blocking.total


def test_reduce_scatter_and_all_gather_are_the_halves_of_an_all_reduce():
    links = AlphaBeta(Network(alpha=5e-6, beta=1 / 25e9, gamma=1 / 1e12))
    for ranks in (2, 3, 8):
        halves = links.reduce_scatter(1e6, ranks) + links.all_gather(1e6, ranks)
        assert halves == pytest.approx(links.all_reduce(1e6, ranks))
    measured = Measured(shipped_model(4))
    assert measured.all_reduce(1e6, 4) == shipped_model(4).allreduce_time("ring", 1e6)
    assert measured.all_reduce(1e6, 1) == 0.0


# ----- search --------------------------------------------------------------------------------
def test_every_plan_keeps_the_rules_and_the_rejections_are_counted():
    shape = replace(SMALL, heads=2, layers=6)  # tp 4 or 8 split no heads; pp 4 or 8 no layers
    cluster = small_cluster(gpus=8, per_node=4)
    found = search(shape, cluster, Job(12, (1, 2)))
    assert found.plans
    for plan in found.plans:
        layout = plan.layout
        assert layout.dp * layout.tp * layout.pp == 8
        assert shape.heads % layout.tp == 0 and 4 % layout.tp == 0
        assert shape.layers % layout.pp == 0
        assert 12 == layout.dp * layout.micro_batch_size * layout.micro_batches
    assert found.rejected["heads"] > 0 and found.rejected["layers"] > 0
    assert found.rejected["batch"] > 0  # dp 8, or dp 4 with micro-batches of 2 rows


def test_plans_are_ranked_by_step_time_then_memory():
    plans = best_plans(MEGATRON["18.4B"], selene(64), Job(256, (1, 2)))
    keys = [(p.time.total, p.memory.total) for p in plans]
    assert keys == sorted(keys)
    tied = [p for p in plans if p.layout.tp > 1 and not p.layout.recompute and p.layout.zero == 1]
    first = tied[0]
    twin = [p for p in plans if p.layout == replace(first.layout, sequence_parallel=False)]
    if first.layout.sequence_parallel and twin:  # same time, less memory: ranked first
        assert plans.index(first) < plans.index(twin[0])


def test_with_free_networks_the_best_layout_has_no_pipeline_bubble():
    best = best_plans(SMALL, small_cluster(), Job(64, (1,)))[0]
    assert best.layout.pp == 1 and best.time.bubble == 0.0


def test_with_a_slow_intra_node_network_tensor_parallelism_loses():
    slow = small_cluster(intra=AlphaBeta(Network(1.0, 1e-3)))
    assert best_plans(SMALL, slow, Job(64, (1,)))[0].layout.tp == 1


def test_a_gpt3_sized_shape_from_a_parameter_count():
    shape = shape_for_parameters(175e9, 2048, 51200)
    assert (shape.layers, shape.hidden, shape.heads) == (96, 12288, 96)


# ----- errors and the command ----------------------------------------------------------------
def test_bad_input_is_one_line_that_names_the_fix(capsys):
    assert main(["--layers", "2", "--hidden", "30", "--heads", "4", "--context", "8",
                 "--vocab", "10", "--gpus", "4", "--global-batch", "8"]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--heads 4 must divide --hidden 30" in error
    assert "try --heads 3" in error


BAD_FLAGS = [  # (flags after a valid --model shakespeare --gpus 4 --global-batch 8, the message)
    (["--top", "0"], "--top must be at least 1, got 0"),
    (["--zero", "5"], "--zero takes stages 0-3, got 5"),
    (["--zero", "x"], "--zero takes integers separated by commas, got 'x'"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be positive"),
    (["--memory-gb", "nan"], "--memory-gb must be a positive finite number, got nan"),
    (["--memory-gb", "-2"], "--memory-gb must be a positive finite number, got -2.0"),
    (["--memory-gb", "inf"], "--memory-gb must be a positive finite number, got inf"),
    (["--peak-tflops", "inf"], "--peak-tflops must be a positive finite number, got inf"),
    (["--global-batch", str(2**20 + 1)], "is beyond what the planner searches"),
    (["--global-batch", "10000", "--simulate"], "--simulate runs every micro-batch of a step"),
    (["--parameters", "1e9"], "--model shakespeare and --parameters 1e+09 each give the model"),
    (["--achievable", "1.5"], "--achievable is a fraction of peak in (0, 1], got 1.5"),
    (["--intra-gbs", "nan", "--intra-alpha-us", "1"], "--intra-alpha-us and --intra-gbs go"),
    (["--inter-gbs", "10"], "--inter-alpha-us and --inter-gbs go together"),
    (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of --gpus-per-node 8"),
    (["--cluster", "this-machine"], "--cluster this-machine needs --peak-tflops"),
    (["--cluster", "this-machine", "--peak-tflops", "nan"], "--peak-tflops must be positive"),
    (["--model", "foo"], "argument --model: invalid choice: 'foo'"),  # argparse's, one line
    (["--gpus", "two"], "argument --gpus: invalid int value: 'two'"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_every_bad_flag_is_one_line_exit_2_before_any_work(flags, message, capsys, monkeypatch):
    def no_search(*args, **kwargs):
        raise AssertionError("searched despite bad input")

    monkeypatch.setattr("minimp.plan.cli.best_plans", no_search)
    valid = ["--model", "shakespeare", "--gpus", "4", "--global-batch", "8"]
    with pytest.raises(SystemExit) if message.startswith("argument") else nullcontext():
        assert main(valid + flags) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("minimp.plan: error: ") and message in captured.err


def test_argparse_errors_exit_2_in_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--model", "shakespeare", "--gpus", "4", "--global-batch", "8", "--no-such-flag"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error == "minimp.plan: error: unrecognized arguments: --no-such-flag (see --help)\n"


def test_global_batch_and_gpus_are_required_but_not_for_the_comparison(capsys, monkeypatch):
    assert main(["--model", "shakespeare", "--gpus", "4"]) == 2
    assert "--global-batch is required" in capsys.readouterr().err
    monkeypatch.setattr("minimp.plan.cli.comparison_table", lambda: "the table")
    assert main(["--compare-narayanan"]) == 0
    assert capsys.readouterr().out == "the table\n"


def test_no_layout_fitting_names_the_rule_that_failed_most(capsys):
    assert main(["--model", "1008.0B", "--gpus", "8", "--global-batch", "8"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "failed on the memory per GPU" in error and "GiB" in error


def test_check_inputs_refuses_a_batch_smaller_than_a_micro_batch():
    with pytest.raises(PlanError, match="smaller than the smallest --micro-batch-size 4"):
        check_inputs(SMALL, small_cluster(), Job(2, (4,)))


def test_the_command_prints_a_table_and_json(capsys):
    flags = ["--model", "shakespeare", "--gpus", "4", "--global-batch", "16"]
    flags += ["--micro-batch-size", "2,4", "--top", "3"]
    assert main(flags) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 + 3 and table[2].split()[:3] == ["#", "dp", "tp"]
    assert table[0].startswith("model: 4 blocks of 128, 4 heads, context 64, vocabulary 65")
    assert table[1].startswith("cluster: Selene") and "4 GPUs, 8 a node, 80.0 GiB" in table[1]
    assert [row.split()[0] for row in table[3:]] == ["1", "2", "3"]
    assert main(flags + ["--json", "--simulate"]) == 0
    document = json.loads(capsys.readouterr().out)
    seconds = [plan["step_seconds"] for plan in document["plans"]]
    assert len(seconds) == 3 and seconds == sorted(seconds)
    assert document["model"]["layers"] == SHAKESPEARE.layers


# ----- Narayanan et al. 2021, Table 1 ----------------------------------------------------------
def test_table_1_is_consistent_with_itself_and_eq_2():
    for row in TABLE_1:
        billions = MEGATRON[row.name].parameters() / 1e9
        assert round(billions, 1) == pytest.approx(row.billions, abs=0.051)
        assert row.tflops * row.gpus / 1e3 == pytest.approx(row.aggregate_pflops, rel=0.01)
        assert round(100 * row.tflops / 312) == row.percent_of_peak
        shape = MEGATRON[row.name]
        assert (shape.heads, shape.hidden, shape.layers) == (row.heads, row.hidden, row.layers)


@pytest.fixture(scope="module")
def comparisons():
    return {row.name: compare(row) for row in TABLE_1}


def test_the_planner_at_their_layouts_is_within_15_percent_of_their_throughput(comparisons):
    """What docs/planner.md's table shows: paper step time / predicted, at their (t, p), for
    every row of Table 1; their layout fits on every row."""
    ratios = {name: found["ratio_theirs"] for name, found in comparisons.items()}
    assert len(ratios) == 10 and all(0.85 <= ratio <= 1.15 for ratio in ratios.values()), ratios


def test_within_their_menu_the_planner_picks_their_layouts_for_six_rows_of_ten(comparisons):
    """ZeRO 0, recomputation, no sequence parallelism (what Megatron-LM offered in 2021): the
    planner's best is their (t, p) for 7.5B and from 76.1B up, not for the others
    (docs/planner.md)."""
    picked = {
        name: (found["best_in_menu"].layout.tp, found["best_in_menu"].layout.pp)
        for name, found in comparisons.items()
    }
    theirs = {row.name: (row.t, row.p) for row in TABLE_1}
    assert {name for name in picked if picked[name] == theirs[name]} == {
        "7.5B", "76.1B", "145.6B", "310.1B", "529.6B", "1008.0B"
    }  # fmt: skip
    assert picked["1.7B"] == (2, 1) and picked["18.4B"] == (4, 4)
    found = comparisons["145.6B"]
    assert math.isclose(found["paper_seconds"], narayanan_flops(MEGATRON["145.6B"], 2304) / (
        1536 * 148e12))  # fmt: skip


def test_the_comparison_table_is_the_one_in_docs_planner_md(comparisons):
    table = format_comparison(list(comparisons.values()))
    assert table in open(os.path.join(ROOT, "docs", "planner.md")).read()
    lines = table.splitlines()
    assert len(lines) == 12 and lines[0].count("|") == lines[8].count("|") == 13
    cells = [cell.strip() for cell in lines[8].split("|")[1:-1]]
    assert cells[:5] == ["145.6B", "1536", "2304", "(8, 8, 24)", "148"]
    # planner / paper is the throughput ratio: paper step / predicted step = TFLOP/s / 148
    assert float(cells[7]) == pytest.approx(float(cells[6]) / 148, abs=0.01)
    assert comparison_table(("145.6B",)).splitlines()[2] == lines[8]


@pytest.mark.parametrize("command, before", [
    ("python -m minimp.plan --model 145.6B --gpus 1536 --global-batch 2304 --top 3",
     "The first prints"),
    ("python -m minimp.plan --model 7B-128k --gpus 64 --global-batch 16 --top 3", "At 128k tokens"),
    ("python -m minimp.plan --model mixtral-8x7b --gpus 64 --global-batch 256 --top 3",
     "Mixtral 8x7B on"),
], ids=["145.6B", "7B-128k", "mixtral-8x7b"])  # fmt: skip
def test_the_guide_s_planner_output_is_what_the_command_prints(capsys, command, before):
    """The guide's output, the first text block after `before`, is what its command prints."""
    guide = open(os.path.join(ROOT, "docs", "planner.md")).read()
    assert command in guide
    shown = guide.split(before, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    assert main(command.split()[3:]) == 0
    assert capsys.readouterr().out == shown


# ----- mpirun_examples/plan_check.py (minutes a run: the slow tier runs docs/benchmarks.md's) ---
def plan_check_module():
    import importlib.util

    path = os.path.join(ROOT, "mpirun_examples", "plan_check.py")
    spec = importlib.util.spec_from_file_location("plan_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_check_runs_every_grid_of_4_ranks_and_tp_only_when_the_trainer_has_it():
    check = plan_check_module()
    grids = {(x.dp, x.tp, x.pp, x.zero, x.micro_batches) for x in check.layouts(4, False)}
    assert grids == {(4, 1, 1, z, 1) for z in range(4)} | {(2, 1, 2, z, 2) for z in range(4)} | {
        (1, 1, 4, 0, 4)
    }
    with_tp = check.layouts(4, True)
    assert {x.tp for x in with_tp} == {1, 2, 4} and len(with_tp) > len(grids)
    command = check.train_command(Layout(1, 2, 2, 0, 4, 4), steps=3, metrics="m.jsonl")
    assert command[command.index("--tp") + 1] == "2" and command[2] == "4"
    assert "--tp" not in check.train_command(Layout(2, 1, 2, 1, 4, 2), 3, "m.jsonl")


@pytest.mark.parametrize("value", ["inf", "nan", "1e30", "0.5"])
def test_a_parameter_count_out_of_range_is_one_line_before_any_work(value, capsys, monkeypatch):
    """1e24 once searched for minutes and inf raised OverflowError: both are refused now."""
    monkeypatch.setattr("minimp.plan.cli.best_plans", lambda *a, **k: pytest.fail("searched"))
    assert main(["--parameters", value, "--gpus", "8", "--global-batch", "32"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--parameters must be between 1 and 1e+15" in error


def test_a_repeated_choice_lists_each_layout_once(capsys):
    args = ["--model", "shakespeare", "--gpus", "4", "--global-batch", "8", "--json"]
    assert main([*args, "--zero", "1,1"]) == 0
    repeated = json.loads(capsys.readouterr().out)["plans"]
    assert main([*args, "--zero", "1"]) == 0
    assert repeated == json.loads(capsys.readouterr().out)["plans"]


# ----- context parallelism (issue 39) --------------------------------------------------------
class ContextBytesAsSeconds(BytesAsSeconds):
    """BytesAsSeconds whose messages and all-to-alls cost the bytes one rank sends too."""

    def send(self, nbytes):
        return nbytes

    def all_to_all(self, nbytes, ranks):
        return (ranks - 1) / ranks * nbytes


def bytes_cluster(gpus):
    links = ContextBytesAsSeconds()  # and compute free: no hop is hidden
    return replace(small_cluster(gpus, gpus), peak_flops=1e300, intra=links, inter=links)


TRAINED = ModelShape(layers=2, hidden=32, heads=4, context=16, vocab=65, dropout=False)


@pytest.mark.parametrize("mode, precision", [
    ("ring", "fp16"), pytest.param("ulysses", "fp32", marks=pytest.mark.slow)])
def test_the_planner_predicts_the_trainers_context_bytes_and_memory_to_the_byte(mode, precision):
    """One step of the issue's small GPT at --cp 2 on the simulated world: what its metrics count
    (the context-parallel and data-parallel bytes, the activations kept) is what the planner
    predicts for the same layout; the ring's in-flight buffers are what the planner adds."""
    from minimp import backend
    from minimp import distributed as dist
    from minimp.train.loop import train

    config = TrainConfig(dataset="shakespeare", layers=2, hidden=32, heads=4, context=16,
                         batch_size=8, steps=1, eval_every=0, log_every=1000, precision=precision,
                         cp=2, cp_mode=mode, cp_layout="zigzag" if mode == "ring" else "contiguous")
    config.validate(2)
    with backend.limit_cpu_threads(1):
        results = dist.simulate(2, lambda comm: train(config, lambda line: None, comm))
    layout, job = Layout(1, 1, 1, 0, 8, 1, cp=2, cp_mode=mode), Job(8, (8,), precision=precision)
    buffers = mem.ring_buffer_bytes(TRAINED, layout, job)
    assert (buffers > 0) == (mode == "ring")
    time = step_time(TRAINED, bytes_cluster(2), job, layout)
    for result in results:
        record = result["history"][0]
        assert steptime.context_step_bytes(TRAINED, layout, job) == (
            record["bytes_by_group"]["context_parallel"])
        assert time.data_parallel == record["bytes_by_group"]["data_parallel"]  # over dp x cp
        kept = mem.activation_bytes(TRAINED, layout, job, stage=0) - buffers
        assert kept == record["peak_activation_bytes"]


@pytest.mark.parametrize("wire, zero", [pytest.param("bf16", 0, marks=pytest.mark.slow),
                                        ("fp8", 0), pytest.param("fp8", 1, marks=pytest.mark.slow)])
def test_the_planner_predicts_the_trainers_gradient_bytes_on_each_wire(wire, zero):
    """One step of the small GPT at --dp 2 --grad-comm-dtype bf16 or fp8: the data-parallel bytes
    the metrics count, on every rank, are the planner's (the fp8 wire's scales included: 4 bytes
    a message), and so are the model states held (the fp8 wire's float32 buckets)."""
    from minimp import backend
    from minimp import distributed as dist
    from minimp.train.loop import train

    config = TrainConfig(dataset="shakespeare", layers=2, hidden=32, heads=4, context=16,
                         batch_size=8, steps=1, eval_every=0, eval_batches=1, log_every=1000,
                         precision="bf16", dp=2, zero=zero, overlap=False, grad_comm_dtype=wire)
    config.validate(2)
    with backend.limit_cpu_threads(1):
        results = dist.simulate(2, lambda comm: train(config, lambda line: None, comm))
    layout = Layout(2, 1, 1, zero, 4, 1)
    job = Job(8, (4,), precision="bf16", **wire_fields(wire))
    time = step_time(TRAINED, bytes_cluster(2), job, layout)
    held = mem.model_state_bytes(TRAINED, layout, job, stage=0)
    del held["gradients16"]
    for result in results:
        record = result["history"][0]
        assert time.data_parallel + time.zero_in_step == record["bytes_by_group"]["data_parallel"]
    assert results[0]["model_state_by_kind"][0] == held  # rank 0's: the planner's largest chunks


@pytest.mark.parametrize("mode, formula", [("ring", ring_bytes), ("ulysses", ulysses_bytes)])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_bytes_the_planner_prices_are_ring_bytes_and_ulysses_bytes(mode, formula, recompute):
    """Every hop and all-to-all priced at its bytes, nothing hidden (free compute): the step's
    context-parallel seconds are the formulas' bytes for a rank's q (b, a/t, s/c, D), per block
    and micro-batch, the forward's twice with recomputation."""
    shape = ModelShape(layers=4, hidden=64, heads=8, context=32, vocab=50)
    layout = Layout(2, 2, 2, 0, 3, 4, recompute, cp=4, cp_mode=mode)  # 32 GPUs
    job = Job(24, (3,), precision="bf16")
    sent = formula((3, 8 // 2, 32 // 4, 64 // 8), BFLOAT16, 4)
    per_block = sent.forward * (1 + recompute) + sent.backward
    expected = 4 // 2 * 4 * per_block  # l/P blocks, M micro-batches
    time = step_time(shape, bytes_cluster(32), job, layout)
    assert time.context_parallel == pytest.approx(expected, rel=1e-12)
    assert steptime.context_step_bytes(shape, layout, job) == expected


def test_memory_with_cp_is_the_formula_by_hand():
    """A tiny GPT at tp 2 x cp 2, fp16, no dropout: each rank's s' = s/2 positions; the ring keeps
    O and a float32 log-sum-exp where one process keeps the probabilities, plus its buffers;
    Ulysses keeps the probabilities of a/(t c) heads of all s; ZeRO shards over dp x cp."""
    layers, h, a, s, v, b, d, t = 2, 32, 4, 16, 50, 3, 2, 2
    shape = ModelShape(layers, h, a, s, v, dropout=False)
    job, q = Job(6, (b,), precision="fp16"), s // 2
    n = b * q * h // t  # values in a rank's q, k, v or O
    block = 4 * d * q * b * h + 12 * d * q * b * h / t + 16 * q * b  # outside attention
    embedding = 8 * q * b + 8 * q  # token ids, positions
    head = q * b * (2 * d * h + 2 * 4 + d * v / t + 8)
    ring = Layout(1, t, 1, 0, b, 1, cp=2, cp_mode="ring")
    lse = 4 * b * (a // t) * q
    buffers = 2 * 2 * n * (d + 4)  # (k, v) twice in fp16 and (dK, dV) twice in float32
    by_hand = layers * (block + d * n + lse) + embedding + head + buffers
    assert mem.activation_bytes(shape, ring, job, stage=0) == by_hand
    assert mem.ring_buffer_bytes(shape, ring, job) == buffers
    ulysses = replace(ring, cp_mode="ulysses")
    probabilities = d * b * (a // (t * 2)) * s * s
    by_hand = layers * (block + probabilities) + embedding + head
    assert mem.activation_bytes(shape, ulysses, job, stage=0) == by_hand
    sharded = replace(ring, dp=2, zero=1)
    units = mem.stage_units(shape, sharded, 0)
    assert mem.model_state_bytes(shape, sharded, job, 0)["optimizer_state"] == memory_formula(
        1, unit_sizes=units, rank=0, world_size=4, compute_bytes=2, wire_bytes=4,
        slots=2)["optimizer_state"]  # fmt: skip


def test_a_ring_hop_slower_than_its_block_exposes_the_difference():
    """c - 1 forward hops, each max(step, send): a send of alpha + n beta longer than one ring
    step's attention exposes the difference; a shorter one nothing. Backward: the hops of k, v
    and of dK, dV behind twice the step, then the gradients' last hop, behind nothing."""
    shape, cp = ModelShape(layers=1, hidden=64, heads=4, context=64, vocab=10), 4
    layout, job = Layout(1, 1, 1, 0, 2, 1, cp=cp), Job(2, (2,), precision="fp16")
    cluster = small_cluster(gpus=4, per_node=4)
    step = 4 * 2 * 64 * 64 * 64 / cp / cp / cluster.flops  # 4 b s^2 h / c, a c-th of it a hop
    keys_values, gradients = 2 * (2 * 16 * 64) * 2, 2 * (2 * 16 * 64) * 4  # 2n d, 2n x 4
    for alpha in (3 * step, step / 2):  # a hop 3x its step (2 steps exposed), or half of it
        net = Network(alpha, 1e-15)
        slow = replace(cluster, intra=AlphaBeta(net))
        forward, backward = steptime.context_costs(shape, slow, job, layout)
        hop = alpha + keys_values * 1e-15
        assert forward == pytest.approx((cp - 1) * (hop - step) if hop > step else 0.0, rel=1e-9)
        assert (forward > (cp - 1) * 2 * step) == (alpha > step) and forward >= 0.0
        moving = 2 * alpha + (keys_values + gradients) * 1e-15
        last = alpha + gradients * 1e-15
        assert backward == pytest.approx((cp - 1) * max(0.0, moving - 2 * step) + last, rel=1e-9)


def test_context_parallel_messages_cross_nodes_when_cp_x_tp_does():
    shape = ModelShape(layers=2, hidden=64, heads=8, context=64, vocab=10)
    slow_between = small_cluster(gpus=8, per_node=4, inter=AlphaBeta(Network(1.0, 0.0)))
    job = Job(8, (1,))
    inside = Layout(2, 2, 1, 0, 1, 4, cp=2)  # cp x tp = 4 devices: one node
    across = Layout(1, 2, 1, 0, 1, 8, cp=4)  # 8: two nodes
    assert step_time(shape, slow_between, job, inside).context_parallel == 0.0
    assert step_time(shape, slow_between, job, across).context_parallel >= 2 * 8 * 1.0


def test_the_context_parallel_rules_count_against_the_first_broken():
    shape = ModelShape(layers=2, hidden=64, heads=4, context=12, vocab=10)  # 12: 2 x 6
    cluster, job = small_cluster(gpus=8), Job(8, (1,))  # grids as (dp, cp, tp, pp)
    assert broken_rule(shape, cluster, job, (4, 2, 1, 1), 1, "ring") == ""  # 2 cp = 4 | 12
    assert broken_rule(shape, cluster, job, (2, 4, 1, 1), 1, "ring") == "context"  # 8 !| 12
    assert broken_rule(shape, cluster, job, (2, 4, 1, 1), 1, "ulysses") == ""  # 4 | 12, 4 heads
    assert broken_rule(shape, cluster, job, (1, 4, 2, 1), 1, "ulysses") == "cp heads"  # 4 !| 2
    assert broken_rule(shape, cluster, job, (1, 8, 1, 1), 1, "ulysses") == "context"  # 8 !| 12
    found = search(shape, cluster, job, Choices(context_parallel=(1, 2, 4, 8)))
    assert {"context", "cp heads"} <= set(found.rejected)
    for plan in found.plans:
        x = plan.layout
        assert x.dp * x.cp * x.tp * x.pp == 8 and x.cp in (1, 2, 4, 8)
        if x.cp > 1 and x.cp_mode == "ring":
            assert shape.context % (2 * x.cp) == 0
        if x.cp_mode == "ulysses":
            assert shape.heads // x.tp % x.cp == 0 and shape.context % x.cp == 0
    assert {(x.layout.cp, x.layout.cp_mode) for x in found.plans} >= {(2, "ring"), (4, "ulysses")}


def test_7b_at_128k_picks_the_ring_because_nothing_with_cp_1_fits():
    """Issue 39's example on 64 of Selene's 80 GB A100s: every cp = 1 layout that keeps the other
    rules needs more memory than a GPU has (at cp = 1 attention keeps a/t heads' s x s
    probabilities); the default search then tries cp > 1 and picks a ring."""
    model, cluster, job = MODELS["7B-128k"], selene(64), Job(16)
    alone = search(model, cluster, job, Choices(context_parallel=(1,)))
    assert not alone.plans and alone.rejected["memory"] > 0
    assert alone.smallest_memory_rejected > cluster.memory_bytes
    assert set(alone.rejected) <= {"memory", "heads", "node", "batch", "layers"}
    plans = best_plans(model, cluster, job)
    assert plans[0].layout.cp > 1 and plans[0].layout.cp_mode == "ring"
    assert all(plan.layout.cp > 1 for plan in plans)
    assert all(plan.memory.total <= cluster.memory_bytes for plan in plans)


def test_the_command_prints_a_cp_layout_and_refuses_cp_one_for_7b_at_128k(capsys):
    flags = ["--model", "7B-128k", "--gpus", "64", "--global-batch", "16", "--top", "2"]
    assert main(flags) == 0
    rows = capsys.readouterr().out.splitlines()[3:]
    assert len(rows) == 2 and all(row.split()[-2:][0] == "ring" for row in rows)
    assert main(flags + ["--cp", "1"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "failed on the memory per GPU" in error
    assert main(flags + ["--cp-mode", "ulysses", "--top", "20", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]  # a block's probabilities while rebuilt
    assert {(plan["cp_mode"], plan["recompute"]) for plan in plans} == {("ulysses", True)}
    small = ["--model", "shakespeare", "--gpus", "4", "--global-batch", "8", "--json"]
    assert main(small + ["--cp", "any", "--top", "100"]) == 0  # cp > 1 searched though 1 fits
    assert {plan["cp"] for plan in json.loads(capsys.readouterr().out)["plans"]} == {1, 2, 4}


@pytest.mark.parametrize("value", ["3", "-2", "0", "x", "2,6", "8"])  # 8: more than 4 GPUs
def test_a_bad_cp_is_one_line_exit_2_before_any_work(value, capsys, monkeypatch):
    monkeypatch.setattr("minimp.plan.cli.best_plans", lambda *a, **k: pytest.fail("searched"))
    assert main(["--model", "shakespeare", "--gpus", "4", "--global-batch", "8",
                 "--cp", value]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("minimp.plan: error: --cp takes")


def test_measured_all_to_all_is_minimps_agreement_and_p_minus_1_messages():
    model = shipped_model(4)
    expected = model.agree + 3 * model.message(1e6 / 4)
    assert Measured(model).all_to_all(1e6, 4) == expected
    assert Measured(model).all_to_all(1e6, 1) == 0.0


# ----- mixture of experts and expert parallelism (issue 40) ----------------------------------
MIXTURE = ModelShape(layers=2, hidden=8, heads=2, context=4, vocab=10, dropout=False, experts=4,
                     top_k=2, expert_hidden=16)


def test_a_mixture_s_parameters_and_units_are_minimps():
    config = TrainConfig(dataset="shakespeare", model="gpt", layers=3, hidden=48, heads=4,
                         experts=4, top_k=2, expert_hidden=40)
    shape = ModelShape(3, 48, 4, 64, 65, experts=4, top_k=2, expert_hidden=40)
    assert shape.parameters() == parameter_count(config)
    assert [mem.stage_units(shape, Layout(1, 1, 1), 0)] == zero_unit_sizes(config)  # ep = 1
    assert MODELS["mixtral-8x7b"].parameters() == 32_366_927_872  # presets.py's 32.4B


@pytest.mark.parametrize("dtype, dropout", PRECISIONS)
def test_a_mixture_keeps_what_minimps_moe_gpt_keeps_to_the_byte(dtype, dropout):
    """The whole MoE GPT's graph, its loss made as the trainer's task makes it (the auxiliary
    losses added as `extra - extra.detach()`, minimp/train/tasks.py)."""
    from minimp.models.moe import MoE

    b, s, h, a, v, layers, experts, k, f = 3, 16, 32, 2, 50, 2, 4, 2, 48
    config = GPTConfig(v, s, layers, a, h, dropout, experts=experts, top_k=k, expert_hidden=f)
    model = GPT(config, np.random.default_rng(0)).to(dtype)
    model.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
    ids = np.random.default_rng(1).integers(0, v, (b, s))
    loss = F.cross_entropy(model(ids).reshape(-1, v), ids.reshape(-1))
    mixtures = [module for module in model.modules() if isinstance(module, MoE)]
    extra = sum((0.01 * m.aux_loss + 0.0 * m.z_loss for m in mixtures), Tensor(np.zeros((), "f4")))
    kept = saved_bytes(loss + (extra - extra.detach()),
                       exclude=[p.data for p in model.parameters()])
    shape = ModelShape(layers, h, a, s, v, dropout > 0, experts, k, f)
    job = Job(b, (b,), precision="fp16" if dtype == np.float16 else "fp32")
    assert mem.activation_bytes(shape, Layout(1, 1, 1, 0, b, 1), job, stage=0) == kept


def test_model_states_with_ep_by_hand():
    """MIXTURE at dp 4, ep 2, fp16 Adam: an expert 2hf + f + h = 280, a block's dense part
    4h^2 + 8h + E h = 352; a rank holds the dense 832 (embeddings (10 + 4) 8, 2 blocks, ln_f 16)
    and 2 of 4 experts of each block, 1,120. ZeRO 0: parallel/expert/layout.py's memory_by_kind;
    ZeRO 1: the dense states over 4 ranks, the experts' over the 2 replicas holding them."""
    job = Job(8, (1,), precision="fp16")
    zero0 = mem.model_state_bytes(MIXTURE, Layout(4, 1, 1, 0, ep=2), job, stage=0)
    by_kind = memory_by_kind([832], [1120], dp=4, ep=2, dp_rank=0, compute_bytes=2, slots=2)
    assert {kind: zero0[kind] for kind in by_kind} == by_kind
    assert zero0["buffers"] == 2 * 4 * (832 + 1120)
    zero1 = mem.model_state_bytes(MIXTURE, Layout(4, 1, 1, 1, ep=2), job, stage=0)
    shard = 832 // 4 + 1120 // 2
    assert zero1["parameters"] == 2 * 1952 and zero1["accumulators"] == 4 * 1952
    assert zero1["masters"] == 4 * shard and zero1["optimizer_state"] == 8 * shard
    # one unit's collective at a time (the trainer's ZeRO, both groups): the largest, 2 experts
    assert zero1["buffers"] == (2 * 4 + 2) * 560
    assert zero1["gradients16"] == 2 * 1952
    alone = mem.model_state_bytes(MIXTURE, Layout(2, 1, 1, 0, ep=2), job, stage=0)
    assert alone["buffers"] == 2 * 4 * 832  # dp/ep = 1: nothing to reduce the experts over


@pytest.mark.parametrize("experts, k, ep, rows, precision", [
    (4, 2, 2, 3, "fp16"), (8, 2, 4, 1, "fp32"), (8, 1, 8, 2, "bf16"), (6, 3, 3, 2, "fp16")])
def test_the_all_to_all_bytes_are_dispatch_bytes_for_balanced_counts(experts, k, ep, rows,
                                                                       precision):
    """What the planner prices for one block on one micro-batch is what dispatch.py's formula
    gives for balanced counts: every expert chosen T K / E times on each rank of the group."""
    shape = replace(MIXTURE, context=12, experts=experts, top_k=k)
    layout, job = Layout(ep, 1, 1, 0, rows, ep=ep), Job(ep * rows, (rows,), precision=precision)
    counts = np.full(experts, rows * shape.context * k // experts)  # (E,) on every rank
    to_rank = counts.reshape(ep, experts // ep).sum(axis=1)  # rows for each rank's experts
    sent = received = int(to_rank.sum() - to_rank[0])  # rank 0's rows away, and others' to it
    row_bytes = shape.hidden * job.compute_bytes
    expected = dispatch_bytes(1, sent, received, experts, ep, row_bytes)
    assert sum(steptime.expert_bytes(shape, layout, job)) == expected
    cluster = bytes_cluster(ep)  # its all-to-alls cost the bytes a rank sends: the step's too
    time = step_time(replace(shape, layers=2), cluster, job, replace(layout, micro_batches=1))
    assert time.expert_parallel == pytest.approx(2 * expected, rel=1e-12)


def test_the_all_to_alls_are_the_cost_models_by_hand():
    """Per block and micro-batch: the counts' all-to-all and two of the rows forward, two
    backward, each (p - 1) alpha + (p - 1)/p n beta, n a rank's N K rows of h d bytes."""
    net = Network(alpha=1e-5, beta=1e-9)
    layout, job = Layout(4, 1, 1, 0, 2, ep=4), Job(8, (2,), precision="fp16")
    counts = 3 * net.alpha + 3 / 4 * (4 * 8) * net.beta  # E = 4 int64 counts
    rows = 3 * net.alpha + 3 / 4 * (2 * 4 * 2 * 8 * 2) * net.beta  # b s K rows of h x 2 bytes
    forward, backward = steptime.expert_costs(MIXTURE, small_cluster(4, intra=AlphaBeta(net)),
                                              job, layout)
    assert forward == pytest.approx(counts + 2 * rows, rel=1e-12)
    assert backward == pytest.approx(2 * rows, rel=1e-12)
    across = small_cluster(8, per_node=2, intra=FREE, inter=AlphaBeta(net))  # 4 ranks, 2 nodes
    assert steptime.expert_costs(MIXTURE, across, job, layout)[1] == pytest.approx(2 * rows)
    assert steptime.expert_costs(MIXTURE, across, job, replace(layout, ep=1)) == (0.0, 0.0)


def test_a_mixture_s_flops_are_k_expert_mlps_a_token():
    dense, b = replace(MIXTURE, experts=0), 3
    s, h = MIXTURE.context, MIXTURE.hidden
    # K = 1 expert of 4h with E = 0 router rows: the dense block's FLOPs
    assert steptime.layer_forward_flops(replace(MIXTURE, top_k=1, expert_hidden=4 * h), b) == (
        steptime.layer_forward_flops(dense, b) + 2 * b * s * h * MIXTURE.experts)
    attention = 8 * b * s * h * h + 4 * b * s * s * h
    expected = attention + 2 * b * s * h * 4 + 2 * 2 * (2 * b * s * h * 16)  # router, 2 experts
    assert steptime.layer_forward_flops(MIXTURE, b) == expected


def test_ep_is_chosen_when_the_experts_do_not_fit_otherwise_and_tp_never():
    """MIXTURE on 4 GPUs too small for every expert's states on one rank without ZeRO: ep = 1
    fits nowhere, the search picks ep > 1; tp > 1 is refused for a mixture (minimp's trainer
    refuses --experts with --tp)."""
    job, choices = Job(8, (1,), precision="fp16"), Choices(zero_stages=(0,))
    cluster = small_cluster(4, memory=30_000)
    alone = search(MIXTURE, cluster, job, replace(choices, expert_parallel=(1,)))
    assert not alone.plans and alone.rejected["memory"] > 0
    assert alone.rejected["experts tp"] > 0 and alone.rejected["ep"] == 0
    found = search(MIXTURE, cluster, job, choices)
    assert found.plans and all(plan.layout.ep > 1 for plan in found.plans)
    assert {plan.layout.tp for plan in found.plans} == {1}
    assert all(plan.layout.dp % plan.layout.ep == 0 for plan in found.plans)
    assert found.rejected["ep"] > 0  # ep 4 with dp 2


def test_the_command_prints_an_ep_column_for_a_mixture_only(capsys):
    flags = ["--gpus", "8", "--global-batch", "8", "--top", "2"]
    assert main(["--model", "shakespeare", *flags]) == 0
    assert " ep " not in capsys.readouterr().out.splitlines()[2]
    assert main(["--model", "shakespeare", "--experts", "4", "--ep", "2,4", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "4 experts of 512, top-2" in lines[0]
    assert lines[2].split()[:4] == ["#", "dp", "ep", "tp"] and "  cp     ep s   bubble" in lines[2]
    assert all(int(row.split()[2]) in (2, 4) for row in lines[3:])


@pytest.mark.parametrize("flags, message", [
    (["--ep", "3"], "--ep takes sizes that divide --experts 4"),
    (["--ep", "x"], "--ep takes integers"),
    (["--experts", "0", "--ep", "2"], "--ep 2 needs a mixture of experts"),
    (["--top-k", "5"], "--top-k must be between 1 and --experts 4, got 5"),
    (["--experts", "-1"], "--experts and --expert-hidden must be 0 or more")])
def test_a_bad_mixture_flag_is_one_line_exit_2_before_any_work(flags, message, capsys,
                                                                monkeypatch):
    monkeypatch.setattr("minimp.plan.cli.best_plans", lambda *a, **k: pytest.fail("searched"))
    assert main(["--model", "shakespeare", "--experts", "4", "--gpus", "4", "--global-batch",
                 "8", *flags]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
