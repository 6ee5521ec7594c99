"""Lesson 3 (mixed precision): the model and figures its cells print and its claims tests check,
and the checkers of its exercises (the bytes backward keeps, the mixed-precision SGD step by hand,
stochastic rounding). Reference solutions: lessons/solutions/lesson03.py."""

import warnings
from typing import Any, Callable

import numpy as np

from minimp import StaticLossScaler, Tensor, mixed_precision_step, nn, optim
from minimp.lessons.checking import Report, call, expect
from minimp.tensor import saved_bytes

F16 = np.float16

# ----- what the lesson's cells use (tests/lessons/test_lesson03.py checks the same) ----------
BATCH = 128  # digits images in the lesson's batch
WIDTHS = (64, 256, 256, 10)  # its MLP: 8x8 pixels in, 10 classes out
UPDATE = 2.0**-12  # half the float16 gap just below 1.0
UPDATES = 1000


def mlp(rng: np.random.Generator) -> nn.Sequential:
    """The lesson's MLP: Linear(64, 256), ReLU, Linear(256, 256), ReLU, Linear(256, 10)."""
    layers: list[nn.Module] = []
    for number, (width_in, width_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(nn.Linear(width_in, width_out, rng=rng))
        if number < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def kept_bytes(dtype: Any, images: np.ndarray, labels: np.ndarray) -> int:
    """Bytes one forward pass of the lesson's MLP (built afresh from seed 0, in `dtype`) and its
    cross-entropy loss keep for backward, the parameters themselves not counted."""
    from minimp import functional as F

    network = mlp(np.random.default_rng(0)).to(dtype)
    loss = F.cross_entropy(network(Tensor(images.astype(dtype))), labels)
    return saved_bytes(loss, exclude=[p.data for p in network.parameters()])


def measured_activation_bytes(batch: int, widths: list[int], dtype: Any) -> int:
    """What minimp keeps for backward of an MLP (Linear, ReLU, ..., Linear) without a loss,
    parameters excluded."""
    rng = np.random.default_rng(0)
    layers: list[nn.Module] = []
    for number, (width_in, width_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(width_in, width_out, rng=rng))
        if number < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to(dtype)
    output = model(Tensor(rng.standard_normal((batch, widths[0])).astype(dtype)))
    return saved_bytes(output, exclude=[p.data for p in model.parameters()])


def check_activation_bytes(activation_bytes: Callable[[int, list, int], int],
                           quiet: bool = False) -> Report:
    """activation_bytes(batch, widths, itemsize): bytes an MLP keeps for backward (measured)."""
    report = Report("activation_bytes", quiet)
    cases = [(128, [64, 256, 256, 10]), (32, [10, 7]), (5, [3, 100, 50, 20, 4])]
    for dtype in (np.float32, F16):

        @report.case(
            f"{np.dtype(dtype).name}: three MLPs, measured with minimp.tensor.saved_bytes",
            hint="a Linear keeps its input, a ReLU its output, which is the next Linear's input "
            "(one array, counted once); nothing keeps the last output",
        )
        def _():
            for batch, widths in cases:
                itemsize = np.dtype(dtype).itemsize
                want = measured_activation_bytes(batch, widths, dtype)
                got = call(activation_bytes, batch, list(widths), itemsize)
                expect(got == want, f"batch {batch}, widths {widths}: you say {got}, "
                       f"minimp keeps {want} bytes{_miscount(got, batch, widths, itemsize)}")

    return report.finish()


def _miscount(got: Any, batch: int, widths: list[int], itemsize: int) -> str:
    """What a wrong count of activation bytes most likely counted, as a clause to append."""
    per_row = {
        sum(widths): "the last output, which nothing keeps",
        sum(widths[1:-1]): "no input: the first Linear keeps its input x too",
        widths[0] + 2 * sum(widths[1:-1]): "each ReLU output twice: it is the next Linear's "
        "input, one array, counted once",
    }
    for width, mistake in per_row.items():
        if got == batch * width * itemsize and width != sum(widths[:-1]):
            return f" (that counts {mistake})"
    return ""


def _problem(seed: int, size: int = 50) -> tuple[list, list, list]:
    rng = np.random.default_rng(seed)
    masters = [rng.standard_normal(shape).astype(np.float32) for shape in ((size,), (4, 3))]
    params = [m.astype(F16) for m in masters]
    grads = [(rng.standard_normal(m.shape) * 2.0**10).astype(F16) for m in masters]
    return params, grads, masters


def _minimp_step(params: list, grads: list, masters: list, lr: float, scale: float) -> bool:
    """The same step through minimp: SGD on float32 masters, a static loss scale."""
    parameters = [nn.Parameter(m.copy()) for m in masters]
    optimizer = optim.SGD(parameters, lr=lr)
    for parameter, grad in zip(parameters, grads):
        parameter.data = parameter.data.astype(F16)
        parameter.grad = grad.copy()
    scaler = StaticLossScaler(scale)
    scaler.applied = True  # the gradients above carry the scale already
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore")
        result = mixed_precision_step(optimizer, scaler)
    for index, parameter in enumerate(parameters):
        params[index][...] = parameter.data
        masters[index][...] = optimizer.master_weights[index]
    return result.skipped


def _compare_step(sgd_step: Callable, params: list, grads: list, masters: list, lr: float,
                  scale: float) -> tuple[bool, bool]:
    ours = ([p.copy() for p in params], grads, [m.copy() for m in masters])
    skipped_ours = _minimp_step(*ours, lr, scale)
    arrays = [id(a) for a in params + masters]
    with np.errstate(over="ignore", invalid="ignore"):
        skipped = call(sgd_step, params, [g.copy() for g in grads], masters, lr, scale)
    expect([id(a) for a in params + masters] == arrays,
           "a new array replaced params[i] or masters[i] in the list: update them in place "
           "(masters[i] -= ..., params[i][...] = ...), as an optimizer must, since the model "
           "holds those very arrays")
    for index in range(len(params)):
        expect(np.allclose(masters[index], ours[2][index], rtol=1e-6, atol=1e-12),
               f"master {index} differs from minimp's by up to "
               f"{np.max(np.abs(masters[index] - ours[2][index])):.3g}")
        expect(np.array_equal(params[index], masters[index].astype(F16)),
               f"float16 copy {index} is not its master rounded to float16")
    return bool(skipped), skipped_ours


def check_sgd_step(sgd_step: Callable[..., bool], quiet: bool = False) -> Report:
    """sgd_step(params16, grads16, masters32, lr, loss_scale) -> skipped: the mixed-precision
    step of plain SGD, in place."""
    report = Report("sgd_step", quiet)

    @report.case(
        "a finite step: masters and float16 copies as minimp's SGD leaves them",
        hint="widen each gradient to float32, divide by the loss scale, master -= lr * grad, "
        "then params[i][...] = masters[i].astype(np.float16)",
    )
    def _():
        skipped, _ = _compare_step(sgd_step, *_problem(0), lr=0.1, scale=2.0**10)
        expect(skipped is False, f"returned {skipped!r} for a step that was taken")

    for bad in (np.inf, np.nan):

        @report.case(
            f"a gradient holding {bad} skips the whole step: nothing changes, returns True",
            hint="check every gradient with np.isfinite before touching anything",
        )
        def _():
            params, grads, masters = _problem(1)
            grads[1][2, 1] = bad
            before = [p.copy() for p in params], [m.copy() for m in masters]
            skipped, _ = _compare_step(sgd_step, params, grads, masters, lr=0.1, scale=2.0**10)
            expect(skipped is True, f"returned {skipped!r}")
            for now, then in zip(params + masters, before[0] + before[1]):
                expect(np.array_equal(now, then), "an array changed on a skipped step")

    @report.case(
        "gradients that are tiny once unscaled (below 2^-14): unscaled in float32",
        hint="widen the float16 gradient to float32 first, then divide by the loss scale: in "
        "float16, (1 + 2^-10) / 2^20 rounds to 2^-20 and 1 / 2^26 to 0",
    )
    def _():
        params, masters = [np.zeros(2, F16)], [np.zeros(2, np.float32)]
        grads = [np.array([1 + 2.0**-10, 2.0**-6], F16)]
        call(sgd_step, params, grads, masters, 1.0, 2.0**20)
        want = -grads[0].astype(np.float32) / np.float32(2.0**20)
        expect(np.array_equal(masters[0], want), f"masters became {masters[0].tolist()}, "
               f"expected {want.tolist()} (float32 keeps 2^-26 and (1 + 2^-10) x 2^-20)")

    @report.case(
        "an update of 2^-13 at 1.0: the master moves, its float16 copy stays 1.0",
        hint="apply the update to the float32 master, never to the float16 copy",
    )
    def _():
        params, masters = [np.ones(3, F16)], [np.ones(3, np.float32)]
        grads = [np.full(3, 2.0**-3, F16)]  # * lr 2^-10 = 2^-13, a quarter of the gap below 1
        call(sgd_step, params, grads, masters, 2.0**-10, 1.0)
        expect(np.all(masters[0] == np.float32(1 - 2.0**-13)), f"master is {masters[0]}")
        expect(np.all(params[0] == 1.0), f"float16 copy is {params[0]}")

    return report.finish()


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float16 numbers just below (or at) and just above each float32 x."""
    nearest = x.astype(F16)
    below = np.where(nearest.astype(np.float32) > x, np.nextafter(nearest, F16(-np.inf)), nearest)
    return below, np.nextafter(below, F16(np.inf))


def check_stochastic_round(stochastic_round: Callable[[np.ndarray, Any], np.ndarray],
                           quiet: bool = False) -> Report:
    """stochastic_round(x32, rng) -> float16 array: up with probability equal to how far x is
    from the neighbour below, as a fraction of the gap (so the mean is x)."""
    report = Report("stochastic_round", quiet)
    rng = np.random.default_rng(4)

    @report.case("float16 numbers stay exactly", hint="the distance to the neighbour below is 0")
    def _():
        x = rng.standard_normal(1000).astype(F16).astype(np.float32)
        got = np.asarray(call(stochastic_round, x.copy(), np.random.default_rng(0)))
        expect(got.dtype == F16 and got.shape == x.shape, f"returned {got.dtype} {got.shape}")
        expect(np.array_equal(got.astype(np.float32), x), "a float16 number moved")

    @report.case("every result is one of x's two float16 neighbours", hint="np.nextafter")
    def _():
        x = rng.standard_normal((50, 40)).astype(np.float32)
        got = np.asarray(call(stochastic_round, x.copy(), np.random.default_rng(1)))
        below, above = _neighbours(x)
        expect(got.shape == x.shape, f"shape {got.shape}, expected {x.shape}")
        expect(np.all((got == below) | (got == above)), "a result is not a neighbour of x")

    @report.case(
        "unbiased: 1 + 2^-12 (a quarter gap above 1.0) averages 1 + 2^-12 over 20,000 draws",
        hint="go up when rng.random() < (x - below) / (above - below)",
    )
    def _():
        x = np.full(20000, 1 + 2.0**-12, np.float32)
        got = np.asarray(call(stochastic_round, x, np.random.default_rng(2)), np.float64)
        error = abs(got.mean() - (1 + 2.0**-12))
        up = (got.mean() - 1) / 2.0**-10  # the fraction of draws that went up to 1 + 2^-10
        if up < 0.05:
            why = "no draw went up: rounding to nearest (or always down) gives 1.0 every time"
        elif abs(up - 0.75) < 0.05:
            why = ("3 draws in 4 went up: go up with probability (x - below) / (above - below), "
                   "a quarter here, not (above - x) / (above - below)")
        else:
            why = f"{up:.0%} of the draws went up, expected 25%"
        expect(error < 2e-5, f"the mean is {got.mean():.7f}, {error:.2g} from 1 + 2^-12: {why}")

    @report.case(
        "draws from rng: generators in the same state give the same result, and rng advances",
        hint="use rng.random(x.shape), not np.random (NumPy's global generator) nor a new "
        "generator of your own: the caller's rng makes a run reproducible",
    )
    def _():
        x = rng.standard_normal(1000).astype(np.float32)
        first, second = np.random.default_rng(5), np.random.default_rng(5)
        state = first.bit_generator.state
        a = np.asarray(call(stochastic_round, x.copy(), first))
        b = np.asarray(call(stochastic_round, x.copy(), second))
        expect(first.bit_generator.state != state, "rng was not used: its state did not change")
        expect(np.array_equal(a, b), "two generators in the same state gave different results: "
               "the random numbers came from elsewhere than rng")

    @report.case(
        "1000 updates of -2^-12 on a float16 weight at 1.0 end near 1 - 1000 x 2^-12",
        hint="weight = stochastic_round(weight.astype(np.float32) - 2**-12, rng), 1000 times",
    )
    def _():
        generator, weight = np.random.default_rng(3), np.ones(1, F16)
        for _ in range(1000):
            updated = weight.astype(np.float32) - np.float32(2.0**-12)
            weight = call(stochastic_round, updated, generator)
        target = 1 - 1000 * 2.0**-12
        expect(abs(float(weight[0]) - target) < 0.04, f"ended at {float(weight[0])}, expected "
               f"about {target} (round to nearest stays at 1.0)")

    return report.finish()


EXERCISES = [
    ("activation_bytes", check_activation_bytes),
    ("sgd_step", check_sgd_step),
    ("stochastic_round", check_stochastic_round),
]
