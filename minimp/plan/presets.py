"""Named models and clusters the planner knows: Narayanan et al.'s GPTs and cluster, this machine.

Selene as Narayanan et al. 2021 describe it (section 5): DGX A100 nodes of 8 80-GB A100s joined
by NVLink and NVSwitch, 8 200 Gb/s HDR InfiniBand adapters per node (one per GPU), 312 TFLOP/s
of 16-bit matrix math per GPU. Its networks, stated rather than measured: inside a node NVLink 3's
300 GB/s per direction per GPU (NVIDIA's 600 GB/s counts both), 5 us per message; between nodes
costmodel.DATACENTER, 200 Gb/s = 25 GB/s per GPU, 5 us. The achievable fraction, 0.6 of peak, is
one round figure for every model and GPU count, not fitted to any row of their table (which
reports 43-52% end to end: what the fraction leaves out, this planner leaves out too).
"""

from minimp.measure.costmodel import DATACENTER, Network
from minimp.measure.machinemodel import shipped_model
from minimp.plan.inputs import Cluster, ModelShape
from minimp.plan.links import AlphaBeta, Measured

GIB = 2**30
NVLINK = Network(alpha=5e-6, beta=1 / 300e9, gamma=1 / 1e12, name="NVLink 3, 300 GB/s a way")
SELENE_ACHIEVABLE = 0.6


def selene(gpus: int) -> Cluster:
    """`gpus` A100s of Selene (module docstring)."""
    return Cluster(
        gpus=gpus,
        gpus_per_node=8,
        memory_bytes=80 * GIB,  # nvidia-smi's 81,920 MiB
        peak_flops=312e12,
        achievable=SELENE_ACHIEVABLE,
        intra=AlphaBeta(NVLINK),
        inter=AlphaBeta(DATACENTER),
        name="Selene (DGX A100 80 GB, NVLink, 8 x 200 Gb/s HDR InfiniBand per node)",
    )


def this_machine(ranks: int, flops_per_process: float, memory_bytes: float, cores: int) -> Cluster:
    """`ranks` processes on this one machine: every collective priced by the machine model minimp
    ships for that many ranks (machinemodel.shipped_model), each process computing at
    `flops_per_process` (measured alone with one thread) times cores / ranks when the ranks
    outnumber the cores (they share them; MPI's waiting ranks spin, so an idle stage's core is
    not freed), and the memory shared evenly."""
    links = Measured(shipped_model(ranks))
    return Cluster(
        gpus=ranks,
        gpus_per_node=ranks,
        memory_bytes=memory_bytes / ranks,
        peak_flops=flops_per_process * min(1.0, cores / ranks),
        achievable=1.0,
        intra=links,
        inter=links,
        name=f"this machine: {ranks} ranks on {cores} cores",
    )


# Narayanan et al. 2021, Table 1's shapes: sequence length 2048, vocabulary 51,200 (section 5.1)
MEGATRON = {
    "1.7B": ModelShape(layers=24, hidden=2304, heads=24, context=2048, vocab=51200),
    "3.6B": ModelShape(layers=30, hidden=3072, heads=32, context=2048, vocab=51200),
    "7.5B": ModelShape(layers=36, hidden=4096, heads=32, context=2048, vocab=51200),
    "18.4B": ModelShape(layers=40, hidden=6144, heads=48, context=2048, vocab=51200),
    "39.1B": ModelShape(layers=48, hidden=8192, heads=64, context=2048, vocab=51200),
    "76.1B": ModelShape(layers=60, hidden=10240, heads=80, context=2048, vocab=51200),
    "145.6B": ModelShape(layers=80, hidden=12288, heads=96, context=2048, vocab=51200),
    "310.1B": ModelShape(layers=96, hidden=16384, heads=128, context=2048, vocab=51200),
    "529.6B": ModelShape(layers=105, hidden=20480, heads=128, context=2048, vocab=51200),
    "1008.0B": ModelShape(layers=128, hidden=25600, heads=160, context=2048, vocab=51200),
}
# minimp's own GPT as `python -m minimp.train --dataset shakespeare` builds it by default
SHAKESPEARE = ModelShape(layers=4, hidden=128, heads=4, context=64, vocab=65, dropout=False)
MODELS = {"shakespeare": SHAKESPEARE, **MEGATRON}

