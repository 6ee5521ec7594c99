"""Every exercise checker passes its reference solution (lessons/solutions/) and fails at least one
wrong solution, so a checker that cannot fail, or a solution that does not pass, is caught; and a
checker given an unwritten stub prints and returns instead of raising."""

import importlib
import importlib.util
import math
import os

import numpy as np
import pytest

from minimp import distributed as dist
from minimp.lessons import LESSONS
from minimp.lessons.checking import Report
from minimp.parallel import Action, gpipe, one_f_one_b
from minimp.precision import BFLOAT16, E4M3, E5M2

SOLUTIONS = os.path.join(os.path.dirname(__file__), "..", "lessons", "solutions")


def solutions(number):
    """lessons/solutions/lessonNN.py, loaded from its path (it is not a package)."""
    path = os.path.join(SOLUTIONS, f"lesson{number:02d}.py")
    spec = importlib.util.spec_from_file_location(f"lesson_solutions_{number:02d}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXERCISES = [
    (int(module.removeprefix("lesson")), name, checker)  # the notebook's number, gaps and all
    for module in LESSONS
    for name, checker in importlib.import_module(f"minimp.lessons.{module}").EXERCISES
]


def ids(exercise):
    number, _, checker = exercise
    return f"{number}-{checker.__name__}"


@pytest.mark.parametrize("exercise", EXERCISES, ids=ids)
def test_the_reference_solution_passes(exercise):
    number, name, checker = exercise
    report = checker(getattr(solutions(number), name), quiet=True)
    failed = [(check, detail) for check, passed, detail in report.results if not passed]
    assert report.passed, f"{name} fails {failed}"


def stub(*args, **kwargs):
    raise NotImplementedError


class StubClass:
    """A Function or a scaler whose every method is unwritten."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError

    @staticmethod
    def apply(*args, **kwargs):
        raise NotImplementedError


@pytest.mark.parametrize("exercise", EXERCISES, ids=ids)
def test_an_unwritten_stub_is_reported_not_raised(exercise, capsys):
    _, name, checker = exercise
    report = checker(StubClass if name[0].isupper() else stub)
    assert isinstance(report, Report) and not report.passed and report.stopped
    assert "not written yet" in capsys.readouterr().out


# ----- wrong solutions: each must fail its checker --------------------------------------------
def ulp16_without_the_top_binade(x):
    return float(np.spacing(np.float16(abs(x))))  # inf at 65504


def ulp16_without_subnormals(x):
    return 2.0 ** (math.frexp(abs(x))[1] - 11) if x else 2.0**-24


def round_half_up(x):
    gap = solutions(1).ulp16(x)
    return math.floor(x / gap + 0.5) * gap


def round_without_overflow(x):
    gap = solutions(1).ulp16(x)
    return round(x / gap) * gap


def running_sum16(values):
    total = np.float16(0)
    for value in values:
        total = np.float16(total + value)
    return total


def wrong_functions():
    from minimp.function import Function

    class ExpForgettingTheFactor(Function):
        @staticmethod
        def forward(ctx, x):
            return np.exp(x)

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output

    class PowWithoutUnbroadcast(Function):
        @staticmethod
        def forward(ctx, x, p):
            ctx.save_for_backward(x, p)
            return x**p

        @staticmethod
        def backward(ctx, grad_output):
            x, p = ctx.saved_arrays
            return grad_output * p * x ** (p - 1), grad_output * x**p * np.log(x)

    class PowWithoutTheLog(solutions(2).Pow):
        @staticmethod
        def backward(ctx, grad_output):
            x, p, y = ctx.saved_arrays
            grad_x, _ = solutions(2).Pow.backward(ctx, grad_output)
            return grad_x, grad_output * y

    return ExpForgettingTheFactor, PowWithoutUnbroadcast, PowWithoutTheLog


def order_without_a_visited_set(root):
    order = []

    def visit(tensor):
        for parent in tensor.node.inputs if tensor.node else ():
            if parent.requires_grad:
                visit(parent)
        order.append(tensor)

    visit(root)
    return order


def order_root_first(root):
    return list(reversed(solutions(2).topological_order(root)))


def backward_overwriting(root):
    grads = {id(root): np.ones_like(root.data)}
    for tensor in reversed(solutions(2).topological_order(root)):
        grad = grads.pop(id(tensor), None)
        if tensor.node is None:
            tensor.grad = grad
            continue
        input_grads = tensor.node.function.backward(tensor.node.context, grad)
        input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
        for parent, parent_grad in zip(tensor.node.inputs, input_grads):
            if parent_grad is not None and parent.requires_grad:
                grads[id(parent)] = parent_grad  # a second use overwrites the first


def activation_bytes_with_the_output(batch, widths, itemsize):
    return batch * sum(widths) * itemsize


def sgd_step_on_the_copies(params, grads, masters, lr, loss_scale):
    if not all(np.isfinite(g).all() for g in grads):
        return True
    for param, grad, master in zip(params, grads, masters):
        param -= np.float16(lr) * (grad / np.float16(loss_scale))  # no master involved
        master[...] = param
    return False


def sgd_step_without_skipping(params, grads, masters, lr, loss_scale):
    for param, grad, master in zip(params, grads, masters):
        master -= np.float32(lr) * grad.astype(np.float32) / np.float32(loss_scale)
        param[...] = master.astype(np.float16)
    return False


def round_to_nearest(x, rng):
    return x.astype(np.float16)


def window_with_the_ties_inside(gradients):
    magnitudes = np.abs(gradients[gradients != 0]).astype(np.float64)
    lowest = math.ceil(math.log2(2.0**-25 / magnitudes.min()))
    highest = math.floor(math.log2(65504 / magnitudes.max()))
    return 2.0**lowest, 2.0**highest


class ScalerThatKeepsCounting(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.loss_scale *= self.backoff_factor  # the count of clean steps goes on
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.loss_scale *= self.growth_factor


class ScalerWithoutHysteresis(solutions(4).DynamicLossScaler):
    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval)


class ScalerRefillingEveryStep(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        super().update(found_inf)
        if not found_inf:
            self.tolerated = self.hysteresis


def all_gather_by_direct_sends(comm, chunk):
    out = np.empty(comm.size * chunk.size, chunk.dtype)
    for rank in range(comm.size):
        part = out[rank * chunk.size : (rank + 1) * chunk.size]
        if rank == comm.rank:
            part[...] = chunk
            for other in range(comm.size):
                if other != rank:
                    comm.send(chunk, other)
        else:
            comm.recv(part, rank)
    return out


def reduce_scatter_by_allreduce(comm, x):
    total = dist.ring_allreduce(comm, x)
    n = x.size // comm.size
    return total[comm.rank * n : (comm.rank + 1) * n]


def ring_shift_sending_first(comm, x):
    incoming = np.empty_like(x)
    comm.send(x, (comm.rank + 1) % comm.size)
    comm.recv(incoming, (comm.rank - 1) % comm.size)
    return incoming


def average_after_the_sum(comm, grad):
    return dist.ring_allreduce(comm, grad.astype(np.float16)).astype(np.float32) / comm.size


def average_on_a_float32_wire(comm, grad):
    return dist.ring_allreduce(comm, grad / np.float32(comm.size))


def mean_of_means(comm, local_mean, count):
    return dist.ring_allreduce(comm, local_mean / comm.size)


def drift_by_value(comm, weights):
    table = np.zeros(comm.size)
    table[comm.rank] = float(np.sum(weights.astype(np.float64)))
    table = comm.allreduce_scalars(table, "sum")
    return [rank for rank in range(comm.size) if table[rank] != table[0]]


def step_time_without_the_drain(P, M, t_forward, t_backward):
    return (P - 1) * t_forward + M * (t_forward + t_backward)


def gpipe_compute(P, M):
    return [[a for a in actions if a.op in ("forward", "backward")] for actions in gpipe(P, M)]


def one_f_one_b_unpaired(P, M):
    """1F1B whose steady-state exchanges are a send, then a receive: every send waits for its
    receiver, and neighbours both send at once."""
    schedule = []
    for actions in solutions(7).one_f_one_b(P, M):
        plain = []
        for a in actions:
            if a.op == "send_forward_recv_backward":
                plain += [Action("send_forward", a.micro_batch)]
                plain += [Action("recv_backward", a.received)]
            elif a.op == "send_backward_recv_forward":
                plain += [Action("send_backward", a.micro_batch)]
                plain += [Action("recv_forward", a.received)]
            else:
                plain.append(a)
        schedule.append(plain)
    return schedule


def ring_time_without_gamma(nbytes, p, alpha, beta, gamma):
    return solutions(8).ring_allreduce_time(nbytes, p, alpha, beta, 0.0)


def predict_in_absolute_error(sizes, seconds, nbytes):
    beta, alpha = np.polyfit(sizes, seconds, 1)
    return alpha + beta * nbytes


def crossover_without_gamma(p, alpha, beta, gamma):
    return solutions(8).crossover_bytes(p, alpha, beta, 0.0)


def zero3_keeping_the_weights(stage, p):
    return solutions(9).zero_bytes_per_parameter(min(stage, 2), p)


def dp_bytes_of_the_naive_algorithm(parameters, p, itemsize):
    return 2 * parameters * itemsize


def pp_bytes_both_ways_everywhere(stage, stages, batch, width, itemsize):
    return 2 * batch * width * itemsize



def softmax_in_float16(scores, scale, mask=None):
    """Every step in the scores' dtype: float16 rounds the scaled logits a second time."""
    keep = np.tri(scores.shape[-1], dtype=bool) & (True if mask is None else mask)
    logits = np.where(keep, scores * scores.dtype.type(scale), scores.dtype.type(-np.inf))
    exps = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return exps / exps.sum(axis=-1, keepdims=True)


def softmax_without_the_shift(scores, scale, mask=None):
    keep = np.tri(scores.shape[-1], dtype=bool) & (True if mask is None else mask)
    exps = np.where(keep, np.exp(scores.astype(np.float32) * np.float32(scale)), 0)
    return (exps / exps.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def softmax_with_nan_rows(scores, scale, mask=None):
    keep = np.tri(scores.shape[-1], dtype=bool) & (True if mask is None else mask)
    logits = np.where(keep, scores.astype(np.float32) * np.float32(scale), -np.inf)
    exps = np.exp(logits - logits.max(axis=-1, keepdims=True))  # a -inf row: -inf - -inf
    return (exps / exps.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def backward_without_the_scale(y, grad_output, scale):
    return solutions(10).softmax_backward(y, grad_output, 1.0)


def backward_in_float16(y, grad_output, scale):
    dot = (grad_output * y).sum(axis=-1, keepdims=True).astype(y.dtype)
    return (y.dtype.type(scale) * y * (grad_output - dot)).astype(y.dtype)


def korthikanti_bytes(s, b, h, a, itemsize, dropout):
    return (34 * s * b * h + 5 * a * s * s * b) * itemsize // 2


def block_bytes_with_masks_of_itemsize(s, b, h, a, itemsize, dropout):
    kept = solutions(10).block_bytes(s, b, h, a, itemsize, dropout)
    return kept + (itemsize - 1) * (2 * s * b * h + a * s * s * b) if dropout else kept


def block_bytes_with_statistics_of_itemsize(s, b, h, a, itemsize, dropout):
    kept = solutions(10).block_bytes(s, b, h, a, itemsize, dropout)
    return kept - 4 * max(itemsize, 4) * s * b + 4 * itemsize * s * b


def keep_mask_from_a_generator(shape, p, seed, step, layer, sample_indices):
    """One generator for the whole batch: a shard draws other numbers for the same sample."""
    return np.random.default_rng([seed, step, layer]).random(shape) >= p


def keep_mask_with_a_summed_key(shape, p, seed, step, layer, sample_indices):
    """One generator per sample, seeded by a sum: (seed 1, step 2) collides with (2, 1)."""
    rows = [np.random.default_rng(seed + step + layer + int(n)).random(shape[1:]) >= p
            for n in sample_indices]
    return np.array(rows).reshape(shape)

def round_with_ml_dtypes(x, fmt):
    """ml_dtypes' own cast: NaN (E4M3) or inf (E5M2) past the largest number."""
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(fmt.dtype).astype(np.float32)


def round_fp8_half_up(x, fmt):
    magnitude = np.minimum(np.abs(x.astype(np.float64)), fmt.max)
    _, exponent = np.frexp(np.maximum(magnitude, fmt.smallest_normal))
    gap = np.ldexp(1.0, exponent - 1 - fmt.mantissa_bits)
    return np.copysign(np.floor(magnitude / gap + 0.5) * gap, x).astype(np.float32)


def round_flushing_subnormals(x, fmt):
    rounded = solutions(14).round_to_fp8(x, fmt)
    return np.where(np.abs(rounded) < fmt.smallest_normal, np.float32(0), rounded)


def round_losing_the_sign_of_zero(x, fmt):
    rounded = solutions(14).round_to_fp8(x, fmt)
    return np.where(rounded == 0, np.float32(0), rounded)


def update_from_this_step_only(amax_history, amax, scale, fp8_max, margin):
    """The history kept, but the scale from this step's amax alone: current scaling, a step late."""
    history, _ = solutions(14).delayed_scaling_update(amax_history, amax, scale, fp8_max, margin)
    one_step = np.zeros(1, np.float32)
    _, new_scale = solutions(14).delayed_scaling_update(one_step, amax, scale, fp8_max, margin)
    return history, new_scale


def update_dividing_by_anything(amax_history, amax, scale, fp8_max, margin):
    history = np.roll(amax_history, 1)
    history[0] = amax
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return history, np.float32(fp8_max * 2.0**-margin / history.max())


def update_without_the_margin(amax_history, amax, scale, fp8_max, margin):
    return solutions(14).delayed_scaling_update(amax_history, amax, scale, fp8_max, 0)


def linear_without_scales(x, weight, bias):
    round_to_fp8 = solutions(14).round_to_fp8
    x_q = round_to_fp8(x.astype(np.float32), E4M3)
    w_q = round_to_fp8(weight.astype(np.float32), E4M3)
    return (x_q @ w_q.T + bias.astype(np.float32)).astype(BFLOAT16)


def linear_rounding_twice(x, weight, bias):
    product = solutions(14).fp8_linear(x, weight, np.zeros_like(bias))  # rounded to bf16 here
    return (product.astype(np.float32) + bias.astype(np.float32)).astype(BFLOAT16)


def linear_in_e5m2(x, weight, bias):
    def quantized(array):
        amax = np.float32(np.abs(array.astype(np.float32)).max())
        scale = np.float32(E5M2.max) / amax if amax > 0 else np.float32(1)
        return solutions(14).round_to_fp8(array.astype(np.float32) * scale, E5M2), scale

    (x_q, x_scale), (w_q, w_scale) = quantized(x), quantized(weight)
    inverses = (np.float32(1) / x_scale) * (np.float32(1) / w_scale)
    return ((x_q @ w_q.T) * inverses + bias.astype(np.float32)).astype(BFLOAT16)


def held_with_fp16_gradients(stage, unit_sizes, rank, world_size):
    """The paper's count: 2-byte gradients where minimp keeps float32 accumulators."""
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    return {**held, "accumulators": held["accumulators"] // 2}


def held_with_even_chunks(stage, unit_sizes, rank, world_size):
    """P // N elements on every rank, where the ring's cut gives some ranks one more."""
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    exact = sum(solutions(11).chunk(size, rank, world_size) for size in unit_sizes)
    even = sum(unit_sizes) // world_size
    first_sharded = {"masters": 1, "optimizer_state": 1, "accumulators": 2, "parameters": 3}
    per_element = {"masters": 4, "optimizer_state": 8, "accumulators": 4, "parameters": 2}
    for kind, first in first_sharded.items():
        if stage >= first:
            held[kind] += per_element[kind] * (even - exact)
    return held


def held_with_a_gather_buffer_in_stage_3(stage, unit_sizes, rank, world_size):
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    if stage == 3 and world_size > 1:
        held["buffers"] += 2 * max(unit_sizes)
    return held


def held_with_buffers_on_one_rank(stage, unit_sizes, rank, world_size):
    """Wire buffers where there is no wire."""
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    if world_size == 1:
        held["buffers"] = 2 * 4 * (sum(unit_sizes) if stage == 0 else max(unit_sizes))
    return held


def zero1_by_all_reduce(comm, weights, master, grad, lr):
    """The right bits, but the whole mean arrives everywhere before the update."""
    mean = dist.ring_allreduce(comm, grad * np.float32(1 / comm.size))
    start, stop = dist.chunk_bounds(weights.size, comm.size)[comm.rank]
    master -= lr * mean[start:stop]
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_dividing_after(comm, weights, master, grad, lr):
    mean = dist.reduce_scatter(comm, grad) / np.float32(comm.size)
    master -= lr * mean
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_not_in_place(comm, weights, master, grad, lr):
    mean = dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))
    master = master - lr * mean  # a new array: the caller's master never moves
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_gathering_float32(comm, weights, master, grad, lr):
    master -= lr * dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))
    return dist.all_gather(comm, master, weights.size).astype(weights.dtype)


def sent_on_average(stage, unit_sizes, rank, world_size, micro_batches):
    """The formula averaged over the ranks: not any rank's own bytes where chunks are uneven."""
    per_element = [8, 6, 4 * micro_batches + 2, 8 * micro_batches][stage]
    return per_element * (world_size - 1) / world_size * sum(unit_sizes)


def sent_gathering_all_but_its_own(stage, unit_sizes, rank, world_size, micro_batches):
    """An all-gather that sends every chunk but the rank's own (the ring sends its own first)."""
    if world_size == 1:
        return 0
    sizes = [sum(unit_sizes)] if stage == 0 else unit_sizes
    own = sum(size - solutions(11).chunk(size, rank, world_size) for size in sizes)
    factor = [(4, 4), (4, 2), (4 * micro_batches, 2), (4 * micro_batches, 4 * micro_batches)]
    return factor[stage][0] * own + factor[stage][1] * own


def sent_reducing_stage_2_once(stage, unit_sizes, rank, world_size, micro_batches):
    return solutions(11).bytes_sent(stage, unit_sizes, rank, world_size,
                                    1 if stage == 2 else micro_batches)


def sent_gathering_stage_3_once(stage, unit_sizes, rank, world_size, micro_batches):
    """Stage 3 without the gather before backward."""
    if stage < 3:
        return solutions(11).bytes_sent(stage, unit_sizes, rank, world_size, micro_batches)
    once = solutions(11).bytes_sent(1, unit_sizes, rank, world_size, 1)
    return micro_batches * once


def interleaved_gpipe_like(P, M, V):
    """Every forward of every chunk, then every backward: the bubble is right, the memory not."""
    forwards = [Action("forward", m, chunk=c) for c in range(V) for m in range(M)]
    backwards = [Action("backward", m, chunk=c) for c in reversed(range(V)) for m in range(M)]
    return [forwards + backwards for _ in range(P)]


def interleaved_backward_in_forward_order(P, M, V):
    """The chunks not reversed backward: chunk 0's backward waits for a gradient never sent."""
    return [[action._replace(chunk=V - 1 - action.chunk) if action.op == "backward" else action
             for action in actions] for actions in solutions(13).interleaved_compute(P, M, V)]


def interleaved_on_chunk_0(P, M, V):
    """1F1B's order with the chunks left out."""
    computes = ("forward", "backward")
    return [[a for a in actions if a.op in computes] for actions in one_f_one_b(P, M)]


def zb_bubble_with_equal_costs(P, M, t_forward, t_input, t_weight):
    return (P - 1) / (3 * M + P - 1)


def zb_bubble_of_1f1b(P, M, t_forward, t_input, t_weight):
    return (P - 1) / (M + P - 1)


def zb_bubble_of_the_ideal_time(P, M, t_forward, t_input, t_weight):
    """The idle time over the compute time, not over the step."""
    return (P - 1) * (t_forward + t_input - t_weight) / (M * (t_forward + t_input + t_weight))


def exposed_without_overlap(op_seconds, bucket_ops, ring_seconds):
    """Every ring after backward."""
    return sum(ring_seconds)


def exposed_without_queueing(op_seconds, bucket_ops, ring_seconds):
    """Each ring starts when its bucket is ready, even while the one before it still runs."""
    ready = np.cumsum(op_seconds)[np.cumsum(bucket_ops) - 1]
    return max(0.0, float(max(ready + np.array(ring_seconds))) - float(sum(op_seconds)))


def exposed_last_ring_only(op_seconds, bucket_ops, ring_seconds):
    """Only the last bucket's ring, as if every other one were hidden."""
    return ring_seconds[-1]


def plan_in_model_order(sizes, bucket_bytes, itemsize):
    """First parameter first: the first bucket would be complete only at backward's end."""
    reverse = solutions(13).plan_buckets(sizes[::-1], bucket_bytes, itemsize)
    return [[len(sizes) - 1 - i for i in bucket] for bucket in reverse]


def plan_closing_when_exactly_full(sizes, bucket_bytes, itemsize):
    """A bucket that would be exactly full is closed too early."""
    return solutions(13).plan_buckets(sizes, bucket_bytes - 1e-9, itemsize)


def plan_with_an_empty_bucket(sizes, bucket_bytes, itemsize):
    """A parameter larger than a bucket leaves an empty bucket before it."""
    buckets, current, elements = [], [], 0
    for index in reversed(range(len(sizes))):
        if (elements + sizes[index]) * itemsize > bucket_bytes:
            buckets.append(current)
            current, elements = [], 0
        current.append(index)
        elements += sizes[index]
    return buckets + [current]


def row_parallel_functions():
    """Row-parallel Linears, each wrong in one way."""
    from minimp.function import Function
    from minimp.parallel.tensor.mappings import all_reduce

    class RowParallelWithoutTheSum(Function):
        """Each rank keeps its partial output: g forgotten."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.save_for_backward(x, weight)
            return x @ weight.T

        backward = solutions(12).RowParallel.backward

    class RowParallelSummingBackward(Function):
        """An all-reduce in backward too: dL/dx_r belongs to this rank alone."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.comm = comm
            return solutions(12).RowParallel.forward(ctx, x, weight, comm)

        @staticmethod
        def backward(ctx, grad_output):
            grad_x, grad_weight = solutions(12).RowParallel.backward(ctx, grad_output)
            return all_reduce(ctx.comm, grad_x), grad_weight

    class RowParallelWithTheWeightGradientOfOneRow(Function):
        """dL/dW_r from the last sample only: the leading axes not summed."""

        forward = solutions(12).RowParallel.forward

        @staticmethod
        def backward(ctx, grad_output):
            x, weight = ctx.saved_arrays
            return grad_output @ weight, grad_output[-1, -1][:, None] * x[-1, -1][None, :]

    class RowParallelGatheringTheInput(Function):
        """The right numbers by gathering: every rank's x_r and W_r travel instead of y."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.save_for_backward(x, weight)
            whole = all_reduce(comm, np.zeros((comm.size, *x.shape)))  # bytes of a gather
            return all_reduce(comm, x @ weight.T) + 0 * whole.sum()

        backward = solutions(12).RowParallel.backward

    return [RowParallelWithoutTheSum, RowParallelSummingBackward,
            RowParallelWithTheWeightGradientOfOneRow, RowParallelGatheringTheInput]


def tp_bytes_all_reduce_as_twice_the_array(blocks, rows, context, width, tp, micro_batches,
                                           compute_bytes, sequence_parallel):
    """An all-reduce counted as 2 n, not 2 (t - 1)/t n."""
    if tp == 1:
        return 0
    fraction = solutions(12).tp_bytes_sent(blocks, rows, context, width, 2, micro_batches,
                                           compute_bytes, sequence_parallel)
    return 2 * fraction


def tp_bytes_forward_only(blocks, rows, context, width, tp, micro_batches, compute_bytes,
                          sequence_parallel):
    return solutions(12).tp_bytes_sent(blocks, rows, context, width, tp, micro_batches,
                                       compute_bytes, sequence_parallel) / 2


def tp_bytes_sequence_parallel_as_plain(blocks, rows, context, width, tp, micro_batches,
                                        compute_bytes, sequence_parallel):
    """Sequence parallelism's blocks only: the head's gather and the partial gradients left out."""
    return solutions(12).tp_bytes_sent(blocks, rows, context, width, tp, micro_batches,
                                       compute_bytes, False)


WRONG = {
    (1, "ulp16"): [ulp16_without_the_top_binade, ulp16_without_subnormals],
    (1, "round_to_float16"): [round_half_up, round_without_overflow],
    (1, "compensated_sum16"): [running_sum16],
    (2, "Exp"): [lambda: wrong_functions()[0]],
    (2, "Pow"): [lambda: wrong_functions()[1], lambda: wrong_functions()[2]],
    (2, "topological_order"): [order_without_a_visited_set, order_root_first],
    (2, "backward"): [backward_overwriting],
    (3, "activation_bytes"): [activation_bytes_with_the_output],
    (3, "sgd_step"): [sgd_step_on_the_copies, sgd_step_without_skipping],
    (3, "stochastic_round"): [round_to_nearest],
    (4, "scale_window"): [window_with_the_ties_inside],
    (4, "check_dynamic_scaler"): [ScalerThatKeepsCounting],
    (4, "check_hysteresis"): [ScalerRefillingEveryStep, ScalerWithoutHysteresis],
    (5, "all_gather"): [all_gather_by_direct_sends],
    (5, "reduce_scatter"): [reduce_scatter_by_allreduce],
    (5, "ring_shift"): [ring_shift_sending_first],
    (6, "average_gradients"): [average_after_the_sum, average_on_a_float32_wire],
    (6, "global_mean_gradient"): [mean_of_means],
    (6, "drifted_replicas"): [drift_by_value],
    (7, "step_time"): [step_time_without_the_drain],
    (7, "one_f_one_b_compute"): [gpipe_compute],
    (7, "one_f_one_b"): [one_f_one_b_unpaired, lambda: gpipe],
    (8, "ring_allreduce_time"): [ring_time_without_gamma],
    (8, "predict_time"): [predict_in_absolute_error],
    (8, "crossover_bytes"): [crossover_without_gamma],
    (9, "zero_bytes_per_parameter"): [zero3_keeping_the_weights],
    (9, "dp_bytes_sent"): [dp_bytes_of_the_naive_algorithm],
    (9, "pp_bytes_sent"): [pp_bytes_both_ways_everywhere],
    (10, "scaled_masked_softmax"): [softmax_in_float16, softmax_without_the_shift,
                                    softmax_with_nan_rows],
    (10, "softmax_backward"): [backward_without_the_scale, backward_in_float16],
    (10, "block_bytes"): [korthikanti_bytes, block_bytes_with_masks_of_itemsize,
                          block_bytes_with_statistics_of_itemsize],
    (10, "keep_mask"): [keep_mask_from_a_generator, keep_mask_with_a_summed_key],
    (11, "bytes_held"): [held_with_fp16_gradients, held_with_even_chunks,
                         held_with_a_gather_buffer_in_stage_3, held_with_buffers_on_one_rank],
    (11, "zero1_step"): [zero1_by_all_reduce, zero1_dividing_after, zero1_not_in_place,
                         zero1_gathering_float32],
    (11, "bytes_sent"): [sent_on_average, sent_gathering_all_but_its_own,
                         sent_reducing_stage_2_once, sent_gathering_stage_3_once],
    (12, "RowParallel"): [lambda: row_parallel_functions()[0],
                          lambda: row_parallel_functions()[1],
                          lambda: row_parallel_functions()[2],
                          lambda: row_parallel_functions()[3]],
    (12, "tp_bytes_sent"): [tp_bytes_all_reduce_as_twice_the_array, tp_bytes_forward_only,
                            tp_bytes_sequence_parallel_as_plain],
    (13, "interleaved_compute"): [interleaved_gpipe_like, interleaved_backward_in_forward_order,
                                  interleaved_on_chunk_0],
    (13, "zb_h1_bubble"): [zb_bubble_with_equal_costs, zb_bubble_of_1f1b,
                           zb_bubble_of_the_ideal_time],
    (13, "exposed_seconds"): [exposed_without_overlap, exposed_without_queueing,
                              exposed_last_ring_only],
    (13, "plan_buckets"): [plan_in_model_order, plan_closing_when_exactly_full,
                           plan_with_an_empty_bucket],
    (14, "round_to_fp8"): [round_with_ml_dtypes, round_fp8_half_up, round_flushing_subnormals,
                           round_losing_the_sign_of_zero],
    (14, "delayed_scaling_update"): [update_from_this_step_only, update_dividing_by_anything,
                                     update_without_the_margin],
    (14, "fp8_linear"): [linear_without_scales, linear_rounding_twice, linear_in_e5m2],
}
FACTORIES = {id(f) for fs in WRONG.values() for f in fs if getattr(f, "__name__", "") == "<lambda>"}


def key(exercise):
    """Lesson 4 checks one class twice; its two checkers are told apart by name."""
    number, name, checker = exercise
    return (number, checker.__name__) if name == "DynamicLossScaler" else (number, name)


def test_every_checker_has_a_wrong_solution():
    assert sorted(key(e) for e in EXERCISES) == sorted(WRONG)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # wrong solutions overflow on purpose
@pytest.mark.parametrize("exercise", EXERCISES, ids=ids)
def test_every_wrong_solution_fails(exercise):
    for wrong in WRONG[key(exercise)]:
        solution = wrong() if id(wrong) in FACTORIES else wrong
        report = exercise[2](solution, quiet=True)
        assert not report.passed, f"{exercise[2].__name__} passes the wrong {wrong}"
        assert not report.stopped  # it failed on its merits, not as an unwritten stub
