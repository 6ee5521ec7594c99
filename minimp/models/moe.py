"""A mixture-of-experts MLP block (Switch, GShard, Mixtral): a router sends each token to its top-k
of E expert MLPs, and the output is the gate-weighted sum of what those experts return.

    probs = softmax(x @ router^T)                  (N, E), in float32
    chosen = the K largest probs of each token;    gate_k = p_k / sum of the chosen p
    y = sum_k gate_k * expert_{chosen k}(x)        for the (token, choice) pairs admitted

A routing group is ONE SAMPLE's sequence of T tokens: capacity, admission and the load-balancing
loss are computed per sample. Megatron groups the tokens of a rank's micro-batch instead; minimp
does not, so that which token goes where never depends on the layout (--dp, --micro-batches,
--ep): every layout routes every token as one process does. The experts run behind a seam
(ExpertDispatch): here on this process, with --ep on the ranks holding them (parallel/expert/).

Capacity per expert per group = ceil(capacity_factor x T x K / E) (capacity_factor 0: dropless).
Admission is GShard's (Lepikhin et al. 2020, section 2.2): every first choice before any second
choice, then by token index. A dropped (token, choice) contributes nothing: a token whose every
choice is dropped passes through the block's residual only. Each expert is an MLP of width
`hidden` (default the dense MLP's 4C): with top-2, a token's active MLP FLOPs are twice the dense
MLP's, while the parameters are E times.
"""

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from minimp import backend, nn
from minimp import functional as F
from minimp.backend import Array
from minimp.function import Context, Function
from minimp.tensor import Tensor, grad_enabled


@dataclass
class Routing:
    """Where a forward sent its tokens: experts (B, T, K), each token's choices, best first;
    kept (B, T, K), the (token, choice) pairs admitted; capacity, per expert per group; counts
    (B, E), the pairs each expert was chosen for in each group, before dropping."""

    experts: np.ndarray
    kept: np.ndarray
    capacity: int
    counts: np.ndarray


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """ceil(capacity_factor x T x K / E) pairs per expert per group; T x K (all) when dropless."""
    if capacity_factor == 0:
        return tokens * top_k
    return math.ceil(capacity_factor * tokens * top_k / experts)


def route(probs: np.ndarray, top_k: int, capacity_factor: float) -> Routing:
    """The routing of probs (B, T, E): each token's K most probable experts (ties: the lower
    expert index), then GShard's admission per group: first choices before second ones, each
    choice in token order, an expert admitting pairs until it holds `capacity`."""
    batch, tokens, experts = probs.shape
    chosen = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]  # (B, T, K)
    limit = capacity(tokens, top_k, experts, capacity_factor)
    # the admission order: (B, K, T) flattened per group, choice k of every token before k + 1
    order = chosen.transpose(0, 2, 1).reshape(batch, top_k * tokens)  # (B, K*T)
    one_hot = order[..., None] == np.arange(experts)  # (B, K*T, E)
    position = (np.cumsum(one_hot, axis=1) - 1)[one_hot].reshape(batch, top_k * tokens)
    kept = (position < limit).reshape(batch, top_k, tokens).transpose(0, 2, 1)  # (B, T, K)
    return Routing(chosen, kept, limit, one_hot.sum(axis=1))


class ExpertStats:
    """What a layer's training forwards routed since `reset` (the metrics: minimp/train/meter.py):
    load (E,), the (token, choice) pairs chosen for each expert before dropping; dropped, the
    pairs dropped; aux_loss, the sum of the forwards' load-balancing losses; forwards; block, the
    GPT block the layer is in (the metrics' per-block load)."""

    def __init__(self, experts: int, block: int = 0):
        self.block = block
        self.load = np.zeros(experts, np.int64)
        self.dropped, self.aux_loss, self.forwards = 0, 0.0, 0

    def add(self, routing: Routing, aux_loss: float) -> None:
        """Count one forward's routing."""
        self.load += routing.counts.sum(axis=0)
        self.dropped += int(routing.kept.size - routing.kept.sum())
        self.aux_loss, self.forwards = self.aux_loss + aux_loss, self.forwards + 1

    def reset(self) -> None:
        """Start counting anew (each step)."""
        self.load[...] = 0
        self.dropped, self.aux_loss, self.forwards = 0, 0.0, 0


@dataclass
class AuxLossWeights:
    """What a mixture's auxiliary losses weigh in the gradient: aux_loss_coef x aux +
    router_z_loss_coef x z joins the loss, and grad_scale is the gradient backward's root gives
    the loss (the loss scale / micro-batches, which the training loop sets before each step's
    actions: train/loop.py). One object serves every mixture of a model; a copy of the model
    (--ep's) shares it, so the loop's one update reaches every mixture."""

    aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    grad_scale: float = 1.0

    def __deepcopy__(self, memo: dict) -> "AuxLossWeights":
        return self  # shared, never copied (the docstring)


class AttachAuxLoss(Function):
    """y = x, with the scalar aux riding on y's graph (Megatron-Core's MoEAuxLossAutoScaler);
    dL/dx = dL/dy, and aux gets grad_scale, what the root's gradient gives the loss it joins.

    The auxiliary losses need no path to the root: backward reaches them wherever the block's
    backward runs, on any pipeline stage, in any micro-batch order, and in the recomputed forward
    of --recompute (whose first forward, without a graph, has nothing to attach to)."""

    @staticmethod
    def forward(ctx: Context, x: Array, aux: Array, grad_scale: float) -> Array:
        ctx.aux_shape, ctx.aux_dtype, ctx.grad_scale = aux.shape, aux.dtype, grad_scale
        return x

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array, Array]:
        grad_aux = backend.current_device().xp.full(ctx.aux_shape, ctx.grad_scale, ctx.aux_dtype)
        return grad_output, grad_aux


class Expert(nn.Module):
    """One expert: the dense MLP's C -> hidden, GELU, hidden -> C (nanoGPT's names)."""

    def __init__(self, width: int, hidden: int, bias: bool, rng: np.random.Generator):
        super().__init__()
        self.c_fc = nn.Linear(width, hidden, bias, rng=rng)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(hidden, width, bias, rng=rng)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (n, hidden) inside, (n, C)


class ExpertDispatch(Protocol):
    """The seam between routing and the experts: rows (n, C), the admitted pairs' activations
    sorted by expert (expert 0's rows first, each expert's in token order), counts (E,) the rows
    of each -> each row through its expert, (n, C) in the same order. One process runs them here
    (`run_locally`); --ep sends them to the ranks holding their experts and back
    (minimp/parallel/expert/dispatch.py)."""

    def __call__(self, experts: nn.Sequential, rows: Tensor, counts: np.ndarray) -> Tensor: ...


def run_locally(experts: nn.Sequential, rows: Tensor, counts: np.ndarray) -> Tensor:
    """Every expert on its own rows, on this process (counts (E,): one source of rows)."""
    return run_experts(list(experts), rows, counts.reshape(1, -1))


def run_experts(experts: Sequence[nn.Module], rows: Tensor, counts: np.ndarray) -> Tensor:
    """rows (n, C) from S sources one after another, each source's sorted by expert; counts
    (S, L) the rows source s has for expert l of `experts` -> each row through its expert, in
    place. Every expert runs, on 0 rows if none reached it: its gradients are then zeros, not
    absent, so every data-parallel replica reduces the same parameters. The outputs land in place
    by index_add on zeros: each row is written once, so the sum adds nothing to its bits."""
    sources, local = counts.shape
    starts = np.cumsum([0, *counts.reshape(-1)])[:-1].reshape(sources, local)
    out = None
    for index, expert in enumerate(experts):
        where = np.concatenate([np.arange(starts[s, index], starts[s, index] + counts[s, index])
                                for s in range(sources)]).astype(np.int64)
        part = F.index_add(expert(F.embedding(where, rows)), backend.to_device(where),
                           rows.shape[0])
        out = part if out is None else out + part
    assert out is not None  # E >= 1
    return out


class MoE(nn.Module):
    """The MoE MLP: x (B, T, C) -> (B, T, C). After each forward it holds `routing`, `aux_loss`
    (the Switch/GShard load-balancing loss, a float32 scalar Tensor) and `z_loss` (the router
    z-loss, ST-MoE's); a training forward attaches them, weighed by `aux_weights` (the task's),
    to its output's graph (AttachAuxLoss), so backward gives them their gradient."""

    def __init__(self, width: int, experts: int, top_k: int, capacity_factor: float,
                 hidden: int, bias: bool, dropout: nn.Dropout, rng: np.random.Generator,
                 block: int = 0):
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(width, experts, bias=False, rng=rng)  # no bias, as Mixtral's
        self.experts = nn.Sequential(*(Expert(width, hidden, bias, rng) for _ in range(experts)))
        self.dropout = dropout
        self.routing: Routing | None = None
        self.stats = ExpertStats(experts, block)  # the training forwards' counts, for the metrics
        self.aux_loss: Tensor | None = None
        self.z_loss: Tensor | None = None
        self.router_logits: Tensor | None = None
        self.dispatch: ExpertDispatch = run_locally  # --ep: parallel/expert/dispatch.py's
        self.aux_weights = AuxLossWeights()  # none by default; the task's (train/tasks.py)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        rows, k = batch * tokens, self.top_k
        flat = x.reshape(rows, width)  # (N, C), N = B*T
        # The router in float32 in every precision (input, weight, logits, softmax): a 16-bit
        # logit differs from its float32 value by up to 1/2048 of itself (fp16; 1/256 in bf16),
        # enough to flip which expert is in the top k, and a 16-bit softmax saturates. (float64,
        # the gradient checks' dtype, stays float64.)
        wide = np.promote_types(x.dtype, np.float32)
        logits = F.linear(flat.astype(wide), self.router.weight.astype(wide))  # (N, E)
        self.router_logits = logits  # (for the tests; Hugging Face's Mixtral returns them too)
        probs = F.softmax(logits, axis=-1)  # (N, E)
        experts = probs.shape[1]
        routing = route(backend.to_numpy(probs.data).reshape(batch, tokens, experts), k,
                        self.capacity_factor)
        chosen = routing.experts.reshape(rows * k)  # pair p = (token p // K, choice p % K)
        picked = F.embedding(np.arange(rows).repeat(k) * experts + chosen,
                             probs.reshape(rows * experts, 1)).reshape(rows, k)  # (N, K)
        gates = picked / picked.sum(axis=1, keepdims=True)  # renormalised over the K chosen
        gates = gates.reshape(rows * k, 1).astype(x.dtype)  # (N*K, 1), the activations' dtype
        kept = routing.kept.reshape(rows * k)
        # the admitted pairs sorted by expert, each expert's in token order (stable)
        pairs = np.flatnonzero(kept)
        pairs = pairs[np.argsort(chosen[pairs], kind="stable")]
        counts = np.bincount(chosen[pairs], minlength=experts)  # (E,) rows per expert
        y = self.dispatch(self.experts, F.embedding(pairs // k, flat), counts)  # (n, C)
        y = y * F.embedding(pairs, gates)
        out = F.index_add(y, backend.to_device(pairs // k), rows)  # (N, C): a token's K summed
        self.routing = routing
        self.aux_loss = load_balancing_loss(probs.reshape(batch, tokens, experts), routing, k)
        self.z_loss = z_loss(logits)
        if grad_enabled():  # a training forward (evaluations run under no_grad)
            self.stats.add(routing, self.aux_loss.item())
        return self._attach_aux_losses(self.dropout(out.reshape(batch, tokens, width)))

    def _attach_aux_losses(self, y: Tensor) -> Tensor:
        """y (B, T, C) carrying the weighed auxiliary losses to backward (when a graph is built
        and a coefficient is not 0)."""
        weights, terms = self.aux_weights, []
        if weights.aux_loss_coef and self.aux_loss is not None:
            terms.append(self.aux_loss * weights.aux_loss_coef)
        if weights.router_z_loss_coef and self.z_loss is not None:
            terms.append(self.z_loss * weights.router_z_loss_coef)
        if not (terms and grad_enabled()):
            return y
        penalty = terms[0] if len(terms) == 1 else terms[0] + terms[1]
        return AttachAuxLoss.apply(y, penalty, grad_scale=weights.grad_scale)


def load_balancing_loss(probs: Tensor, routing: Routing, top_k: int) -> Tensor:
    """Switch/GShard's auxiliary loss, per group, averaged over the B groups (float32):

        E x sum_i f_i P_i,  f_i = pairs routed to expert i before dropping / (T K),
                            P_i = the mean of expert i's router probability over the T tokens

    1 when the load and the probabilities are uniform; f is a count (no gradient), P carries it."""
    batch, tokens, experts = probs.shape
    fraction = routing.counts / (tokens * top_k)  # (B, E)
    weights = experts * fraction[:, None, :] / tokens / batch  # (B, 1, E): mean over t and b
    return (probs * backend.to_device(weights.astype(probs.dtype))).sum()


def z_loss(logits: Tensor) -> Tensor:
    """The router z-loss (Zoph et al. 2022, ST-MoE, section 3.1): mean of logsumexp(logits)^2 over
    the tokens, which keeps the logits small. logsumexp(x) = x - log_softmax(x), in each column."""
    logsumexp = (logits - F.log_softmax(logits, axis=-1))[:, 0]  # (N,)
    return (logsumexp * logsumexp).mean()
