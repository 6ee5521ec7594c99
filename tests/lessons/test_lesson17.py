"""Lesson 17 (mixture of experts): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/17_mixture_of_experts.ipynb became false, or a checker passes a wrong answer."""

import functools
import math

import numpy as np
import pytest
from exercising import Wrong, exercise_tests

from minimp.lessons.lesson17 import (
    AUX_COEFS,
    CAPACITY_FACTOR,
    EXPERTS,
    RANKS,
    TOKENS,
    TOP_K,
    TRAIN,
    WIDTH,
    expert_parallel,
    moe_layer,
    one_process,
    router_probs,
    tokens,
    train_moe,
)
from minimp.models.gpt import GPT, GPTConfig
from minimp.models.moe import capacity, route


def test_the_lessons_configuration():
    assert (RANKS, WIDTH, EXPERTS, TOP_K, CAPACITY_FACTOR, TOKENS) == (4, 8, 8, 2, 1.0, 16)
    assert (TRAIN["experts"], TRAIN["top_k"], TRAIN["capacity_factor"]) == (8, 2, 1.0)
    assert AUX_COEFS == (0.0, 0.1) and TRAIN["steps"] == 40


def test_why_sparse_the_parameter_counts():
    """The prose: a width-128 GPT of 4 blocks, dense against 8 experts with top-2: 5.56 x the
    parameters, 1.66 x those a token uses (its 2 experts' and the routers')."""
    def count(model):
        return sum(p.size for p in model.parameters())

    rng = np.random.default_rng(0)
    dense, sparse = GPT(GPTConfig(), rng), GPT(GPTConfig(experts=8, top_k=2), rng)
    expert = 2 * 128 * 512 + 512 + 128  # c_fc and c_proj with biases: one dense MLP
    assert count(sparse.layers[1].mlp.experts[0]) == expert == 131_712
    assert count(sparse) - count(dense) == 4 * (7 * expert + 8 * 128)  # 7 more experts, router
    active = count(sparse) - 4 * 6 * expert  # 6 of 8 experts idle for each token
    assert active - count(dense) == 4 * (expert + 8 * 128)
    assert (count(dense), count(sparse), active) == (809_856, 4_501_888, 1_340_800)
    assert (round(count(sparse) / count(dense), 2), round(active / count(dense), 2)) == (
        5.56, 1.66)


def test_the_capacity_and_the_dropped_pairs():
    """The prose: sample 0 chooses expert 5 9 times and expert 0 once; capacity 4 at F = 1 drops
    29 of 128 pairs (4 tokens lose both), F = 1.25 18, F = 2 1, dropless none."""
    probs = router_probs(moe_layer(), tokens())
    routing = route(probs, TOP_K, CAPACITY_FACTOR)
    assert (routing.counts[0, 5], routing.counts[0, 0]) == (9, 1) and routing.capacity == 4
    assert capacity(TOKENS, TOP_K, EXPERTS, CAPACITY_FACTOR) == 4 == math.ceil(16 * 2 / 8)
    dropped = {f: int((~route(probs, TOP_K, f).kept).sum()) for f in (1.0, 1.25, 2.0, 0.0)}
    assert dropped == {1.0: 29, 1.25: 18, 2.0: 1, 0.0: 0}
    lost = {f: int((~route(probs, TOP_K, f).kept.any(axis=2)).sum()) for f in (1.0, 1.25)}
    assert lost == {1.0: 4, 1.25: 1}
    kept = routing.kept[0][routing.experts[0] == 5]
    assert kept.sum() == 4  # expert 5 keeps its capacity, drops 5


@functools.cache
def _runs():
    return {coef: train_moe(coef) for coef in AUX_COEFS}


@pytest.mark.slow  # two short trainings, about 5 s
def test_the_aux_loss_balances_the_load():
    """The prose: the same first step; without the auxiliary loss the blocks send 505 and 510 of
    their 512 pairs to two experts each at step 10, at step 40 a block's 512 pairs go to 2
    experts (max/mean 4.00, 763 pairs dropped); with 0.1 the worse block's max/mean 1.59, 198
    dropped, aux 2.01; losses 3.32 and 3.29. (The same under Haswell's and Prescott's OpenBLAS
    kernels, which the slow nbval check compares.)"""
    without, with_aux = (_runs()[coef] for coef in AUX_COEFS)
    assert without[0]["loss"] == with_aux[0]["loss"]
    assert sum(without[-1]["expert_load"]) == 2 * 8 * 32 * 2 == 1024  # layers x batch x T x K
    assert [sum(sorted(block)[-2:]) for block in without[9]["expert_load_by_block"]] == [505, 510]
    last, balanced = without[-1], with_aux[-1]
    assert sorted(last["expert_load_by_block"][1])[-2:] == [256, 256]  # 512 pairs, 2 experts
    assert (round(last["expert_load_imbalance"], 2), last["dropped_tokens"]) == (4.0, 763)
    assert (round(balanced["expert_load_imbalance"], 2), balanced["dropped_tokens"]) == (1.59, 198)
    assert round(balanced["aux_loss"], 2) == 2.01 and min(balanced["expert_load"]) > 0
    assert (round(last["loss"], 2), round(balanced["loss"], 2)) == (3.32, 3.29)


def test_expert_parallelism_equals_one_process_and_its_bytes_are_the_counts():
    """The prose: equal to one process to 1e-6; rank r's dispatch is row r of the rank-to-rank
    table without the diagonal, its combine column r (640 and 512 bytes on rank 0); the counts
    (p - 1) E/p 8 = 48 bytes; the dispatch's and the combine's totals equal."""
    moe, x = moe_layer(), tokens()
    run = expert_parallel(moe, x)
    assert np.abs(run["output"] - one_process(moe, x)).max() < 1e-6
    counts, row_bytes, per = run["counts"], WIDTH * 4, EXPERTS // RANKS
    by_rank = counts.reshape(RANKS, RANKS, per).sum(axis=2)
    for rank in range(RANKS):
        assert run["dispatch_bytes"][rank] == (by_rank[rank].sum() - by_rank[rank, rank]) * 32
        assert run["combine_bytes"][rank] == (by_rank[:, rank].sum() - by_rank[rank, rank]) * 32
        assert run["counts_bytes"][rank] == (RANKS - 1) * per * 8 == 48
    assert row_bytes == 32 and (run["dispatch_bytes"][0], run["combine_bytes"][0]) == (640, 512)
    assert sum(run["dispatch_bytes"]) == sum(run["combine_bytes"])
    dropped = int((~route(router_probs(moe, x), TOP_K, 1.0).kept).sum())
    assert counts.sum() + dropped == RANKS * TOKENS * TOP_K


# ----- wrong solutions a learner would write --------------------------------------------------
def _admit(choices, capacity, order, limit=None):
    kept = np.zeros(choices.shape, bool)
    held = {}
    for t, k in order:
        expert = int(choices[t, k])
        if held.get(expert, 0) < (limit or capacity):
            kept[t, k] = True
            held[expert] = held.get(expert, 0) + 1
    return kept


def admit_token_major(choices, capacity):
    """Token by token, each token's choices together."""
    tokens, top_k = choices.shape
    return _admit(choices, capacity, [(t, k) for t in range(tokens) for k in range(top_k)])


def admit_off_by_one(choices, capacity):
    """`<=` capacity: one pair too many."""
    tokens, top_k = choices.shape
    return _admit(choices, capacity, [(t, k) for k in range(top_k) for t in range(tokens)],
                  capacity + 1)


def admit_counting_dropped_pairs(choices, capacity):
    """Every pair chosen kept: the dropped ones counted as admitted."""
    return np.ones(choices.shape, bool)


def admit_capacity_per_choice(choices, capacity):
    """A count per (expert, choice): each choice gets its own capacity."""
    tokens, top_k = choices.shape
    kept = np.zeros(choices.shape, bool)
    for k in range(top_k):
        held = {}
        for t in range(tokens):
            expert = int(choices[t, k])
            if held.get(expert, 0) < capacity:
                kept[t, k], held[expert] = True, held.get(expert, 0) + 1
    return kept


def admit_with_cumsum(choices, capacity):
    """Right: the library's vectorised form, one-hot cumulative counts in choice-major order."""
    order = choices.T.reshape(-1)
    one_hot = order[:, None] == np.arange(order.max() + 1)
    position = (np.cumsum(one_hot, axis=0) - 1)[one_hot]
    return (position < capacity).reshape(choices.shape[::-1]).T


def aux_after_dropping(probs, choices, kept):
    """f from the admitted pairs only."""
    experts = probs.shape[1]
    f = np.bincount(choices[kept], minlength=experts) / choices.size
    return float(experts * np.sum(f * probs.mean(axis=0)))


def aux_without_e(probs, choices, kept):
    experts = probs.shape[1]
    f = np.bincount(choices.ravel(), minlength=experts) / choices.size
    return float(np.sum(f * probs.mean(axis=0)))


def aux_mean_over_experts(probs, choices, kept):
    """E x mean_i (f_i P_i): a mean where the sum belongs."""
    experts = probs.shape[1]
    f = np.bincount(choices.ravel(), minlength=experts) / choices.size
    return float(experts * np.mean(f * probs.mean(axis=0)))


def aux_f_over_tokens(probs, choices, kept):
    """f over T tokens, not T K pairs: f sums to K."""
    experts = probs.shape[1]
    f = np.bincount(choices.ravel(), minlength=experts) / probs.shape[0]
    return float(experts * np.sum(f * probs.mean(axis=0)))


def aux_p_over_choosers(probs, choices, kept):
    """P_i averaged over the tokens that chose expert i only."""
    experts = probs.shape[1]
    f = np.bincount(choices.ravel(), minlength=experts) / choices.size
    p = [probs[(choices == i).any(axis=1), i].mean() if (choices == i).any() else 0.0
         for i in range(experts)]
    return float(experts * np.sum(f * np.array(p)))


def aux_with_one_hot(probs, choices, kept):
    """Right: f from a one-hot sum in float32."""
    experts = probs.shape[1]
    one_hot = (choices[..., None] == np.arange(experts)).astype(np.float32)
    f = one_hot.sum(axis=(0, 1)) / (choices.shape[0] * choices.shape[1])
    return experts * (f * probs.mean(axis=0)).sum()


def _owner(counts):
    p, experts = counts.shape
    return np.arange(experts) // (experts // p)


def bytes_counting_rows_kept_home(counts, rank, row_bytes):
    owner = _owner(counts)
    mine = owner == rank
    return (int(counts[rank].sum()) * row_bytes,
            int(counts[:, mine].sum()) * row_bytes)


def bytes_forgetting_the_combine(counts, rank, row_bytes):
    mine = _owner(counts) == rank
    return int(counts[rank, ~mine].sum()) * row_bytes, 0


def bytes_combine_as_the_dispatch(counts, rank, row_bytes):
    """The same rows back: what this rank sent, not what its experts received."""
    mine = _owner(counts) == rank
    sent = int(counts[rank, ~mine].sum()) * row_bytes
    return sent, sent


def bytes_round_robin_experts(counts, rank, row_bytes):
    """Expert e on rank e % p."""
    p, experts = counts.shape
    mine = np.arange(experts) % p == rank
    return (int(counts[rank, ~mine].sum()) * row_bytes,
            int(counts[:, mine].sum() - counts[rank, mine].sum()) * row_bytes)


def bytes_with_a_loop(counts, rank, row_bytes):
    """Right: rank by rank, expert by expert."""
    p, experts = counts.shape
    per = experts // p
    dispatch = combine = 0
    for source in range(p):
        for e in range(experts):
            if source == rank and e // per != rank:
                dispatch += counts[source, e] * row_bytes
            if source != rank and e // per == rank:
                combine += counts[source, e] * row_bytes
    return dispatch, combine


@pytest.mark.parametrize("checker, solution", [
    ("check_admit", admit_with_cumsum),
    ("check_aux_loss", aux_with_one_hot),
    ("check_dispatch_bytes", bytes_with_a_loop),
])
def test_lesson17_checkers_accept_answers_the_spec_allows(checker, solution):
    import minimp.lessons.lesson17 as lesson

    assert getattr(lesson, checker)(solution, quiet=True).passed


WRONG = {
    "check_admit": [
        Wrong(admit_token_major, "token-major"),
        Wrong(admit_off_by_one, "not <="),
        Wrong(admit_counting_dropped_pairs, "more than its capacity"),
        Wrong(admit_capacity_per_choice, "one count per expert"),
    ],
    "check_aux_loss": [
        Wrong(aux_after_dropping, "before dropping"),
        Wrong(aux_without_e, "factor E"),
        Wrong(aux_mean_over_experts, "not a mean"),
        Wrong(aux_f_over_tokens, "factor K"),
        Wrong(aux_p_over_choosers, "over all T tokens"),
    ],
    "check_dispatch_bytes": [
        Wrong(bytes_counting_rows_kept_home, "stay home"),
        Wrong(bytes_forgetting_the_combine, "combine is not free"),
        Wrong(bytes_combine_as_the_dispatch, "received"),
        Wrong(bytes_round_robin_experts, "e // (E / p)"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(17, WRONG)
