"""The planner against Narayanan et al. 2021's Table 1: does it pick their (t, p), how fast is it?

Narayanan, Shoeybi, Casper, LeGresley, Patwary, Korthikanti, Vainbrand, Kashinkunti, Bernauer,
Catanzaro, Phanishayee, Zaharia, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 1, "weak-scaling throughput for GPT models
ranging from 1 billion to 1 trillion parameters": A100 80 GB on Selene, 16-bit mixed precision,
sequence length 2048, vocabulary 51,200. Per row: billions of parameters, heads, hidden, layers,
tensor- and pipeline-parallel sizes t and p, GPUs, batch size, achieved TFLOP/s per GPU, % of the
312 TFLOP/s peak, aggregate PFLOP/s. The TFLOP/s count each step's FLOPs with their Eq. 3, which
includes a recomputation forward.

Where the numbers come from: a Markdown transcription of the paper's text in the search tool's
code index (which names no repository) has Table 1 as text; every number below is as it gives
them, checked cell by cell on 2026-11-30, and so are the section 5 facts the presets use
(Selene's nodes, 312 TFLOP/s, V = 51,200, s = 2048, Eq. 2 and Eq. 3). Checks that do not rest on
the transcription: the abstract (Hugging Face's page of arXiv 2104.04473) gives "502
petaFLOP/s on 3072 GPUs", the 1008.0B row; Eq. 2's parameter counts of these shapes round to the
first column; TFLOP/s x GPUs and TFLOP/s / 312 reproduce the last two (tests/test_plan.py).
Their runs used the interleaved 1F1B schedule with the scatter/gather optimization (section 5.1),
whose bubble is smaller than the plain 1F1B bubble this planner prices.

One cluster (presets.selene) for every row, the batch of each row, micro-batches of 1, 2, 4 or 8
rows: nothing is fitted to a row.
"""

from typing import NamedTuple

from minimp.plan.inputs import Job
from minimp.plan.presets import MEGATRON, selene
from minimp.plan.search import Choices, Plan, best_plans
from minimp.plan.steptime import narayanan_flops


class Row(NamedTuple):
    """One row of Table 1."""

    billions: float
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    gpus: int
    batch: int
    tflops: float  # achieved TFLOP/s per GPU (Eq. 3's FLOPs)
    percent_of_peak: int
    aggregate_pflops: float

    @property
    def name(self) -> str:
        return f"{self.billions:.1f}B"

    @property
    def d(self) -> int:
        return self.gpus // (self.t * self.p)


TABLE_1 = [
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
]
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
    theirs = [p for p in menu if (p.layout.tp, p.layout.pp) == (row.t, row.p)]
    paper = paper_step_seconds(row)
    return {
        "row": row,
        "paper_seconds": paper,
        "best": best,
        "best_in_menu": menu[0],
        "at_theirs": theirs[0] if theirs else None,  # None: their (t, p) does not fit here
        "ratio_best": paper / best.time.total,
        "ratio_menu": paper / menu[0].time.total,
        "ratio_theirs": paper / theirs[0].time.total if theirs else None,
    }


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
    lines = [
        "| model | GPUs | batch | paper (t, p, d) | paper TFLOP/s | planner at their (t, p) | "
        "TFLOP/s | planner / paper | planner's best in their menu | TFLOP/s | planner's best "
        "| TFLOP/s |",
        "|" + " --- |" * 12,
    ]
    for found in comparisons:
        row, theirs = found["row"], found["at_theirs"]
        menu, best = found["best_in_menu"], found["best"]
        cells = [
            row.name, row.gpus, row.batch, f"({row.t}, {row.p}, {row.d})", row.tflops,
            _grid(theirs), f"{eq_3_tflops(row, theirs):.0f}" if theirs else "-",
            f"{found['ratio_theirs']:.2f}" if theirs else "-",
            _grid(menu), f"{eq_3_tflops(row, menu):.0f}",
            _grid(best), f"{eq_3_tflops(row, best):.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)
