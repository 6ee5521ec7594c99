"""Named models and clusters the planner knows: Narayanan et al.'s GPTs and cluster, this machine.

Narayanan, Shoeybi, Casper, LeGresley, Patwary, Korthikanti, Vainbrand, Kashinkunti, Bernauer,
Catanzaro, Phanishayee, Zaharia, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 1, "weak-scaling throughput for GPT models
ranging from 1 billion to 1 trillion parameters": A100 80 GB on Selene, 16-bit mixed precision,
sequence length 2048, vocabulary 51,200. Per row: billions of parameters, heads, hidden, layers,
tensor- and pipeline-parallel sizes t and p, GPUs, batch size, achieved TFLOP/s per GPU, % of the
312 TFLOP/s peak, aggregate PFLOP/s. The TFLOP/s count each step's FLOPs with their Eq. 3, which
includes a recomputation forward.

Where the numbers come from: a Markdown transcription of the paper's text in the search tool's
code index (which names no repository) has Table 1 as text; every number of TABLE_1 is as it gives
them, checked cell by cell on 2026-11-30, and so are the section 5 facts this file uses
(Selene's nodes, 312 TFLOP/s, V = 51,200, s = 2048, Eq. 2 and Eq. 3). Checks that do not rest on
the transcription: the abstract (Hugging Face's page of arXiv 2104.04473) gives "502
petaFLOP/s on 3072 GPUs", the 1008.0B row; Eq. 2's parameter counts of these shapes round to the
first column; TFLOP/s x GPUs and TFLOP/s / 312 reproduce the last two (tests/test_plan.py).

Selene as Narayanan et al. 2021 describe it (section 5): DGX A100 nodes of 8 80-GB A100s joined
by NVLink and NVSwitch, 8 200 Gb/s HDR InfiniBand adapters per node (one per GPU), 312 TFLOP/s
of 16-bit matrix math per GPU. Its networks, stated rather than measured: inside a node NVLink 3's
300 GB/s per direction per GPU (NVIDIA's 600 GB/s counts both), 5 us per message; between nodes
costmodel.DATACENTER, 200 Gb/s = 25 GB/s per GPU, 5 us. The achievable fraction, 0.6 of peak, is
one round figure for every model and GPU count, not fitted to any row of their table (which
reports 43-52% end to end: what the fraction leaves out, this planner leaves out too).
"""

from typing import NamedTuple

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
        gpus, gpus_per_node=8, memory_bytes=80 * GIB,  # nvidia-smi's 81,920 MiB
        peak_flops=312e12, achievable=SELENE_ACHIEVABLE,
        intra=AlphaBeta(NVLINK), inter=AlphaBeta(DATACENTER),
        name="Selene (DGX A100 80 GB, NVLink, 8 x 200 Gb/s HDR InfiniBand per node)")


def this_machine(ranks: int, flops_per_process: float, memory_bytes: float, cores: int) -> Cluster:
    """`ranks` processes on this one machine: every collective priced by the machine model minimp
    ships for that many ranks (machinemodel.shipped_model), each process computing at
    `flops_per_process` (measured alone with one thread) times cores / ranks when the ranks
    outnumber the cores (they share them; MPI's waiting ranks spin, so an idle stage's core is
    not freed), and the memory shared evenly."""
    links = Measured(shipped_model(ranks))
    return Cluster(
        ranks, gpus_per_node=ranks, memory_bytes=memory_bytes / ranks,
        peak_flops=flops_per_process * min(1.0, cores / ranks), achievable=1.0,
        intra=links, inter=links, name=f"this machine: {ranks} ranks on {cores} cores")


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
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0)]
# Table 1's shapes: sequence length 2048, vocabulary 51,200 (section 5.1)
MEGATRON = {row.name: ModelShape(row.layers, row.hidden, row.heads, context=2048, vocab=51200)
            for row in TABLE_1}  # fmt: skip
# minimp's own GPT as `python -m minimp.train --dataset shakespeare` builds it by default
SHAKESPEARE = ModelShape(layers=4, hidden=128, heads=4, context=64, vocab=65, dropout=False)
# A long context (issue 39's example): LLaMA 7B's shape (Touvron et al. 2023, Table 2: 32 layers
# of 4096, 32 heads; vocabulary 32,000) as minimp's GPT builds it (a GELU MLP 4x wide, learned
# positions: 7.1B parameters) at 128k = 131,072 tokens a sample, without dropout (minimp's
# trainer refuses dropout with --cp). At cp = 1 today's attention keeps a/t heads' s x s
# probabilities, 2 a s^2/t = 128 GiB a block at tp = 8: nothing fits on 80 GB (search.py).
LONG_CONTEXT_7B = ModelShape(layers=32, hidden=4096, heads=32, context=131072, vocab=32000,
                             dropout=False)
# A mixture of experts: Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv 2401.04088)
# as Hugging Face's MixtralConfig gives its defaults, "mistralai/Mixtral-8x7B-v0.1"
# (huggingface/transformers, src/transformers/models/mixtral/configuration_mixtral.py, read in the
# search tool's code index on 2026-12-06: vocab_size 32000, hidden_size 4096, intermediate_size
# 14336, num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8,
# num_local_experts 8, num_experts_per_tok 2, max_position_embeddings 32768), as minimp's GPT
# builds it: experts of two matrices and a GELU (Mixtral's have three, SwiGLU's w1, w2, w3),
# every head with its own keys and values (the planner has no grouped-query attention: Mixtral's
# 8 KV heads make k and v a quarter of this), LayerNorms, biases, learned positions and the head
# tied to the embedding (Mixtral's is its own): 32.4B parameters, 9.8B of them active a token,
# where the paper's abstract gives 47B and 13B. Trained here on 4,096 tokens a sample (the
# config allows 32,768: --context 32768 prices that), without dropout.
MIXTRAL_8X7B = ModelShape(layers=32, hidden=4096, heads=32, context=4096, vocab=32000,
                          dropout=False, experts=8, top_k=2, expert_hidden=14336)
MODELS = {"shakespeare": SHAKESPEARE, "7B-128k": LONG_CONTEXT_7B, "mixtral-8x7b": MIXTRAL_8X7B,
          **MEGATRON}
