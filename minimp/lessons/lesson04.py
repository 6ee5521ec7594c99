"""Lesson 4 (loss scaling): the configurations the notebook runs and its claims tests check (the
digits MLP, its activation and weight gradients, the training runs, the scaler's trace), then the
checkers of its exercises: the window of safe scales, a dynamic loss scaler against minimp's
trajectory, hysteresis. Reference solutions: lessons/solutions/lesson04.py."""

from typing import Any, Callable

import numpy as np

from minimp import DynamicLossScaler, Tensor, nn, optim
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.data import load_digits
from minimp.lessons.checking import Report, call, expect
from minimp.precision import mixed_precision_step
from minimp.train import TrainConfig

F16 = np.float16
TOKENS = 2.0**16  # a loss averaged over 65,536 tokens: each gradient is 2^-16 of a sample's
S = 2.0**16  # the loss scale of the histograms (and the dynamic scaler's starting scale)
BATCH = 256  # digits per step
ADAM_STEPS, SGD_STEPS = 120, 60  # SGD's 60 steps show its point
EPS = 1e-8  # Adam's eps (optim.Adam's default)
# the training command: one injected overflow (rank 0, step 40), growth after 50 clean steps
SCALER_TRACE = TrainConfig(steps=200, loss_scale_growth_interval=50, inject_overflow="40:0",
                           log_every=1000, threads=1)  # threads=1: one BLAS thread, as below


def mlp() -> nn.Sequential:
    """The lesson's network: 64 -> 128 -> 128 -> 10, ReLU between, the same weights every time."""
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(64, 128, rng=rng), nn.ReLU(), nn.Linear(128, 128, rng=rng),
                         nn.ReLU(), nn.Linear(128, 10, rng=rng))


def batch_rows(step: int, size: int) -> np.ndarray:
    """The BATCH sample indices of `step` (out of `size`), the same in every run."""
    return np.random.default_rng([0, step]).choice(size, BATCH, replace=False)


def activation_gradients(loss_factor: float) -> np.ndarray:
    """|gradient| of every activation of the float32 MLP on the first BATCH digits, for the loss
    times loss_factor; exact zeros (from ReLUs that were off) left out. The network is cut at
    every layer (each layer's input becomes a leaf) and backpropagated segment by segment."""
    digits, model = load_digits(), mlp()
    inputs, outputs, h = [], [], Tensor(digits.train_images[:BATCH])
    for layer in model:
        leaf = Tensor(h.data, requires_grad=True)
        h = layer(leaf)
        inputs.append(leaf)
        outputs.append(h)
    (F.cross_entropy(h, digits.train_labels[:BATCH]) * loss_factor).backward()
    for i in range(len(model) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)  # hand the gradient one layer down
    grads = np.concatenate([leaf.grad.ravel() for leaf in inputs[1:]])
    return np.abs(grads[grads != 0])


def in_float16(values: np.ndarray) -> str:
    """Where float16 puts each value: zero, a subnormal, a normal number (how many, and share)."""
    stored = np.abs(values.astype(np.float16))
    zero, normal = int(np.sum(stored == 0)), int(np.sum(stored >= 2**-14))
    subnormal = stored.size - zero - normal
    return (f"zero {zero:5,} ({zero / stored.size:7.3%}), subnormal {subnormal:6,} "
            f"({subnormal / stored.size:5.1%}), normal {normal:6,}, "
            f"largest 2^{np.log2(values.max()):.1f}")


def train_digits(dtype: Any, scaler: Any, make_optimizer: Callable, loss_factor: float = 1 / TOKENS,
                 steps: int = ADAM_STEPS) -> list[float]:
    """Train mlp() in `dtype` on BATCH digits a step with the loss times loss_factor; the loss of
    every step. The optimizer keeps float32 masters (made before the cast)."""
    digits, model = load_digits(), mlp()
    optimizer = make_optimizer(model.parameters())
    model.to(dtype)
    images, labels, losses = digits.train_images.astype(dtype), digits.train_labels, []
    # float16 overflows are expected (the scaler skips them); a model this small runs fastest on
    # one BLAS thread, and on a busy machine far faster
    with np.errstate(over="ignore"), limit_cpu_threads(1):
        for step in range(steps):
            rows = batch_rows(step, len(labels))
            loss = F.cross_entropy(model(Tensor(images[rows])), labels[rows])
            losses.append(loss.item())
            scaler.scale(loss * loss_factor).backward()
            mixed_precision_step(optimizer, scaler)
    return losses


def adam(parameters: list) -> optim.Adam:
    return optim.Adam(parameters, lr=1e-3, eps=EPS)


def sgd(lr: float) -> Callable:
    return lambda parameters: optim.SGD(parameters, lr=lr, momentum=0.9)


def weight_gradients(dtype: Any, loss_factor: float = 1 / TOKENS) -> np.ndarray:
    """Every weight's gradient of mlp() in `dtype` at the first step's batch, for the loss times
    loss_factor (no scaler)."""
    digits, model = load_digits(), mlp()
    model.to(dtype)
    rows = batch_rows(0, len(digits.train_labels))
    logits = model(Tensor(digits.train_images[rows].astype(dtype)))
    (F.cross_entropy(logits, digits.train_labels[rows]) * loss_factor).backward()
    return np.concatenate([p.grad.ravel() for p in model.parameters()])


def _window(gradients: np.ndarray) -> tuple[float, float]:
    """(smallest power of two that keeps every non-zero gradient non-zero in float16,
    largest power of two that keeps every gradient finite), found by trying every exponent."""
    magnitudes = np.abs(gradients[gradients != 0]).astype(np.float64)
    with np.errstate(over="ignore"):
        exponents = range(-60, 61)
        lowest = min(k for k in exponents if np.all(F16(magnitudes * 2.0**k) != 0))
        highest = max(k for k in exponents if np.all(np.isfinite(F16(magnitudes * 2.0**k))))
    return 2.0**lowest, 2.0**highest


def check_scale_window(scale_window: Callable[[np.ndarray], tuple], quiet: bool = False) -> Report:
    """scale_window(gradients) -> (lowest, highest): the smallest power of two S with no non-zero
    gradient flushed to zero by float16 after * S, and the largest with none overflowing."""
    report = Report("scale_window", quiet)

    def compare(gradients):
        low, high = call(scale_window, gradients)
        want = _window(gradients)
        expect((float(low), float(high)) == want,
               f"returned ({low!r}, {high!r}), expected ({want[0]!r}, {want[1]!r})")

    @report.case("gradients from 2^-30 to 2^-3, some negative",
                 hint="gradients can be negative: work with |g|. lowest: min|g| S only has to "
                 "round to 2^-24 or more, so anything above 2^-25 will do (subnormals count: a "
                 "subnormal is not zero); highest: max|g| S must round to 65504 or less")
    def _():
        compare(np.array([2.0**-30 * 1.5, -(2.0**-10), 2.0**-3 * 1.5], np.float32))

    @report.case(
        "a smallest gradient of exactly 2^-30: 2^5 is not enough",
        hint="2^-30 x 2^5 = 2^-25 lies halfway between 0 and 2^-24 and ties to even: zero; "
        "min|g| S must be above 2^-25, not at it",
    )
    def _():
        compare(np.array([2.0**-30, 1e-4], np.float32))

    @report.case(
        "a largest gradient of 65519 / 2^10: 2^10 is still safe",
        hint="everything below 65520 rounds down to 65504; 65520 (a tie, which goes to the "
        "even side, inf) and above round to inf",
    )
    def _():
        compare(np.array([1e-3, 65519.0 / 2**10], np.float32))
        compare(np.array([1e-3, -65520.0 / 2**10], np.float32))

    @report.case("random gradients, some zero (zeros ignored)",
                 hint="leave the zeros out before taking the smallest |g| (log2(0) is -inf); "
                 "powers of two: 2.0 ** k")
    def _():
        rng = np.random.default_rng(5)
        for _ in range(20):
            magnitudes = 2.0 ** rng.uniform(-30, 5, 100)
            gradients = (rng.standard_normal(100) * magnitudes).astype(np.float32)
            gradients[:5] = 0
            compare(gradients)

    return report.finish()


def _trajectory(scaler: Any, flags: list[bool]) -> list[float]:
    """loss_scale after each update(found_inf)."""
    scales = []
    for flag in flags:
        scaler.update(bool(flag))
        scales.append(float(scaler.loss_scale))
    return scales


def _compare_trajectories(make: Callable[[], Any], reference: DynamicLossScaler, flags: list,
                          label: str) -> None:
    got, want = _trajectory(make(), flags), _trajectory(reference, flags)
    for step, (a, b) in enumerate(zip(got, want)):
        kind = "overflow" if flags[step] else "clean"
        expect(a == b, f"{label}: after update {step + 1} ({kind})"
               f" the scale is {a:g}, expected {b:g} (updates so far: "
               f"{''.join('x' if f else '.' for f in flags[:step + 1])[-24:]})")


TRAJECTORY_HINT = (
    "update(found_inf): on an overflow multiply by backoff_factor and reset the count of clean "
    "steps to 0; otherwise add one to the count, and when it reaches growth_interval (the "
    "growth_interval-th clean step in a row, not the one after) multiply by growth_factor and "
    "reset the count to 0"
)


def check_dynamic_scaler(Scaler: Any, quiet: bool = False) -> Report:
    """Scaler(init_scale, growth_factor, backoff_factor, growth_interval): loss_scale, scale(loss),
    update(found_inf), with torch.amp.GradScaler's trajectory."""
    report = Report("DynamicLossScaler", quiet)

    @report.case("starts at init_scale; scale(loss) is loss * S",
                 hint="self.loss_scale = init_scale")
    def _():
        scaler = Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=3)
        expect(float(scaler.loss_scale) == 2.0**16, f"loss_scale starts at {scaler.loss_scale}")
        scaled = scaler.scale(Tensor(np.float32(1.5)))
        expect(float(scaled.item()) == 1.5 * 2**16, f"scale(1.5) gave {scaled.item()}")

    @report.case("grows after growth_interval clean steps, halves on an overflow",
                 hint=TRAJECTORY_HINT)
    def _():
        def make():
            return Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=3)

        flags = [False] * 7 + [True] + [False] * 4 + [True, True] + [False] * 3
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3)
        _compare_trajectories(make, reference, flags, "interval 3")

    @report.case(
        "an overflow restarts the count of clean steps",
        hint="after an overflow, growth needs growth_interval clean steps again, counted from 0 "
        "(restart the count on every overflow)",
    )
    def _():
        def make():
            return Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=4)

        flags = [False, False, False, True, False, False, False, False, False]
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=4)
        _compare_trajectories(make, reference, flags, "interval 4")

    @report.case("300 random updates, other factors", hint=TRAJECTORY_HINT)
    def _():
        flags = list(np.random.default_rng(6).random(300) < 0.15)
        for growth, backoff, interval in ((2.0, 0.5, 5), (4.0, 0.25, 6)):
            def make():
                return Scaler(init_scale=2.0**20, growth_factor=growth, backoff_factor=backoff,
                              growth_interval=interval)

            reference = DynamicLossScaler(2.0**20, growth, backoff, growth_interval=interval,
                                          min_scale=2.0**-100)
            label = f"x{growth:g} / x{backoff:g} / {interval}"
            _compare_trajectories(make, reference, flags, label)

    return report.finish()


def check_hysteresis(Scaler: Any, quiet: bool = False) -> Report:
    """The same Scaler with `hysteresis=h`: h overflows are tolerated before the scale backs off
    (Megatron-LM); the allowance refills when the scale grows."""
    report = Report("DynamicLossScaler with hysteresis", quiet)

    def make(h, interval=3):
        return lambda: Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=interval, hysteresis=h)

    @report.case("hysteresis=1 is the plain scaler", hint="one overflow is enough to back off")
    def _():
        flags = [False] * 4 + [True, False, True, True] + [False] * 4
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=1)
        _compare_trajectories(make(1), reference, flags, "hysteresis 1")

    @report.case(
        "hysteresis=2: the first overflow only uses up the allowance",
        hint="keep a counter of overflows still tolerated; back off when it reaches 0; every "
        "overflow, tolerated or not, restarts the count of clean steps",
    )
    def _():
        flags = [True, False, True, True, False, False, False, False, True, False, False, True,
                 True]
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=2)
        _compare_trajectories(make(2), reference, flags, "hysteresis 2")

    @report.case(
        "the allowance refills only when the scale grows, not after each clean step",
        hint="reset the counter to hysteresis where the scale is multiplied by growth_factor",
    )
    def _():
        flags = [True, False, False, True, False, False, False, True, True, False, False, False]
        flags.append(True)
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=2)
        _compare_trajectories(make(2), reference, flags, "hysteresis 2")

    @report.case(
        "once the allowance is used up, every further overflow backs off",
        hint="do not refill the allowance when the scale backs off: only growth refills it",
    )
    def _():
        flags = [True, True, True, True, False, False, True]
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=2)
        _compare_trajectories(make(2), reference, flags, "hysteresis 2")

    @report.case("300 random updates, hysteresis 3", hint="see the hints above")
    def _():
        flags = list(np.random.default_rng(7).random(300) < 0.3)
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=3,
                                      min_scale=2.0**-100)
        _compare_trajectories(make(3), reference, flags, "hysteresis 3")

    return report.finish()


EXERCISES = [
    ("scale_window", check_scale_window),
    ("DynamicLossScaler", check_dynamic_scaler),
    ("DynamicLossScaler", check_hysteresis),
]
