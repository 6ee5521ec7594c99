"""The random Hadamard transform NVFP4 applies to both inputs of the weight-gradient GEMM, along K.

Sylvester's Hadamard matrices, H_1 = [1] and H_2n = [[H_n, H_n], [H_n, -H_n]], have entries +-1
and orthogonal rows: H H^T = n I. With random signs s (a diagonal S = diag(s)), the 16 x 16

    R = H_16 S / 4        is orthonormal: R R^T = H S S H^T / 16 = I,

and in float32 exactly so (entries +-1/4, sums of 16 products +-1/16).

The weight gradient of y = x W^T (a Linear's) is dW = dY^T X: a GEMM whose K is the tokens T
(dY (T, C_out), X (T, C_in)). Multiplying every block of 16 consecutive tokens of both operands by
the same R leaves it unchanged in real arithmetic: (R dY)^T (R X) = dY^T R^T R X = dY^T X, block
by block. What changes is what gets quantized: each new value is a +-1/4-weighted sum of 16
tokens, so an outlier token is spread over its block (a lone spike v becomes 16 values of
magnitude v/4), and a 16-element FP4 scale no longer has to cover one huge value among small ones.
NVIDIA's NVFP4 recipe applies a 16 x 16 random Hadamard transform to the inputs of the
weight-gradient GEMM only, none in the forward or input-gradient GEMMs (Transformer Engine's
NVFP4 recipe; "Pretraining Large Language Models with NVFP4", NVIDIA, 2025).
"""

import numpy as np

HADAMARD_SIZE = 16  # NVFP4's block: the 16 tokens each transform mixes


def hadamard_matrix(size: int = HADAMARD_SIZE) -> np.ndarray:
    """Sylvester's size x size Hadamard matrix (size a power of two), float32 entries +-1."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Sylvester's construction doubles from 1: size must be a power of two, "
                         f"got {size}")
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return h


def random_hadamard_matrix(generator: np.random.Generator,
                           size: int = HADAMARD_SIZE) -> np.ndarray:
    """R = H diag(s) / sqrt(size) in float32, the signs s drawn from the generator passed in."""
    signs = generator.choice(np.array([-1.0, 1.0], dtype=np.float32), size=size)
    return hadamard_matrix(size) * signs[None, :] / np.float32(np.sqrt(size))


def hadamard_transform(x: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Each block of len(matrix) consecutive rows (tokens) of x (T, C) multiplied by the matrix:
    block-diagonal(R) @ x, in x's dtype (float32 sums for float32 x)."""
    size = matrix.shape[0]
    if x.ndim != 2 or x.shape[0] % size:
        raise ValueError(f"the Hadamard transform mixes tokens in blocks of {size}: x must be "
                         f"(T, C) with T a multiple of {size}, got shape {x.shape}")
    blocks = x.reshape(x.shape[0] // size, size, x.shape[1])  # (T/16, 16, C)
    return np.matmul(matrix.astype(x.dtype), blocks).reshape(x.shape)
