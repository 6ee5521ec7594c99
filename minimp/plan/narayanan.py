"""The planner against Narayanan et al. 2021's Table 1: does it pick their (t, p), how fast is it?

Table 1 (presets.py: the paper, the table's columns, where the numbers come from) gives for each
GPT the tensor- and pipeline-parallel sizes t and p its run used and the TFLOP/s per GPU it reached.
Their runs used the interleaved 1F1B schedule with the scatter/gather optimization (section 5.1),
whose bubble is smaller than the plain 1F1B bubble this planner prices.

One cluster (presets.selene) for every row, the batch of each row, micro-batches of 1, 2, 4 or 8
rows: nothing is fitted to a row.
"""

from minimp.plan.inputs import Job
from minimp.plan.presets import MEGATRON, TABLE_1, Row, selene
from minimp.plan.search import Choices, Plan, best_plans
from minimp.plan.steptime import narayanan_flops

ROW_NAMES = tuple(row.name for row in TABLE_1)
MICRO_BATCH_SIZES = (1, 2, 4, 8)
# What Megatron-LM offered in 2021: no ZeRO (its distributed optimizer came later), no sequence
# parallelism (Korthikanti et al. 2022), recomputation on (Eq. 3 counts it).
THEIR_MENU = Choices(zero_stages=(0,), recompute=(True,), sequence_parallel=(False,))


def paper_step_seconds(row: Row) -> float:
    """Their step time: Eq. 3's FLOPs for the batch / (GPUs x achieved FLOP/s)."""
    return narayanan_flops(MEGATRON[row.name], row.batch) / (row.gpus * row.tflops * 1e12)


def compare(row: Row) -> dict:
    """The planner's best layout for the row (any choice; and within their menu), its predicted
    step time, and the prediction for their own (t, p) in their menu; ratios are paper step
    time / predicted (> 1: the planner predicts faster than they measured)."""
    model, cluster = MEGATRON[row.name], selene(row.gpus)
    job = Job(row.batch, MICRO_BATCH_SIZES, precision="bf16")
    best = best_plans(model, cluster, job)[0]
    menu = best_plans(model, cluster, job, THEIR_MENU)
    theirs = next((p for p in menu if (p.layout.tp, p.layout.pp) == (row.t, row.p)), None)
    paper = paper_step_seconds(row)
    return {
        "row": row, "paper_seconds": paper, "best": best, "best_in_menu": menu[0],
        "at_theirs": theirs,  # None: their (t, p) does not fit here
        "ratio_best": paper / best.time.total, "ratio_menu": paper / menu[0].time.total,
        "ratio_theirs": paper / theirs.time.total if theirs else None}


def _grid(plan: Plan | None) -> str:
    if plan is None:
        return "does not fit"
    layout = plan.layout
    text = f"({layout.tp}, {layout.pp}, {layout.dp}) b {layout.micro_batch_size}"
    extras = [f"zero {layout.zero}"] * (layout.zero > 0)
    extras += ["rc"] * layout.recompute + ["sp"] * layout.sequence_parallel
    return " ".join([text] + extras)


def eq_3_tflops(row: Row, plan: Plan) -> float:
    """A plan's throughput in the paper's unit: Eq. 3's FLOPs of the row's batch / (predicted
    step x GPUs), whether or not the plan recomputes (the paper's samples per second, scaled)."""
    return narayanan_flops(MEGATRON[row.name], row.batch) / (plan.time.total * row.gpus) / 1e12


def comparison_table(names: tuple[str, ...] = ROW_NAMES) -> str:
    """The comparison of the named rows as a Markdown table (see `format_comparison`)."""
    return format_comparison([compare(row) for row in TABLE_1 if row.name in names])


def format_comparison(comparisons: list[dict]) -> str:
    """`compare`'s results as a Markdown table: layouts as (t, p, d), micro-batch size b;
    TFLOP/s in Eq. 3's unit (`eq_3_tflops`); planner / paper = paper step / predicted step."""
    header = ("| model | GPUs | batch | paper (t, p, d) | paper TFLOP/s | planner at their (t, p) "
              "| TFLOP/s | planner / paper | planner's best in their menu | TFLOP/s | planner's "
              "best | TFLOP/s |")
    lines = [header, "|" + " --- |" * 12]
    for found in comparisons:
        row, theirs = found["row"], found["at_theirs"]
        menu, best = found["best_in_menu"], found["best"]
        cells = [
            row.name, row.gpus, row.batch, f"({row.t}, {row.p}, {row.d})", row.tflops,
            _grid(theirs), f"{eq_3_tflops(row, theirs):.0f}" if theirs else "-",
            f"{found['ratio_theirs']:.2f}" if theirs else "-",
            _grid(menu), f"{eq_3_tflops(row, menu):.0f}",
            _grid(best), f"{eq_3_tflops(row, best):.0f}"]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)
