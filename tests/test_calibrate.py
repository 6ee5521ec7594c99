"""Calibration: the sizes it measures, and the terms it measures, on the simulated world; what it
times, how often and with which arguments, on a recording communicator and a fake clock."""

import itertools

import numpy as np
import pytest

from minimp.measure import calibrate as calibration
from minimp.measure.calibrate import (
    FRESH_MEMORY_WARMUPS,
    PRETENDED_RANKS,
    calibrate,
    calibration_sizes,
    fit_model,
    join_rounds,
    measure_terms,
    per_round,
    python_seconds,
    repeats_for,
    ring_step_line,
    rotating_chunks,
    timed,
)
from minimp.distributed.protocol import Tag
from minimp.distributed.simulated import simulate
from minimp.measure.machinemodel import ALGORITHMS as MODELLED
from minimp.measure.machinemodel import fit_lines, interpolate_lines


def test_calibration_sizes_bracket_the_range_and_skip_every_power_of_two():
    sizes = calibration_sizes(1024, 64 * 2**20)
    assert sizes[0] <= 1024 < sizes[1] and sizes[-2] < 64 * 2**20 <= sizes[-1]
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert all(n % 4 == 0 and n & (n - 1) != 0 for n in sizes)


def test_small_sizes_are_timed_at_least_fifty_times():
    assert repeats_for(4096) >= 50 and repeats_for(2**20) >= 50 and repeats_for(2**26) >= 7


@pytest.mark.parametrize("ranks", [2, 3])
def test_calibrate_measures_every_term_on_every_rank_alike(ranks):
    sizes = calibration_sizes(1024, 16384)
    results = simulate(ranks, lambda comm: calibrate(comm, sizes))
    for model, terms in results:
        assert model.ranks == ranks and terms["sizes"] == sizes
        assert len(terms["message"]) == len(terms["reduce"]) == len(sizes)
        assert len(terms["ring_step"]) == len(sizes)
        measured = terms["message"] + terms["reduce"] + terms["ring_step"]
        assert terms["agree"] > 0 and all(t > 0 for t in measured)
        for name, seconds in terms["python"].items():
            assert len(seconds) == len(PRETENDED_RANKS) and min(seconds) > 0, name
        assert model.ring_allreduce(4096) > model.agree
    # each time is the slowest rank's, agreed by all-reduce: every rank holds the same numbers
    assert all(terms == results[0][1] for _, terms in results)


def test_calibration_sizes_pinned():
    assert calibration_sizes(1024, 16384) == [768, 1536, 3072, 6144, 12288, 24576]
    # a smallest size that is exactly 2 x 12: it starts there; a largest it reaches: it stops there
    assert calibration_sizes(24, 24) == [24]
    assert calibration_sizes(1, 12) == [12]


def test_repeats_for_is_50_up_to_a_mebibyte_then_a_budget_of_bytes_at_least_7_times():
    assert repeats_for(4) == repeats_for(2**20) == 50
    assert repeats_for(2**20 + 4) == 51  # int(0.05 * 2**30 / (2**20 + 4)) = int(51.19...)
    assert repeats_for(2**21) == 25  # int(25.6)
    assert repeats_for(2**30) == 7  # the budget alone would allow 0
    assert repeats_for(2**21, budget=0.1) == 51


class Recorder:
    """A communicator of one rank that records what it is asked, and answers each scalar
    all-reduce with the values it was given (the slowest rank's, were there others)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.calls: list = []
        self.tags: list = []

    def barrier(self):
        self.calls.append(("barrier",))

    def allreduce_scalars(self, values, op=None):
        self.calls.append(("allreduce_scalars", np.array(values), op))
        return np.asarray(values, np.float64)

    def sendrecv(self, send, dest, recv, source, tag=None):
        self.calls.append(("sendrecv", send.dtype, send.nbytes, dest, recv.nbytes, source))
        self.tags.append(tag)


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def perf_counter(self) -> float:
        return self.now


def test_timed_is_the_median_of_the_slowest_ranks_seconds_after_one_untimed_run(monkeypatch):
    clock = FakeClock(1000.0)  # far from 0: a sum of two clock readings would show
    monkeypatch.setattr(calibration, "time", clock)
    durations = iter([9.0, 3.0, 1.0, 2.0])  # the untimed run, then three timed ones

    def work():
        clock.now += next(durations)

    comm = Recorder(0, 2)
    assert timed(comm, work, 3) == 2.0
    reduced = [call for call in comm.calls if call[0] == "allreduce_scalars"]
    reduced_values = [(list(values), op) for _, values, op in reduced]
    assert reduced_values == [([3.0], "max"), ([1.0], "max"), ([2.0], "max")]
    assert [call[0] for call in comm.calls].count("barrier") == 3


def test_timed_runs_the_warmups_asked_for_untimed(monkeypatch):
    clock = FakeClock(0.0)
    monkeypatch.setattr(calibration, "time", clock)
    durations = iter([50.0, 40.0, 30.0, 5.0, 7.0])  # three untimed runs, then two timed ones

    def work():
        clock.now += next(durations)

    comm = Recorder(0, 2)
    assert timed(comm, work, 2, warmups=3) == 6.0  # the median of two: their mean
    assert [call[0] for call in comm.calls].count("barrier") == 2
    assert next(durations, None) is None  # five runs in all


def test_per_round_shares_the_repeats_with_at_least_three_a_round():
    assert per_round(50, 1) == 50 and per_round(50, 5) == 10 and per_round(51, 5) == 11
    assert per_round(7, 5) == 3 and per_round(2, 1) == 3 and per_round(200, 5) == 40


def test_join_rounds_averages_every_number_and_keeps_what_the_rounds_agree_on():
    rounds = [
        {"sizes": [12, 24], "agree": 1.0, "python": {"ring": [1.0, 4.0]}, "choice": "ring"},
        {"sizes": [12, 24], "agree": 2.0, "python": {"ring": [2.0, 4.0]}, "choice": "ring"},
        {"sizes": [12, 24], "agree": 6.0, "python": {"ring": [6.0, 4.0]}, "choice": "ring"},
    ]
    joined = join_rounds(rounds)
    expected = {"sizes": [12, 24], "agree": 3.0, "python": {"ring": [3.0, 4.0]}, "choice": "ring"}
    assert joined == expected
    assert all(type(n) is int for n in joined["sizes"])  # sizes stay sizes
    assert join_rounds(rounds, np.median)["agree"] == 2.0
    assert join_rounds([[{"ring": 1.0}, 5.0]] * 2 + [[{"ring": 4.0}, 8.0]]) == [{"ring": 2.0}, 6.0]


def fake_timed(log: list, warmups: list | None = None):
    """timed() that runs the function once and notes how many repetitions it was asked for (and,
    given a second list, how many untimed runs)."""

    def run_once(comm, function, repeats, warmups_asked=1):
        log.append(repeats)
        if warmups is not None:
            warmups.append(warmups_asked)
        function()
        return 1.0

    return run_once


@pytest.mark.parametrize("rank, size, partner", [(0, 2, 1), (1, 2, 0), (2, 3, 2)])
def test_measure_terms_times_the_agreement_exchanges_with_the_partner_and_adds(
    monkeypatch, rank, size, partner
):
    repeats: list = []
    warmups: list = []
    adds: list = []
    monkeypatch.setattr(calibration, "timed", fake_timed(repeats, warmups))
    def record_add(target, incoming, *rest):
        adds.append((target.nbytes, incoming.nbytes, rest))

    monkeypatch.setattr(calibration, "reduce_into", record_add)
    comm = Recorder(rank, size)
    terms = measure_terms(comm, [12, 24])
    # the agreement: four float64 zeros, reduced with max, timed 200 times
    _, values, op = comm.calls[0]
    assert values.dtype == np.float64 and values.tolist() == [0.0] * 4 and op == "max"
    python_repeats = [100] * len(PRETENDED_RANKS) * len(MODELLED)
    # message, reduce, ring step per size; then the ring step's Python
    assert repeats == [200] + python_repeats + [50] * 6 + [100]
    # new memory (the message's and the ring step's arrays) is run three times before timing
    per_size = [FRESH_MEMORY_WARMUPS, 1, FRESH_MEMORY_WARMUPS]
    assert warmups == [1] * (1 + len(python_repeats)) + per_size * 2 + [1]
    assert FRESH_MEMORY_WARMUPS == 3
    exchanges = [call[1:] for call in comm.calls if call[0] == "sendrecv"]
    # per size: the message, then the ring's two steps between the pair, chunks of that size
    assert exchanges == [(np.float32, 12, partner, 12, partner)] * 3 + [
        (np.float32, 24, partner, 24, partner)
    ] * 3
    assert adds == [(12, 12, ("sum",)), (24, 24, ("sum",))]
    assert terms["sizes"] == [12, 24] and terms["message"] == terms["reduce"] == [1.0, 1.0]
    assert terms["ring_step"] == [1.0, 1.0] and terms["ring_step_python"] == 1.0


def test_measure_terms_in_rounds_takes_a_share_of_each_terms_repeats(monkeypatch):
    repeats: list = []
    monkeypatch.setattr(calibration, "timed", fake_timed(repeats))
    monkeypatch.setattr(calibration, "reduce_into", lambda *args: None)
    measure_terms(Recorder(0, 2), [12, 2**22], rounds=5)
    python_repeats = [20] * len(PRETENDED_RANKS) * len(MODELLED)
    # 4 MiB: 12 repeats in all for the message and the add, 7 for the ring step's two chunks;
    # a round takes 3 of either
    assert repeats == [40] + python_repeats + [10] * 3 + [3] * 3 + [20]
    assert repeats_for(2**22) == 12 and repeats_for(2**23) == 7


def test_rotating_chunks_are_float32_chunks_of_nbytes_taken_in_turn():
    chunks = list(itertools.islice(rotating_chunks(12, 3), 4))
    assert all(chunk.dtype == np.float32 and chunk.nbytes == 12 for chunk in chunks)
    assert chunks[3] is chunks[0] and chunks[1] is not chunks[0] and chunks[2] is not chunks[1]
    assert chunks[0].base is chunks[1].base is chunks[2].base  # three views of one array


def test_python_seconds_runs_the_algorithm_silently_on_each_pretended_world(monkeypatch):
    repeats: list = []
    seen: list = []

    def algorithm(comm, x, out=None):
        seen.append(
            (comm.rank, comm.size, x.dtype, x.tolist(), out.dtype, out.tolist(), np.geterr())
        )
        # the silent communicator keeps the Protocol's word: float64 scalars, even from ints
        scalars = comm.allreduce_scalars([x.size, 7])
        assert scalars.dtype == np.float64 and scalars.tolist() == [x.size, 7]

    monkeypatch.setattr(calibration, "timed", fake_timed(repeats))
    monkeypatch.setitem(calibration.ALGORITHMS, "ring", algorithm)
    python_seconds(Recorder(5, 8), "ring")
    assert repeats == [100] * len(PRETENDED_RANKS)
    ignore_all = {"divide": "ignore", "over": "ignore", "under": "ignore", "invalid": "ignore"}
    assert seen == [
        (5 % p, p, np.float32, [1.0] * p, np.float32, [0.0] * p, ignore_all)
        for p in PRETENDED_RANKS
    ]


def test_calibrate_fits_each_term_and_names_the_model(monkeypatch):
    sizes = [12, 24, 48, 96]
    terms = {
        "agree": 3e-6,
        "python": {
            name: [1e-6 * (i + 1) * p for p in PRETENDED_RANKS] for i, name in enumerate(MODELLED)
        },
        "sizes": sizes,
        "message": [2e-6 + 1e-9 * n for n in sizes],
        "reduce": [1e-7 + 4e-10 * n for n in sizes],
        "ring_step": [9e-6 + 3e-9 * n for n in sizes],
        "ring_step_python": 4e-6,
    }
    monkeypatch.setattr(calibration, "measure_terms", lambda comm, sizes: terms)
    model, measured = calibrate(Recorder(0, 4), sizes)
    assert measured is terms and model.ranks == 4 and model.agree == 3e-6
    assert model.message == fit_lines(sizes, terms["message"])
    assert model.reduce == fit_lines(sizes, terms["reduce"])
    # the step less its Python, which the ring's Python term holds already
    assert model.ring_step(48) == pytest.approx(5e-6 + 3e-9 * 48)
    assert model.ring_step == ring_step_line(sizes, terms["ring_step"], 4e-6)
    assert model.message != model.reduce  # neither is the other, nor the default Line(0, 0)
    assert model.reduce(48) == pytest.approx(1e-7 + 4e-10 * 48)
    assert model.python == {
        name: fit_lines(PRETENDED_RANKS, seconds) for name, seconds in terms["python"].items()
    }
    assert model.name == "fitted in this run"
    assert fit_model(4, terms) == model
    assert fit_model(2, terms, "other").name == "other" and fit_model(2, terms).ranks == 2


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ring_step_is_the_ring_itself_between_each_pair(ranks):
    """Rank r and r ^ 1 run ring.py's all-reduce as a ring of two: each ends with its pair's sum."""

    def body(comm):
        pair = calibration._Pair(comm, comm.rank ^ 1)
        x = np.arange(4, dtype=np.float32) + 10 * comm.rank
        out = np.zeros(4, np.float32)
        calibration.ring_allreduce_into(pair, x, out)
        return (pair.rank, pair.size), out.tolist()

    results = simulate(ranks, body)
    for rank, (place, out) in enumerate(results):
        low = rank & ~1
        assert place == (rank & 1, 2)
        assert out == [2 * v + 10 * (2 * low + 1) for v in range(4)]


def test_a_rank_without_a_partner_rings_with_itself_under_the_rings_tags():
    comm = Recorder(2, 3)
    pair = calibration._Pair(comm, 2)
    x, out = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    calibration.ring_allreduce_into(pair, x, out)
    exchanges = [call[1:] for call in comm.calls if call[0] == "sendrecv"]
    assert pair.rank == 0 and exchanges == [(np.float32, 8, 2, 8, 2)] * 2
    assert comm.tags == [Tag.RING_REDUCE_SCATTER, Tag.RING_ALL_GATHER]


def test_ring_step_line_joins_the_steps_less_their_python_keeping_a_tenth():
    sizes = [12, 24, 48, 96]
    line = ring_step_line(sizes, [4e-6, 5e-6, 9e-6, 17e-6], 4e-6)
    expected = interpolate_lines(sizes, [4e-7, 1e-6, 5e-6, 13e-6])
    between = [6, 12, 18, 24, 36, 48, 72, 96, 192]
    assert [line(n) for n in between] == pytest.approx([expected(n) for n in between], rel=1e-9)
    assert line(12) == pytest.approx(4e-7) and line(36) == pytest.approx(3e-6)


def test_the_ring_step_is_timed_on_its_own_arrays_and_its_python_on_two_silent_zeros(monkeypatch):
    """measure_terms times the ring of two on two chunks of each size (repetitions for both
    chunks' bytes), then the same ring's Python on the silent communicator: two float32
    elements into two zeros, floating-point errors ignored (nothing arrives: garbage is added)."""
    repeats: list = []
    runs: list = []
    monkeypatch.setattr(calibration, "timed", fake_timed(repeats))

    def record(pair, x, out):
        seen = out.tolist() if out.size < 8 else out.shape
        runs.append((type(pair.comm).__name__, pair.rank, pair.size, x.dtype, x.shape, out.dtype))
        runs[-1] += (seen, np.geterr())

    monkeypatch.setattr(calibration, "ring_allreduce_into", record)
    nbytes = 2**20  # where the ring's two chunks get fewer repetitions than one message
    measure_terms(Recorder(1, 2), [nbytes])
    python_repeats = [100] * len(PRETENDED_RANKS) * len(MODELLED)
    assert repeats == [200] + python_repeats + [50, 50, repeats_for(2 * nbytes), 100]
    assert repeats_for(2 * nbytes) == 25
    ignore_all = {"divide": "ignore", "over": "ignore", "under": "ignore", "invalid": "ignore"}
    timed_run, silent_run = runs
    half = (nbytes // 2,)  # two chunks of nbytes, in float32 elements
    assert timed_run[:7] == ("Recorder", 1, 2, np.float32, half, np.float32, half)
    assert timed_run[7] != ignore_all  # the real step keeps NumPy's error settings
    assert silent_run == ("_Silent", 1, 2, np.float32, (2,), np.float32, [0.0, 0.0], ignore_all)
