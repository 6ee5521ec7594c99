"""Reference solutions to lesson 12's exercises (cutting every layer). Try them yourself first."""


from minimp.function import Function
from minimp.parallel.tensor.mappings import all_reduce


class RowParallel(Function):
    """y = sum over the ranks of x_r W_r^T (g: all-reduce);
    dL/dx_r = dL/dy W_r;  dL/dW_r = dL/dy^T x_r (summed over the leading axes)."""

    @staticmethod
    def forward(ctx, x, weight, comm):
        ctx.save_for_backward(x, weight)
        return all_reduce(comm, x @ weight.T)  # (..., out): the partial sums added up

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_arrays
        out, features = weight.shape
        grad_x = grad_output @ weight  # (..., in/t): this rank's slice, nothing to send
        grad_weight = grad_output.reshape(-1, out).T @ x.reshape(-1, features)  # (out, in/t)
        return grad_x, grad_weight


def tp_bytes_sent(blocks, micro_batch_size, context, width, tp, micro_batches, compute_bytes,
                  sequence_parallel):
    """Per block and micro-batch, 4 all-reduces of b s h d bytes (2 forward, 2 backward), each
    2 (t - 1)/t of them; sequence parallelism: the same as halves, plus the head's gather and the
    embeddings' backward gather per micro-batch, plus the partial float32 gradients (6 h per
    block) once a step."""
    fraction = (tp - 1) / tp
    activation = micro_batch_size * context * width * compute_bytes  # b s h d
    halves = micro_batches * blocks * 8 * activation  # 2 halves an all-reduce
    if sequence_parallel:
        halves += micro_batches * 2 * activation  # the head's gather, the embeddings' gather
        halves += blocks * 6 * width * 4 * 2  # one all-reduce of the partial gradients, float32
    return round(halves * fraction)
