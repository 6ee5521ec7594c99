"""The caching allocator: an array is handed out again only after its last reference (views
included) is gone, never to two live users; exact shapes, dtypes and sizes; its byte cap; one
pool per thread; and training that is bit-identical with the pool on and off."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minimp import backend, memory_pool
from minimp import distributed as dist
from minimp.backend import data_address
from minimp.memory_pool import MemoryPool
from minimp.train import TrainConfig, train


def test_an_array_is_handed_out_again_only_after_its_last_reference_dies():
    pool = MemoryPool()
    first = pool.empty((4, 8), np.float32)
    address = data_address(first)
    second = pool.empty((4, 8), np.float32)
    assert data_address(second) != address  # first is alive: a new array
    view = first[1:]
    del first
    assert data_address(pool.empty((4, 8), np.float32)) != address  # the view still reads it
    del view
    assert data_address(pool.empty((4, 8), np.float32)) == address
    assert (pool.hits, pool.misses) == (1, 3)


def test_arrays_are_ordinary_owners_of_exactly_the_requested_shape_and_dtype():
    """So saved_bytes and ZeRO's accounts, which count the memory owner's nbytes, see the live
    array's bytes and nothing of the pool."""
    pool = MemoryPool()
    for shape, dtype in (((3, 5), np.float16), ((3, 5), np.float32), ((15,), np.float32)):
        array = pool.empty(shape, dtype)
        assert array.shape == shape and array.dtype == dtype and array.base is None
        assert array.flags.c_contiguous
        assert array.nbytes == np.prod(shape) * np.dtype(dtype).itemsize
        del array
    # Free arrays of the same size but another shape or dtype are not handed out for it.
    assert pool.misses == 3 and pool.hits == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.sampled_from([(2, 3), (6,)]))))
def test_no_two_live_arrays_share_memory(actions):
    """Random requests and releases: each live array keeps the value written into it when it
    was handed out, and no two live arrays overlap."""
    pool, live, stamp = MemoryPool(), {}, 0
    for allocate, slot, shape in actions:
        if allocate:
            stamp += 1
            live[slot] = pool.empty(shape, np.float64)
            live[slot][...] = stamp
        else:
            live.pop(slot, None)
        _check_intact(live)


def _check_intact(live):
    """Every live array still holds its stamp and overlaps no other (holding no reference after)."""
    arrays = list(live.values())
    for index, array in enumerate(arrays):
        assert (array == array.flat[0]).all()
        assert not any(np.shares_memory(array, other) for other in arrays[index + 1 :])


def test_beyond_its_cap_the_pool_drops_free_arrays_and_never_one_in_use():
    pool = MemoryPool(max_bytes=3 * 400)
    kept = [pool.empty((100,), np.float32) for _ in range(2)]  # 800 bytes in use
    free = pool.empty((50,), np.float32)
    del free
    assert pool.pooled_bytes == 1000 and pool.free_bytes() == 200
    third = pool.empty((100,), np.float32)  # does not fit: the free 200 bytes are dropped
    assert pool.pooled_bytes == 1200 and pool.free_bytes() == 0
    beyond = pool.empty((100,), np.float32)  # nothing free to drop: an unpooled array
    assert pool.pooled_bytes == 1200 and beyond.base is None
    assert not any(np.shares_memory(array, beyond) for array in kept + [third])
    del kept, third
    assert pool.free_bytes() == 1200
    pool.release_free()
    assert pool.pooled_bytes == 0 and pool.free_bytes() == 0


def test_a_request_looks_at_a_bounded_number_of_arrays_however_many_are_in_use(monkeypatch):
    """A model of thousands of same-shaped layers holds thousands of such arrays during its
    forward: a request that looked at all of them made a step quadratic in the layers."""
    pool, looked = MemoryPool(), []
    in_use = [pool.empty((2, 2), np.float32) for _ in range(1000)]
    original = memory_pool.held_only_by

    def counted(*args):
        looked.append(args)
        return original(*args)

    monkeypatch.setattr(memory_pool, "held_only_by", counted)
    in_use.append(pool.empty((2, 2), np.float32))
    assert 0 < len(looked) <= 2 * memory_pool.SCAN and pool.misses == 1001


def test_arrays_held_for_long_at_the_front_do_not_keep_the_free_ones_from_being_reused():
    """Weights of one shape in every layer stay in use all run, and so do the newest arrays;
    arrays freed between them (last step's activations) must still be handed out again, not
    allocated afresh every time."""
    pool = MemoryPool()
    weights = [pool.empty((2, 2), np.float32) for _ in range(100)]  # noqa: F841 (held all run)
    activations = [pool.empty((2, 2), np.float32) for _ in range(40)]
    newest = [pool.empty((2, 2), np.float32) for _ in range(40)]  # noqa: F841 (in use)
    del activations
    misses = pool.misses
    again = [pool.empty((2, 2), np.float32) for _ in range(40)]
    assert len(again) == 40 and pool.misses - misses <= 100 // memory_pool.SCAN + 1


def test_the_free_reference_count_is_measured_on_this_interpreter():
    holder = [np.empty(3)]
    assert list(memory_pool._free_indices(holder)) == [0]
    alias = holder[0]  # noqa: F841 (the second reference is the point)
    assert list(memory_pool._free_indices(holder)) == []


def test_each_thread_has_its_own_pool():
    pools = []
    thread = threading.Thread(target=lambda: pools.append(backend.memory_pool()))
    thread.start()
    thread.join()
    assert pools[0] is not backend.memory_pool()


def test_backend_empty_uses_the_pool_only_when_enabled():
    like = np.zeros(1, np.float32)
    pool = backend.memory_pool()
    hits, misses = pool.hits, pool.misses
    array = backend.empty((7, 3), np.float32, like)
    address = data_address(array)
    # the pool was asked once (a hit when an earlier test left a free (7, 3) array in it)
    assert pool.hits + pool.misses == hits + misses + 1
    hits, misses = pool.hits, pool.misses
    with backend.Device("cpu", memory_pool=False):
        del array
        array = backend.empty((7, 3), np.float32, like)
        assert (pool.hits, pool.misses) == (hits, misses)  # the pool was not asked
        assert data_address(array) != address or array.base is None


def test_the_cupy_path_allocates_on_the_device():
    """CuPy arrays come from CuPy's own pool (backend.empty) or from a MemoryPool given xp."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (CPU-only machine)")
    try:
        like = cupy.zeros(1, cupy.float32)
    except Exception as error:  # CuPy without a usable GPU
        pytest.skip(f"CuPy cannot allocate on a GPU here ({error})")
    assert type(backend.empty((2, 3), np.float32, like)) is cupy.ndarray
    pool = MemoryPool()
    first = pool.empty((2, 3), np.float32, xp=cupy)
    pointer = first.data.ptr
    assert type(first) is cupy.ndarray and first.dtype == np.float32
    view = first[1:]
    del first
    assert pool.empty((2, 3), np.float32, xp=cupy).data.ptr != pointer
    del view
    assert pool.empty((2, 3), np.float32, xp=cupy).data.ptr == pointer


@pytest.fixture
def pool_hits(monkeypatch):
    """Counts arrays handed out again, by every thread's pool (so a test can show it was used)."""
    counted = []
    original = MemoryPool.empty

    def empty(pool, *args, **kwargs):
        hits = pool.hits
        array = original(pool, *args, **kwargs)
        counted.append(pool.hits - hits)
        return array

    monkeypatch.setattr(MemoryPool, "empty", empty)
    return counted


def _train(world_size, pooled, **overrides):
    settings = dict(hidden=32, layers=2, batch_size=32, steps=4, log_every=1000)
    config = TrainConfig(**{**settings, **overrides})
    config.validate(world_size)
    with backend.Device("cpu", memory_pool=pooled):  # the simulated ranks run under it too
        results = dist.simulate(
            world_size, lambda comm: train(config, log=lambda line: None, comm=comm)
        )
    return [result["master_weights"] for result in results]


GPT = dict(dataset="shakespeare", heads=2, context=16, batch_size=8, warmup=2, eval_every=0)


@pytest.mark.parametrize(
    "world_size, overrides",
    [
        (1, dict(precision="fp32")),
        (1, dict(precision="fp16")),
        (1, dict(precision="bf16", micro_batches=2)),
        (2, dict(precision="fp16", dp=2)),
        (2, dict(precision="fp32", dp=2, zero=2)),
        (1, dict(GPT, precision="fp32")),
        (2, dict(GPT, precision="bf16", dp=2)),
    ],
)
def test_training_is_bit_identical_with_the_pool_on_and_off(world_size, overrides, pool_hits):
    pooled = _train(world_size, True, **overrides)
    assert sum(pool_hits) > 0  # arrays were handed out again: the pool was used
    pool_hits.clear()
    plain = _train(world_size, False, **overrides)
    assert pool_hits == []
    assert len(pooled) == world_size
    for rank_pooled, rank_plain in zip(pooled, plain):
        assert rank_pooled.keys() == rank_plain.keys()
        for name in rank_pooled:
            assert rank_pooled[name].tobytes() == rank_plain[name].tobytes(), name


def test_sole_holder_allows_for_the_pool_s_own_reference_and_nothing_else():
    like = np.zeros(1, np.float32)
    for holder in ([backend.empty((3,), np.float32, like)], [np.empty(3, np.float32)]):
        assert backend.sole_holder(holder, 0)
        other = holder[0]
        assert not backend.sole_holder(holder, 0)
        del other
        view = holder[0][1:]
        assert not backend.sole_holder(holder, 0)
        del view
        assert backend.sole_holder(holder, 0)
