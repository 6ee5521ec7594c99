"""Reference solutions to lesson 17's exercises (mixture of experts). Try them first."""

import numpy as np


def admit(choices, capacity):
    """GShard's order: choice k of every token, in token order, before choice k + 1; an expert
    admits a pair while it holds fewer than capacity (a dropped pair takes no place)."""
    tokens, top_k = choices.shape
    kept = np.zeros((tokens, top_k), bool)
    held = {}
    for k in range(top_k):
        for t in range(tokens):
            expert = int(choices[t, k])
            if held.get(expert, 0) < capacity:
                kept[t, k] = True
                held[expert] = held.get(expert, 0) + 1
    return kept


def aux_loss(probs, choices, kept):
    """E sum_i f_i P_i: f_i the pairs chosen for expert i before dropping over T K (kept is not
    needed), P_i expert i's mean probability over the T tokens."""
    tokens, experts = probs.shape
    f = np.bincount(choices.ravel(), minlength=experts) / choices.size
    return float(experts * np.sum(f * probs.mean(axis=0)))


def dispatch_bytes(counts, rank, row_bytes):
    """Dispatch: this rank's rows for other ranks' experts; combine: the rows other ranks sent
    this rank's experts, returned."""
    p, experts = counts.shape
    owner = np.arange(experts) // (experts // p)
    mine = owner == rank
    dispatch = counts[rank, ~mine].sum()
    combine = counts[:, mine].sum() - counts[rank, mine].sum()
    return int(dispatch) * row_bytes, int(combine) * row_bytes
