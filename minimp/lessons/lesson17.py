"""Lesson 17 (mixture of experts): the configuration of its runs, which the notebook and its claims
test (tests/lessons/test_lesson17.py) both import, the short trainings with and without the
auxiliary loss, an expert-parallel dispatch on simulated ranks, and the checkers of its exercises:
GShard's admission, the load-balancing loss, the all-to-all's bytes. Reference solutions:
lessons/solutions/lesson17.py."""

from typing import Any, Callable

import numpy as np

from minimp import Tensor, nn, no_grad
from minimp import functional as F
from minimp.distributed import all_to_all, all_to_all_single, simulate
from minimp.lessons.checking import Report, call, expect
from minimp.models.moe import MoE, Routing, load_balancing_loss, route
from minimp.train import TrainConfig, train

# ----- the notebook's configuration ---------------------------------------------------------------
# The short trainings: a 2-block MoE GPT on Shakespeare, 8 experts, top-2, capacity factor 1.0,
# 40 steps, with the auxiliary loss off and at 0.1 (the trainer's default is 0.01: 0.1 makes its
# effect visible within 40 steps).
TRAIN: dict[str, Any] = dict(
    dataset="shakespeare", layers=2, hidden=32, heads=2, context=32, batch_size=8, steps=40,
    warmup=1, lr=3e-3, precision="fp32", eval_every=0, log_every=1000, experts=8, top_k=2,
    capacity_factor=1.0, seed=0)
AUX_COEFS = (0.0, 0.1)
# The expert-parallel dispatch: one MoE layer of width 8, 8 experts (2 on each of 4 simulated
# ranks), top-2, capacity factor 1.0; each rank holds one sample of 16 tokens (float32).
RANKS, WIDTH, EXPERTS, TOP_K, CAPACITY_FACTOR, TOKENS = 4, 8, 8, 2, 1.0, 16
SEED = 17


def train_moe(aux_loss_coef: float) -> list[dict]:
    """The metrics rows of the short training (TRAIN) at this auxiliary-loss coefficient."""
    config = TrainConfig(**TRAIN, aux_loss_coef=aux_loss_coef)
    config.validate(1)
    result = simulate(1, lambda comm: train(config, lambda line: None, comm=comm))[0]
    return [row for row in result["history"] if "step" in row]


def moe_layer(capacity_factor: float = CAPACITY_FACTOR) -> MoE:
    """The dispatch's MoE layer (seeded): router, 8 experts of hidden width 4 x 8."""
    rng = np.random.default_rng(SEED)
    return MoE(WIDTH, EXPERTS, TOP_K, capacity_factor, 4 * WIDTH, True, nn.Dropout(0.0), rng)


def tokens() -> np.ndarray:
    """The tokens' activations: (RANKS, TOKENS, WIDTH) float32 standard normal, a sample a rank."""
    return np.random.default_rng(SEED + 1).standard_normal((RANKS, TOKENS, WIDTH)).astype(
        np.float32)


def router_probs(moe: MoE, x: np.ndarray) -> np.ndarray:
    """softmax(x @ router^T) in float32, the router's probabilities: (..., E) for x (..., C)."""
    with no_grad():
        logits = F.linear(Tensor(x.reshape(-1, x.shape[-1])), moe.router.weight)
        return F.softmax(logits, axis=-1).data.reshape(*x.shape[:-1], -1)


def expert_parallel(moe: MoE, x: np.ndarray, size: int = RANKS) -> dict[str, Any]:
    """moe's forward with expert parallelism on `size` simulated ranks, by hand: rank r holds
    sample x[r] and experts r E/size ... (r + 1) E/size - 1. It routes its tokens, exchanges how
    many rows each expert gets (all_to_all of E/size int64s to each rank), sends each admitted
    (token, choice) pair's row to the rank of its expert (the dispatch, all_to_all_single), runs
    its experts on the rows it received, sends the results back (the combine, the counts
    transposed) and adds them up weighted by the gates. Returns the output (size, T, C), each
    rank's kept pairs per expert (size, E) and its bytes sent in each of the three all-to-alls."""
    experts = len(moe.experts)
    per = experts // size  # experts on each rank

    def rank_body(comm):
        sample = x[comm.rank]  # (T, C)
        probs = router_probs(moe, sample)  # (T, E)
        routing = route(probs[None], moe.top_k, moe.capacity_factor)
        chosen, kept = routing.experts[0].reshape(-1), routing.kept[0].reshape(-1)  # (T K,)
        picked = np.take_along_axis(probs, routing.experts[0], axis=1)  # (T, K)
        gates = (picked / picked.sum(axis=1, keepdims=True)).reshape(-1)  # (T K,)
        # the admitted pairs, grouped by expert (so by destination rank), in token order inside
        pairs = [np.flatnonzero(kept & (chosen == e)) for e in range(experts)]
        counts = np.array([len(p) for p in pairs], np.int64)  # (E,)
        order = np.concatenate(pairs)
        send = sample[order // moe.top_k]  # (pairs, C)
        sent = [int(counts[j * per:(j + 1) * per].sum()) for j in range(size)]
        start = comm.bytes_sent
        # each rank learns how many rows each of its experts gets from every rank
        incoming = all_to_all(comm, [counts[j * per:(j + 1) * per] for j in range(size)],
                              output_split_sizes=(per,) * size)  # [from rank s: (per,)]
        after_counts = comm.bytes_sent
        received = all_to_all_single(comm, send, sent, [int(c.sum()) for c in incoming])
        after_dispatch = comm.bytes_sent
        out, row = np.empty_like(received), 0
        with no_grad():
            for source in range(size):
                for j in range(per):
                    rows = received[row:row + incoming[source][j]]
                    expert = moe.experts[comm.rank * per + j]
                    out[row:row + len(rows)] = expert(Tensor(rows)).data
                    row += len(rows)
        back = all_to_all_single(comm, out, [int(c.sum()) for c in incoming], sent)
        after_combine = comm.bytes_sent
        y = np.zeros_like(sample)
        for e in range(experts):  # each expert's part added in turn, as the MoE block does
            part = np.zeros_like(sample)
            lo = int(counts[:e].sum())
            np.add.at(part, pairs[e] // moe.top_k,
                      back[lo:lo + counts[e]] * gates[pairs[e]][:, None].astype(np.float32))
            y = y + part
        return (y, counts, after_counts - start, after_dispatch - after_counts,
                after_combine - after_dispatch)

    results = simulate(size, rank_body)
    return dict(output=np.stack([r[0] for r in results]),
                counts=np.stack([r[1] for r in results]),
                counts_bytes=[r[2] for r in results], dispatch_bytes=[r[3] for r in results],
                combine_bytes=[r[4] for r in results])


def one_process(moe: MoE, x: np.ndarray) -> np.ndarray:
    """moe's forward on all samples at once, in one process (no gradients)."""
    with no_grad():
        return moe(Tensor(x)).data


# ----- exercise 1: GShard's admission -------------------------------------------------------------
def _routing(seed: int, tokens: int, experts: int, top_k: int, factor: float,
             skew: float) -> Routing:
    """route() of one group of random probabilities, `skew` favouring the low experts."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((1, tokens, experts)) - skew * np.arange(experts) / experts
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    return route(probs, top_k, factor)


ADMIT_CASES = [(0, 8, 4, 1, 1.0, 1.0), (1, 32, 4, 2, 1.0, 2.0), (2, 24, 8, 2, 1.25, 3.0),
               (3, 40, 4, 2, 0.5, 1.0), (4, 16, 4, 2, 2.0, 0.5), (5, 30, 6, 3, 1.0, 2.0)]


def check_admit(admit: Callable, quiet: bool = False) -> Report:
    """admit(choices, capacity) -> kept: choices (T, K) ints, each token's K experts best first;
    kept (T, K) bools, the pairs an expert admits under GShard's order (every first choice, in
    token order, before any second choice) while it holds fewer than `capacity`. Compared with
    minimp's route()."""
    report = Report("admit", quiet)

    def compare(seed, tokens, experts, top_k, factor, skew):
        routing = _routing(seed, tokens, experts, top_k, factor, skew)
        choices = routing.experts[0].copy()
        got = np.asarray(call(admit, choices.copy(), routing.capacity))
        want = routing.kept[0]
        expect(got.shape == want.shape, f"T = {tokens}, K = {top_k}: kept of shape {got.shape}, "
               f"expected (T, K) = {want.shape}")
        held = [int(np.sum(got.astype(bool) & (choices == e))) for e in range(experts)]
        expect(max(held) <= routing.capacity,
               f"T = {tokens}, E = {experts}, K = {top_k}, capacity {routing.capacity}: an "
               f"expert admits {max(held)} pairs (per expert {held}), more than its capacity")
        wrong = np.argwhere(got.astype(bool) != want)[:3].tolist()
        expect(not wrong, f"T = {tokens}, E = {experts}, K = {top_k}, capacity "
               f"{routing.capacity}: (token, choice) {wrong} differ from GShard's admission")

    @report.case("top-1, 8 tokens, 4 experts, capacity 2",
                 hint="an expert holds at most `capacity` pairs: admit while it holds fewer "
                 "than capacity (position < capacity, not <=); a dropped pair is not admitted")
    def _():
        compare(*ADMIT_CASES[0])

    @report.case("top-2 and top-3, some experts overloaded: who gets the last places",
                 hint="GShard's order: every token's first choice, in token order, before any "
                 "second choice (choice-major); token-major order lets token 0's second choice "
                 "take a place token 9's first choice needed. One count per expert, over all "
                 "choices; a dropped pair takes no place")
    def _():
        for case in ADMIT_CASES[1:]:
            compare(*case)

    return report.finish()


# ----- exercise 2: the load-balancing loss --------------------------------------------------------
AUX_CASES = [(6, 16, 4, 2, 0.0, 0.5), (7, 32, 8, 2, 1.0, 3.0), (8, 20, 4, 1, 1.0, 4.0),
             (9, 24, 6, 3, 0.5, 2.0)]


def check_aux_loss(aux_loss: Callable, quiet: bool = False) -> Report:
    """aux_loss(probs, choices, kept) -> E sum_i f_i P_i (a float) for one group: probs (T, E) the
    router's probabilities, choices (T, K) and kept (T, K) as route() gives them; f_i the share of
    the T K pairs chosen for expert i BEFORE dropping, P_i the mean of probs[:, i] over all T
    tokens. Compared with minimp's load_balancing_loss (to a relative 1e-6)."""
    report = Report("aux_loss", quiet)

    def compare(probs, top_k, factor, name):
        routing = route(probs[None], top_k, factor)
        want = load_balancing_loss(Tensor(probs[None]), routing, top_k).item()
        got = float(call(aux_loss, probs.copy(), routing.experts[0].copy(),
                         routing.kept[0].copy()))
        experts = probs.shape[1]
        admitted = np.bincount(routing.experts[0][routing.kept[0]], minlength=experts)
        after = experts * float(np.sum(admitted / routing.kept[0].size * probs.mean(axis=0)))
        expect(np.isclose(got, want, rtol=1e-6, atol=0),
               f"{name}: {got:.6g}, expected {want:.6g}" +
               (f" (off by a factor E = {experts})" if np.isclose(got * experts, want) else "") +
               (f" (off by a factor K = {top_k})" if np.isclose(got, want * top_k) else "") +
               (" (f counted after dropping)" if np.isclose(got, after) else ""))

    @report.case("a balanced router (each token's top choice rotates over the experts): 1.0",
                 hint="E sum_i f_i P_i is 1 when both are uniform (f_i = P_i = 1/E): times E, "
                 "a sum over experts, not a mean; f_i divides by T K, the pairs, not T")
    def _():
        tokens, experts = 16, 4
        probs = np.full((tokens, experts), 0.2)
        probs[np.arange(tokens), np.arange(tokens) % experts] = 0.4
        probs[np.arange(tokens), (np.arange(tokens) + 1) % experts] = 0.3
        probs /= probs.sum(axis=1, keepdims=True)
        compare(probs, 2, 0.0, "balanced, T = 16, E = 4, K = 2")

    @report.case("random routers, skewed, with and without dropping",
                 hint="f_i counts the pairs chosen for expert i before dropping (the kept mask "
                 "does not enter the loss); P_i is the mean of probs[:, i] over all T tokens, "
                 "not over those that chose expert i; times E, a sum over experts")
    def _():
        for seed, tokens, experts, top_k, factor, skew in AUX_CASES:
            rng = np.random.default_rng(seed)
            logits = rng.standard_normal((tokens, experts)) - skew * np.arange(experts) / experts
            probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
            compare(probs, top_k, factor,
                    f"T = {tokens}, E = {experts}, K = {top_k}, capacity factor {factor}")

    return report.finish()


# ----- exercise 3: the all-to-all's bytes ---------------------------------------------------------
def check_dispatch_bytes(dispatch_bytes: Callable, quiet: bool = False) -> Report:
    """dispatch_bytes(counts, rank, row_bytes) -> (dispatch, combine): the payload bytes `rank`
    sends in expert parallelism's two all-to-alls; counts (p, E) ints, counts[s, e] the pairs rank
    s admitted for expert e; expert e lives on rank e // (E / p); a row is row_bytes. Compared
    with the formula on random counts and with the bytes the simulated ranks sent."""
    report = Report("dispatch_bytes", quiet)

    def want(counts, rank, row_bytes):
        p, experts = counts.shape
        owner = np.arange(experts) // (experts // p)
        away = counts[rank][owner != rank].sum()
        back = counts[:, owner == rank].sum() - counts[rank, owner == rank].sum()
        return int(away) * row_bytes, int(back) * row_bytes

    def compare(counts, rank, row_bytes, measured=None):
        got = call(dispatch_bytes, counts.copy(), rank, row_bytes)
        expect(len(got) == 2, f"returned {len(got)} things, expected (dispatch, combine)")
        dispatch, combine = (int(b) for b in got)
        right = measured or want(counts, rank, row_bytes)
        where = f"rank {rank} of p = {counts.shape[0]}, E = {counts.shape[1]}"
        expect(dispatch == right[0], f"{where}: dispatch {dispatch:,} bytes, expected "
               f"{right[0]:,}" + (" (the rows for this rank's own experts stay home: they are "
                                  "copied, not sent)" if dispatch == counts[rank].sum() *
                                  row_bytes else ""))
        expect(combine == right[1], f"{where}: combine {combine:,} bytes, expected "
               f"{right[1]:,}" + (" (the combine is not free: every row sent out comes back)"
                                  if combine == 0 else "") +
               (" (the combine sends back the rows this rank's experts RECEIVED, not those it "
                "sent)" if combine == right[0] != right[1] else ""))

    @report.case("4 simulated ranks, 8 experts, rows of 8 float32: the bytes they sent",
                 hint="dispatch: the rows bound for other ranks' experts (those for its own "
                 "experts stay home); combine: the results of the rows its experts received "
                 "from other ranks go back to them")
    def _():
        moe, x = moe_layer(), tokens()
        run = expert_parallel(moe, x)
        row_bytes = WIDTH * 4
        for rank in range(RANKS):
            compare(run["counts"], rank, row_bytes,
                    (run["dispatch_bytes"][rank], run["combine_bytes"][rank]))

    @report.case("random counts, p = 2, 4, 8, E = p to 4p",
                 hint="expert e lives on rank e // (E / p), contiguous blocks of E/p experts "
                 "(not e % p); the combine is the dispatch with the counts transposed")
    def _():
        rng = np.random.default_rng(40)
        for p, per in ((2, 1), (2, 3), (4, 2), (8, 4)):
            counts = rng.integers(0, 20, (p, p * per))
            for rank in range(p):
                compare(counts, rank, int(rng.integers(1, 9)) * 4)

    return report.finish()


EXERCISES = [
    ("admit", check_admit),
    ("aux_loss", check_aux_loss),
    ("dispatch_bytes", check_dispatch_bytes),
]
