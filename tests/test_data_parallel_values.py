"""DataParallel's gradient averaging value by value on the simulated world, against means written
out in NumPy, and its squared gradient norm; and pack's one rounding onto a float16 wire, bit for
bit against NumPy's astype."""

import numpy as np
import pytest

from minimp import distributed as dist
from minimp import nn, optim
from minimp.parallel.data.data_parallel import DataParallel, pack
from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.precision import halfcast, halfcast_numba

needs_numba = pytest.mark.skipif(not halfcast_numba.available(), reason="numba is not installed")
CASTS = ["numpy", "astype", pytest.param("numba", marks=needs_numba)]


@pytest.mark.parametrize("average", ["before", "after"])
def test_a_parameter_no_loss_reached_on_one_replica_takes_part_with_zeros(average):
    """Rank 0's loss did not reach the (2, 3) weight, rank 1's did: the mean is half of rank 1's
    gradient, on both ranks, and rank 0's missing gradient becomes a float32 array of that mean."""
    reached = np.arange(6, dtype=np.float32).reshape(2, 3)

    def body(comm):
        weight, bias = np.zeros((2, 3), np.float32), np.zeros(4, np.float32)
        parameters = [nn.Parameter(weight), nn.Parameter(bias)]
        replicas = DataParallel(comm, optim.SGD(parameters, lr=0.1), average=average)
        grads = [None if comm.rank == 0 else reached.copy(), np.full(4, comm.rank, np.float32)]
        replicas.reduce(grads)
        return grads

    for grads in dist.simulate(2, body):
        assert grads[0].dtype == np.float32 and grads[0].shape == (2, 3)
        np.testing.assert_array_equal(grads[0], (np.zeros((2, 3)) + reached) / 2)
        np.testing.assert_array_equal(grads[1], np.full(4, 0.5))


def signalling_nans_and_edges():
    """2048 float32 gradients (past halfcast.SMALL_ARRAY, so the selected cast's bit tricks run):
    a ramp to +-3e5, past float16's 65504, then NaNs whose top fraction bit is clear (signalling;
    0x7F800001's top 10 fraction bits are zero), a quiet NaN, float16 subnormals and a tie."""
    gradient = np.linspace(-3e5, 3e5, 2048, dtype=np.float32)
    nans = np.array([0x7F800001, 0xFF800001, 0x7FA00000, 0x7FC00000], np.uint32)
    gradient[:4] = nans.view(np.float32)
    gradient[4:8] = [1e-6, -3e-7, 6e-8, 65520]  # 65520: halfway to 65536, rounds to infinity
    return gradient


def float16_bits(array):
    with np.errstate(all="ignore"):  # NumPy's own cast: the reference, flags and all
        return array.astype(np.float16).view(np.uint16)


@pytest.mark.parametrize("implementation", CASTS)
def test_pack_rounds_a_float32_gradient_once_into_a_float16_wire_signalling_nans_kept(
    implementation,
):
    """average "after": the gradient goes straight into the wire, rounded once from float32 as
    NumPy's float32 -> float16 astype rounds it, bit for bit: a signalling NaN stays signalling
    (halfcast.py's docstring). Through float64 first, the CPU's float32 -> float64 conversion would
    quieten it (0x7FA00000 would land as 0x7F00, not 0x7D00)."""
    gradient, wire = signalling_nans_and_edges(), np.empty(2048, np.float16)
    # the "astype" choice is NumPy's cast, which flags overflow
    with halfcast.casts(implementation), np.errstate(over="ignore"):
        pack(wire, gradient, 0.5, "after")
    np.testing.assert_array_equal(wire.view(np.uint16), float16_bits(gradient))
    assert wire.view(np.uint16)[2] == 0x7D00  # sign 0, exponent 31, fraction 0x100: signalling


@pytest.mark.parametrize("average", ["before", "after"])
@pytest.mark.parametrize("implementation", ["numpy", pytest.param("numba", marks=needs_numba)])
def test_pack_into_a_float16_wire_raises_no_floating_point_flag(implementation, average):
    """minimp's float32 -> float16 cast sets no floating-point flag where NumPy's astype would
    warn "overflow encountered in cast" (halfcast.py): under np.errstate(all="raise"), packing
    values past 65504 gives infinities, and the bits of NumPy's own rounding, without raising."""
    gradient = signalling_nans_and_edges()[4:]  # NaNs left out: a product quietens them anyway
    gradient = np.concatenate([gradient, gradient[:4]])  # 2048 again
    wire = np.empty(2048, np.float16)
    with halfcast.casts(implementation), np.errstate(all="raise"):
        pack(wire, gradient, 0.5, average)
    scaled = gradient * np.float32(0.5) if average == "before" else gradient
    np.testing.assert_array_equal(wire.view(np.uint16), float16_bits(scaled))
    assert np.isinf(wire).sum() > 0 and np.isfinite(wire).sum() > 0


def test_without_other_stages_the_squared_norm_is_this_replica_s_own():
    """No stages_comm (the default: one stage, no tensor shards): the squared norm is the sum of
    squares of this rank's gradients (a parameter without one counts nothing), and the other
    replica's, which hold the same averaged gradients, are not added again."""
    gradients = [np.array([3.0, -4.0], np.float32), None, np.arange(6, dtype=np.float32)]
    expected = sum(float(np.sum(np.float64(g) ** 2)) for g in gradients if g is not None)

    def body(comm):
        parameters = [nn.Parameter(np.zeros(n, np.float32)) for n in (2, 3, 6)]
        replicas = DataParallel(comm, optim.SGD(parameters, lr=0.1))
        return replicas.global_squared_norm(gradients)

    assert dist.simulate(2, body) == [expected, expected]


@pytest.mark.parametrize("last_elements, buckets", [(1, 1), (2, 2)])
def test_the_default_bucket_limit_is_25_mib_of_wire(last_elements, buckets):
    """bucket_mb defaults to 25 (PyTorch DDP's bucket_cap_mb): a float32 wire holds 25 * 2**20 / 4
    elements a bucket. A parameter one element short of that and one more parameter of 1 element
    fill the limit exactly (one bucket); of 2 elements, they pass it by one (two buckets)."""
    limit = 25 * 2**20 // np.dtype(np.float32).itemsize
    comm = dist.simulate(1, lambda comm: comm)[0]
    sizes = (last_elements, limit - 1)  # taken last to first: the big one opens the first bucket
    parameters = [nn.Parameter(np.zeros(n, np.float32)) for n in sizes]
    replicas = DataParallel(comm, optim.SGD(parameters, lr=0.1))
    assert len(replicas.buckets) == buckets
    assert replicas.buckets[0][0][0] == 1 and sum(n for _, n in replicas.buckets) == sum(sizes)


def test_a_rank_without_parameters_has_no_buckets_and_nothing_to_reduce():
    """A stage may hold no parameters: the replicas build with no buckets, buffers or plans (no
    array to take an array module from), and reduce leaves the empty gradient list as it was."""

    def body(comm):
        replicas = DataParallel(comm, optim.SGD([], lr=0.1))
        gradients: list = []
        replicas.reduce(gradients)
        return replicas.buckets, replicas.buffers, replicas.plans, gradients

    assert dist.simulate(2, body) == [([], [], [], [])] * 2


def test_without_overlap_no_communication_happens_inside_backward():
    """The all-reduce of reduce() runs after backward, not inside it: without overlap (asked for
    or not: one replica has nothing to overlap) the running total stays exactly 0 seconds."""

    def body(comm, overlap):
        parameters = [nn.Parameter(np.zeros(3, np.float32))]
        replicas = DataParallel(comm, optim.SGD(parameters, lr=0.1), overlap=overlap)
        replicas.reduce([np.ones(3, np.float32)])
        return replicas.backward_communication_seconds()

    assert dist.simulate(2, body, False) == [0.0, 0.0]
    assert dist.simulate(1, body, True) == [0.0]


def test_a_partial_tensor_parallel_gradient_no_loss_reached_is_summed_as_zeros():
    """One replica (nothing to average) and two tensor-parallel ranks: position 0 holds partial
    gradients (sequence parallelism), position 1 a whole copy. Rank 0's loss did not reach
    position 0: it takes part with zeros shaped like its master, and both ranks get rank 1's
    gradient (0 + g); position 1 is left as it was."""
    reached = np.arange(6, dtype=np.float32).reshape(2, 3)

    def body(comm):
        replica = comm.split(color=comm.rank)  # each rank its own data-parallel group of one
        parameters = [nn.Parameter(np.zeros((2, 3), np.float32)), nn.Parameter(np.zeros(4))]
        shards = TensorParallelGradients(comm, replicated=[0, 1], partial=[0])
        optimizer = optim.SGD(parameters, lr=0.1)
        replicas = DataParallel(replica, optimizer, tensor_parallel=shards)
        grads = [None if comm.rank == 0 else reached.copy(), np.full(4, comm.rank, np.float32)]
        replicas.reduce(grads)
        return grads

    for rank, grads in enumerate(dist.simulate(2, body)):
        assert grads[0].dtype == np.float32 and grads[0].shape == (2, 3)
        np.testing.assert_array_equal(grads[0], np.zeros((2, 3)) + reached)
        np.testing.assert_array_equal(grads[1], np.full(4, rank))
