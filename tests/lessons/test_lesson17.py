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
    """The prose: a width-128 GPT of 4 blocks, dense against 8 experts with top-2."""
    def count(model):
        return sum(p.size for p in model.parameters())

    rng = np.random.default_rng(0)
    dense, sparse = GPT(GPTConfig(), rng), GPT(GPTConfig(experts=8, top_k=2), rng)
    expert = 2 * 128 * 512 + 512 + 128  # c_fc and c_proj with biases
    assert count(sparse) - count(dense) == 4 * (7 * expert + 8 * 128)  # 7 more experts, router
    active = count(sparse) - 4 * 6 * expert  # 6 of 8 experts idle for each token
    assert active - count(dense) == 4 * (expert + 8 * 128)


def test_the_capacity_and_the_dropped_pairs():
    probs = router_probs(moe_layer(), tokens())
    assert capacity(TOKENS, TOP_K, EXPERTS, CAPACITY_FACTOR) == 4
    dropped = {f: int((~route(probs, TOP_K, f).kept).sum()) for f in (1.0, 1.25, 2.0, 0.0)}
    assert dropped[0.0] == 0 and dropped[2.0] <= dropped[1.25] <= dropped[1.0]
    assert dropped[1.0] > 0


@functools.cache
def _runs():
    return {coef: train_moe(coef) for coef in AUX_COEFS}


@pytest.mark.slow
def test_the_aux_loss_balances_the_load():
    """Without it the router collapses onto a few experts (max/mean near 4: 2 of 8 take most);
    with 0.1 the last step's imbalance stays below 2 and fewer pairs are dropped."""
    without, with_aux = (_runs()[coef][-1] for coef in AUX_COEFS)
    assert without["expert_load_imbalance"] > 3.0 and with_aux["expert_load_imbalance"] < 2.0
    assert with_aux["dropped_tokens"] < without["dropped_tokens"]
    assert sum(without["expert_load"]) == 2 * 8 * 32 * 2  # layers x batch x context x top-2
    assert with_aux["aux_loss"] < without["aux_loss"] and with_aux["aux_loss"] >= 2 * 0.99


def test_expert_parallelism_equals_one_process_and_its_bytes_are_the_counts():
    moe, x = moe_layer(), tokens()
    run = expert_parallel(moe, x)
    assert np.abs(run["output"] - one_process(moe, x)).max() < 1e-6
    counts, row_bytes, per = run["counts"], WIDTH * 4, EXPERTS // RANKS
    owner = np.arange(EXPERTS) // per
    for rank in range(RANKS):
        mine = owner == rank
        assert run["dispatch_bytes"][rank] == counts[rank, ~mine].sum() * row_bytes
        assert run["combine_bytes"][rank] == (counts[:, mine].sum()
                                              - counts[rank, mine].sum()) * row_bytes
        assert run["counts_bytes"][rank] == (RANKS - 1) * per * 8
    assert counts.sum() + int((~route(router_probs(moe, x), TOP_K, 1.0).kept).sum()) == (
        RANKS * TOKENS * TOP_K)
    assert math.isclose(sum(run["dispatch_bytes"]), sum(run["combine_bytes"]))


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
