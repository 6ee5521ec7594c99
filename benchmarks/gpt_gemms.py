"""The matrix products (GEMMs) of one GPT training step, as shapes: what "its GEMMs alone" times.

Plain Python (no NumPy, no minimp), so that the PyTorch side (torch_gpt_step.py, run by a Python
that may not have minimp) and the minimp side (gpu_gpt_step.py) time the same list. Each entry is

    (name, count, m, n, k, a_transposed, b_transposed)

one product (m x k) @ (k x n), `count` of them batched; a_transposed: the first operand is read
as the transpose of a (k, m) array (b_transposed likewise of an (n, k) array), as the step reads
W^T, dL/dy^T and k^T. Forward and backward, as minimp's Linear and MatMul compute them
(minimp/ops/linalg.py): y = x W^T, dL/dx = dL/dy W, dL/dW = dL/dy^T x for each Linear (every one
needs dL/dx here: the first reads ln_1's output); for each batched product y = a @ b,
dL/da = dL/dy b^T and dL/db = a^T dL/dy; the tied head is the product rows @ wte^T.
"""


def linear_gemms(name, rows, in_features, out_features):
    """Forward, dL/dx and dL/dW of a Linear (out, in) on `rows` rows of input."""
    return [
        (f"{name} forward", 1, rows, out_features, in_features, False, True),  # x @ W^T
        (f"{name} grad_x", 1, rows, in_features, out_features, False, False),  # dL/dy @ W
        (f"{name} grad_weight", 1, out_features, in_features, rows, True, False),  # dL/dy^T @ x
    ]


def batched_gemms(name, count, m, n, k, b_transposed=False):
    """y = a @ b, (m, k) @ (k, n), `count` of them, and its two gradients."""
    return [
        (f"{name} forward", count, m, n, k, False, b_transposed),
        (f"{name} grad_a", count, m, k, n, False, not b_transposed),  # dL/dy @ b^T
        (f"{name} grad_b", count, k, n, m, True, False),  # a^T @ dL/dy
    ]


def gpt_gemms(layers, heads, width, context, vocab, batch):
    """Every GEMM of one training step of minimp's GPT (minimp/models/gpt.py) on (batch, context)
    token ids: 3 per Linear, 6 per attention (scores and weighted sum), 3 for the tied head."""
    rows, head_width = batch * context, width // heads
    gemms = []
    for index in range(layers):
        block = f"block {index}"
        gemms += linear_gemms(f"{block} attn.c_attn", rows, width, 3 * width)
        # scores = q @ k^T: (B*H) products (T, D) @ (D, T); the full square, masked afterwards
        gemms += batched_gemms(f"{block} q @ k^T", batch * heads, context, context, head_width,
                               b_transposed=True)
        gemms += batched_gemms(f"{block} attention @ v", batch * heads, context, head_width,
                               context)  # (T, T) @ (T, D)
        gemms += linear_gemms(f"{block} attn.c_proj", rows, width, width)
        gemms += linear_gemms(f"{block} mlp.c_fc", rows, width, 4 * width)
        gemms += linear_gemms(f"{block} mlp.c_proj", rows, 4 * width, width)
    gemms += batched_gemms("head rows @ wte^T", 1, rows, vocab, width, b_transposed=True)
    return gemms


def gemm_flops(gemms):
    """Floating-point operations of the list: 2 m n k per product (a multiply and an add)."""
    return sum(2 * count * m * n * k for _, count, m, n, k, _, _ in gemms)
