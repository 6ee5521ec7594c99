"""Reference solutions to lesson 16's exercises (splitting the sequence). Try them first."""

import math

import numpy as np


def merge(a, b):
    """Both blocks' exponentials moved onto the larger maximum m: e^(s - m_a) e^(m_a - m) =
    e^(s - m), so their sums and their products with v simply add."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = np.maximum(m_a, m_b)  # finite when either block holds a visible key
    scale_a, scale_b = np.exp(m_a - m), np.exp(m_b - m)  # <= 1; e^(-inf) = 0 for a masked block
    return m, l_a * scale_a + l_b * scale_b, acc_a * scale_a + acc_b * scale_b


def zigzag_positions(rank, N, T):
    """Chunks rank and 2N - 1 - rank of the 2N chunks of T / (2N) positions, the early one first."""
    size = T // (2 * N)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in (rank, 2 * N - 1 - rank)])


def ring_bytes_by_hand(shape, dtype, N):
    """k and v (2n values) N - 1 hops in the activation dtype, forward and again backward; dK and
    dV N hops in the accumulate dtype (float32, float64 for float64 inputs)."""
    if N == 1:
        return 0, 0
    block = 2 * math.prod(shape)
    wide = 8 if np.dtype(dtype) == np.float64 else 4
    forward = (N - 1) * block * np.dtype(dtype).itemsize
    return forward, forward + N * block * wide
