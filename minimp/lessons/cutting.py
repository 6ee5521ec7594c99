"""What lesson 12 (cutting every layer) draws and measures: the column/row split as a figure, the
MLP pair it cuts, one training step of a small GPT cut three ways on simulated ranks (bytes sent
and held per rank), and the planner's inputs for a large GPT on a cluster.

The step is written out by hand, each layout in a few lines, so that what travels is visible:
data parallelism all-reduces the float32 gradients once (one bucket); tensor parallelism cuts the
blocks (minimp.parallel.parallelize_module) and its f's and g's send inside forward and backward;
the pipeline sends the activation between its two stages forward and its gradient backward, and
sums the tied token embedding's two copies. One micro-batch a step, float16 activations.
"""

from typing import Any

import numpy as np

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp import functional as F
from minimp.data import load_shakespeare, text_batch
from minimp.models.gpt import GPT, GPTConfig
from minimp.parallel import parallelize_module
from minimp.parallel.tensor.mappings import all_reduce
from minimp.plan.inputs import Cluster, Job, ModelShape
from minimp.plan.presets import MODELS, selene
from minimp.tensor import saved_bytes

PAIR_WIDTH, PAIR_ROWS = 8, 3  # h and n of the column -> row pair

CONFIG = GPTConfig(vocab_size=65, context=32, layers=4, heads=4, width=64, dropout=0.1)
BATCH_SIZE = 8  # b: sequences in the step, one micro-batch (data parallelism: b / 2 a replica)
LAYOUTS = ("one process", "dp 2", "tp 2", "tp 2 + sp", "pp 2")


def mlp_pair() -> tuple[nn.Linear, nn.Linear, np.ndarray, np.ndarray]:
    """The pair's whole float64 Linears A (4h, h) and B (h, 4h), its input x (n, h) and dL/dy
    (n, h), the same on every rank."""
    rng = np.random.default_rng(0)
    first = nn.Linear(PAIR_WIDTH, 4 * PAIR_WIDTH, rng=rng)
    second = nn.Linear(4 * PAIR_WIDTH, PAIR_WIDTH, rng=rng)
    first.to(np.float64), second.to(np.float64)  # in place
    x = rng.standard_normal((PAIR_ROWS, PAIR_WIDTH))
    grad_y = rng.standard_normal((PAIR_ROWS, PAIR_WIDTH))
    return first, second, x, grad_y


def batch() -> tuple[np.ndarray, np.ndarray]:
    """The step's ids and targets, (BATCH_SIZE, context) each."""
    data = load_shakespeare().train
    return text_batch(data, seed=0, step=1, batch_size=BATCH_SIZE, context=CONFIG.context)


def one_step(comm: Any, layout: str) -> dict:
    """Forward and backward of CONFIG's GPT on this rank, as `layout` cuts it: {loss, sent by
    group, parameter bytes, bytes the blocks keep for backward}."""
    model = GPT(CONFIG, np.random.default_rng(0))  # every rank builds the whole float32 model
    if layout.startswith("tp"):
        plan = parallelize_module(model, comm, sequence_parallel=layout.endswith("sp"))
    model.to(np.float16)
    ids, targets = batch()
    rows = np.arange(BATCH_SIZE)
    if layout.startswith("dp"):
        rows = np.array_split(rows, comm.size)[comm.rank]
        ids, targets = ids[rows], targets[rows]
    model.set_dropout_state(seed=0, step=1, sample_indices=rows)
    layers = list(model.layers)
    if layout.startswith("pp"):  # two stages: the embeddings and half the blocks, then the rest
        half = 1 + CONFIG.layers // 2
        layers = layers[:half] if comm.rank == 0 else layers[half:]
    weights = [p.data for layer in layers for p in layer.parameters()]
    if layout.startswith("pp") and comm.rank == 1:
        weights.append(model.tied_parameters()[0][1].data)  # the head's copy of the tied weight
    sent: dict[str, int] = {}

    def count(group: str, before: int) -> None:
        sent[group] = sent.get(group, 0) + comm.bytes_sent - before

    start = comm.bytes_sent
    if layout.startswith("pp") and comm.rank == 1:
        shape = (BATCH_SIZE, CONFIG.context, CONFIG.width)  # (B, T, C): stage 0's output
        x = Tensor(np.empty(shape, np.float16), requires_grad=True)
        comm.recv(x.data, 0)
        received = x
    else:
        x = layers[0](Tensor(ids))  # the embeddings: (B, T, C)
    before_blocks = saved_bytes(x, exclude=weights)
    blocks = [layer for layer in layers if layer is not model.layers[-1]]
    blocks = blocks[1:] if blocks and blocks[0] is model.layers[0] else blocks
    for block in blocks:
        x = block(x)
    kept_blocks = saved_bytes(x, exclude=weights) - before_blocks
    if layout.startswith("pp") and comm.rank == 0:
        before = comm.bytes_sent
        comm.send(x.data, 1)
        count("pipeline", before)
        grad = np.empty_like(x.data)
        comm.recv(grad, 1)
        x.backward(grad)
        loss = None
    else:
        logits = model.layers[-1](x)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets.reshape(-1))
        loss.backward()
        if layout.startswith("pp"):
            before = comm.bytes_sent
            comm.send(received.grad, 0)
            count("pipeline", before)
    if layout.startswith("tp"):
        count("tensor_parallel", start)
        before = comm.bytes_sent  # sequence parallelism's partial gradients, summed in float32
        for name, parameter in model.named_parameters():
            if name in plan.partial:
                all_reduce(comm, np.asarray(parameter.grad, np.float32))
        count("tensor_parallel", before)
    _synchronize(comm, layout, model, layers, count)
    return {
        "loss": None if loss is None else loss.item(),
        "sent": sent,
        "parameters": sum(w.nbytes for w in weights),
        "kept_blocks": kept_blocks,
    }


def _synchronize(comm: Any, layout: str, model: GPT, layers: list, count: Any) -> None:
    """After backward: the replicas' float32 gradients summed in one bucket (dp); the tied
    embedding's two copies summed in float32 (pp)."""
    before = comm.bytes_sent
    if layout.startswith("dp"):
        grads = [np.asarray(p.grad, np.float32).ravel() for p in model.parameters()]
        dist.ring_allreduce(comm, np.concatenate(grads))
        count("data_parallel", before)
    if layout.startswith("pp"):
        tied = np.asarray(model.tied_parameters()[0][1].grad, np.float32)
        dist.ring_allreduce(comm, tied)
        count("tied", before)


def measure() -> dict[str, list[dict]]:
    """Every layout of LAYOUTS: each rank's one_step (one process: a world of 1)."""
    return {
        layout: dist.simulate(1 if layout == "one process" else 2, one_step, layout)
        for layout in LAYOUTS
    }


# The planner's example: the 76.1B GPT of Narayanan et al. 2021 (Table 1) on 1,024 GPUs of Selene
PLANNED_MODEL, PLANNED_GPUS, PLANNED_BATCH = "76.1B", 1024, 1792
PLANNER_ARGUMENTS = ["--model", PLANNED_MODEL, "--cluster", "selene", "--gpus",
                     str(PLANNED_GPUS), "--global-batch", str(PLANNED_BATCH), "--top", "5"]


def planned() -> tuple[ModelShape, Cluster, Job]:
    """The model, cluster and job that PLANNER_ARGUMENTS give `python -m minimp.plan`."""
    return MODELS[PLANNED_MODEL], selene(PLANNED_GPUS), Job(PLANNED_BATCH)


def split_figure(ranks: int = 2) -> None:
    """The column -> row pair drawn: x (whole on every rank), A^T cut into columns (rank r computes
    its columns of x A^T), that split activation, B^T cut into rows, each rank's partial output
    and their sum; each rank's pieces in its own colour, whole arrays in grey."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # one a rank
    figure, axis = plt.subplots(figsize=(11, 3.4))
    h, wide, n = 2.0, 4.0, 1.5  # drawn sizes: the width h, the MLP's 4h, the rows n

    def draw(x0: float, rows: float, columns: float, cut: str, label: str) -> None:
        """A (rows x columns) array at x0; cut: "columns", "rows" or "" (whole)."""
        for r in range(ranks if cut else 1):
            if cut == "columns":
                box = (x0 + r * columns / ranks, 0.0, columns / ranks, rows)
            elif cut == "rows":
                box = (x0, rows - (r + 1) * rows / ranks, columns, rows / ranks)
            else:
                box = (x0, 0.0, columns, rows)
            axis.add_patch(Rectangle(box[:2], box[2], box[3], edgecolor="black", alpha=0.55,
                                     facecolor=colours[r] if cut else "lightgrey"))
        axis.text(x0 + columns / 2, -0.3, label, ha="center", va="top", fontsize=9)

    draw(0.0, n, h, "", "x (n, h):\nwhole on every rank")
    axis.text(2.6, n / 2, "f", fontsize=15, ha="center", va="center")
    draw(3.2, h, wide, "columns", "A^T (h, 4h): column-parallel,\n4h/t columns a rank")
    draw(7.9, n, wide, "columns", "relu(x A^T) (n, 4h):\nsplit, never sent")
    draw(12.6, wide, h, "rows", "B^T (4h, h): row-\nparallel, 4h/t rows\na rank")
    for r in range(ranks):  # the partial outputs, stacked
        offset = 0.15 * r
        axis.add_patch(Rectangle((16.0 + offset, offset), h, n, edgecolor="black",
                                 facecolor=colours[r], alpha=0.55))
    axis.text(16.0 + h / 2, -0.3, "partial sums (n, h):\none a rank", ha="center", va="top",
              fontsize=9)
    axis.text(18.75, n / 2, "g", fontsize=15, ha="center", va="center")
    draw(19.3, n, h, "", "y (n, h): their sum\n(all-reduce), whole")
    axis.set_xlim(-0.2, 21.5)
    axis.set_ylim(-1.3, wide + 0.2)
    axis.set_aspect("equal")
    axis.axis("off")
    axis.set_title(f"an MLP, x -> relu(x A^T) B^T, on {ranks} tensor-parallel ranks")
    plt.show()
