"""Optimizers that update float32 master weights and round them into the compute copies.

Why masters: float16 numbers near 1.0 are 2^-10 apart above it and 2^-11 below, so an update of
2^-12 rounds away in either direction and the weight never moves (tests/test_casting.py shows it).
The optimizer therefore keeps a float32 copy of every weight, applies updates there, and writes the
rounded result into the float16 parameter the model computes with. For a float32 model the master
*is* the parameter's array.

Build the optimizer before casting the model (`model.to(float16)`), so the masters keep
the exact float32 initial values.

Without masters (`master_weights=False`, llm.c's bf16 training): the weights live in their 16-bit
dtype only. Each step widens a weight to float32 (exactly), updates it there with the float32
gradient, and writes it back with a `rounding` (precision/stochastic.py: to nearest, or stochastic,
whose expected value is the float32 result); the optimizer state (Adam's m and v, SGD's momentum)
stays float32, as llm.c keeps it: v's update (1 - beta2) (g^2 - v) is a relative 1e-3 of v when
g^2 = 2 v (beta2 = 0.999), below half a bfloat16 ulp (2^-9 to 2^-8), and would round away as the
weights' do (docs/low-precision.md).
"""

import math
from numbers import Real
from typing import Any, Callable, Iterable

from minimp import backend
from minimp.backend import Array, array_module
from minimp.precision import casting
from minimp.precision.casting import MASTER_DTYPE
from minimp.precision.step import MixedPrecisionOptimizer
from minimp.precision.stochastic import WeightRounding, to_nearest
from minimp.tensor import Tensor

# What an optimizer is built from: Parameters, or groups of them (dicts, see Optimizer.__init__).
ParamsT = Iterable[Tensor | dict[str, Any]]  # PyTorch's name
# One master's optimizer state by slot name ("exp_avg", ...): None until its update rule makes it.
Slots = dict[str, Array | None]


class Optimizer(MixedPrecisionOptimizer):
    """Float32 masters and gradient accumulators; subclasses supply the update rule (`update`).

    Its part of the mixed-precision step (minimp/precision/step.py, which shows the whole):
    `accumulate_gradients()` after each backward, `step()` to update, `zero_grad()` to forget.
    """

    slot_names: tuple[str, ...] = ()

    def __init__(self, params: ParamsT, lr: float, weight_decay: float = 0.0, *,
                 master_weights: bool = True, rounding: WeightRounding = to_nearest):
        """params: Parameters, or groups as in PyTorch, dicts {"params": [...], "weight_decay":
        x} whose settings override the optimizer's for their parameters (nanoGPT decays only the
        2-D weights this way). lr: the learning rate, positive (`step()` reads `self.lr`, so a
        schedule may change it between steps). weight_decay: the update rule's decay coefficient
        for every parameter outside a group that sets its own (0 = none).
        master_weights: keep float32 masters (True), or update the weights in their own dtype
        (False; the module's docstring), writing each result back with `rounding`.

        Every setting is checked here, as PyTorch's optimizers check theirs: a NaN, an infinite
        or a negative one is a ValueError naming it, a value that is not a number a TypeError,
        instead of NaN weights or an exception at the first step. `self.lr` itself is a plain
        attribute, not checked again when a schedule assigns it (as PyTorch's param_group["lr"]):
        the trainer's schedules compute it from checked settings, and may reach 0."""
        lr = _setting("learning rate", "lr", lr, POSITIVE)
        weight_decay = _setting("weight_decay value", "weight_decay", weight_decay, NON_NEGATIVE)
        self.params, self.weight_decays = _parameter_groups(params, weight_decay)
        _check_parameters(self.params)
        self.lr = lr
        self.keeps_masters, self.rounding = master_weights, rounding
        if master_weights and rounding is not to_nearest:
            raise ValueError("optimizer: a rounding other than to_nearest needs "
                             "master_weights=False (the masters are float32: nothing to round)")
        # A float32 parameter is its own master (the same array); others get a float32 copy.
        self._masters: list[Array | None] | None = None
        if master_weights:
            self._masters = [casting.round_to(p.data, MASTER_DTYPE) for p in self.params]
        # This step's float32 sums of each parameter's gradients over micro-batches (None: nothing
        # arrived yet). They live in one buffer per parameter, kept between steps (as DDP keeps
        # its gradient buckets; ZeRO's memory account, minimp/measure/accounts.py, counts
        # them as held): a step's first gradient is copied into it, or, when nothing else holds
        # that gradient, becomes it (no copy; the one it replaces is released, to the memory pool
        # when it came from there).
        self.master_gradients: list[Array | None] = [None] * len(self.params)
        self.accumulators: list[Array | None] = [None] * len(self.params)
        self.slots: list[Slots] = [dict.fromkeys(self.slot_names) for _ in self.params]
        self.step_count = 0

    @property
    def master_weights(self) -> list:
        """The arrays the update rule acts on: the float32 masters, or without them the parameters'
        own arrays (whatever their dtype; `model.to` replaces them, so they are looked up)."""
        if self._masters is None:
            return [parameter.data for parameter in self.params]
        return self._masters

    @master_weights.setter
    def master_weights(self, arrays: list) -> None:
        if self._masters is None:  # ZeRO shards masters: an optimizer without them has none
            raise ValueError("optimizer: no float32 masters to replace (master_weights=False)")
        self._masters = arrays

    def zero_grad(self) -> None:
        """Forget the gradients: the parameters' and this step's float32 sums (buffers stay)."""
        for parameter in self.params:
            parameter.grad = None
        self.master_gradients = [None] * len(self.params)

    def accumulate_gradients(self) -> list[Array | None]:
        """Move each parameter's gradient into its float32 accumulator and clear it; returns the
        accumulators (None where no gradient arrived).

        Called after every micro-batch's backward: summing micro-batch gradients in
        float16 would lose the small ones; summing them in float32 gives the big
        batch's gradient to float32 rounding.
        """
        for index in range(len(self.params)):
            self.accumulate_gradient(index)
        return self.master_gradients

    def accumulate_gradient(self, index: int) -> None:
        """accumulate_gradients for parameter `index` alone (data parallelism with overlap calls
        it from backward, the moment the parameter's last micro-batch gradient is complete)."""
        parameter = self.params[index]
        if parameter.grad is None:
            return
        # In a list, so that backend.sole_holder can tell whether anything else holds it.
        incoming = [casting.round_to(parameter.grad, MASTER_DTYPE)]  # 16-bit: widened, exactly
        parameter.grad = None
        summed = self.master_gradients[index]
        if summed is not None:
            summed += incoming[0]
        elif self._can_adopt(index, incoming):
            # The step's first gradient, held by nothing else: it becomes the accumulator instead
            # of being copied into it (PyTorch's AccumulateGrad steals such a gradient too).
            self.accumulators[index] = self.master_gradients[index] = incoming.pop()
        else:
            accumulator = self.master_gradients[index] = self._accumulator(index)
            accumulator[...] = incoming[0]

    def _can_adopt(self, index: int, incoming: list[Array]) -> bool:
        """Whether incoming[0] may become parameter index's accumulator: nothing else refers to
        it (the step changes the accumulator in place: unscale, clip, weight decay) nor to the
        accumulator it replaces, and it is a float32 array of the master's shape, type and
        layout that owns its memory (ZeRO writes accumulators through reshape(-1) views)."""
        replaced_is_free = (self.accumulators[index] is None
                            or backend.sole_holder(self.accumulators, index))
        if not (replaced_is_free and backend.sole_holder(incoming, 0)):
            return False
        array, master = incoming[0], self.master_weights[index]
        return (type(array) is type(master) and array.dtype == MASTER_DTYPE
                and array.shape == master.shape and array.base is None and array.flags.c_contiguous)

    def _accumulator(self, index: int) -> Array:
        """Parameter index's float32 gradient buffer, allocated once and kept."""
        accumulator = self.accumulators[index]
        if accumulator is None:
            master = self.master_weights[index]  # without masters: a 16-bit parameter
            accumulator = array_module(master).empty_like(master, dtype=MASTER_DTYPE)
            self.accumulators[index] = accumulator
        return accumulator

    def step(self) -> None:
        """Update every master with its accumulated float32 gradient, as it is (unscaled and
        clipped already), then round the masters into the parameters (without masters: update
        each weight as _update_without_master says). Parameters without a gradient are left
        alone; the accumulated gradients are consumed."""
        pending = sum(parameter.grad is not None for parameter in self.params)
        if pending:
            raise RuntimeError(
                f"optimizer.step(): {pending} parameter(s) hold gradients that were not "
                "accumulated; call optimizer.accumulate_gradients() first, or let "
                "minimp.mixed_precision_step(optimizer, scaler) run the whole step")
        self.step_count += 1
        for index, grad in enumerate(self.master_gradients):
            if grad is None:
                continue
            if self._masters is None:
                self._update_without_master(index, grad)
                continue
            weight_decay = self.weight_decays[index]
            self.update(self._masters[index], grad, self.slots[index], weight_decay)
            self._write_back(index)
        self.master_gradients = [None] * len(self.params)

    def _update_without_master(self, index: int, grad: Array) -> None:
        """The update rule on a float32 copy of the weight (exact: every 16-bit value is a float32
        value; a float32 weight is updated in place), then the result written back with
        `rounding`. The copy is freed at once: it is not held between steps."""
        parameter = self.params[index]
        weight = casting.round_to(parameter.data, MASTER_DTYPE)
        # A replica fills a gradient no loss reached with zeros shaped like the "master" (here the
        # 16-bit weight: parallel/data/data_parallel.py); the rule must still add in float32.
        grad = casting.round_to(grad, MASTER_DTYPE)
        self.update(weight, grad, self.slots[index], self.weight_decays[index])
        if weight is not parameter.data:
            parameter.data[...] = self.rounding(weight, parameter.dtype, self.step_count, index)

    def update(self, master: Array, grad: Array, slots: Slots, weight_decay: float) -> None:
        """The update rule on float32 arrays, in place: a whole parameter's master here, a piece
        of a shard in ZeRO (minimp/parallel/zero/optimizer.py). Every rule is elementwise, so
        updating a piece gives the same bits as updating the whole and taking the piece. `slots`
        holds the master's optimizer state by name (None before the first step); the rule keeps
        what it makes there. Subclasses call their rule's function (`sgd`, `adam` below)."""
        raise NotImplementedError

    def set_master_weight(self, index: int, array: Array) -> None:
        """Overwrite master `index` with array (float32) and round it into its parameter (without
        masters: round it to nearest into the parameter)."""
        master = self.master_weights[index]
        if array is not master:
            master[...] = array
        self._write_back(index)

    def _write_back(self, index: int) -> None:
        """The compute copy = the master rounded once into the parameter's dtype."""
        parameter, master = self.params[index], self.master_weights[index]
        if parameter.data is not master:
            parameter.data[...] = casting.round_to(master, parameter.dtype)

    def state_dict(self) -> dict:
        """step_count, lr and every slot array, by parameter index (float32 arrays)."""
        return {
            "step_count": self.step_count,
            "lr": self.lr,
            "slots": [{k: v for k, v in slot.items() if v is not None} for slot in self.slots],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore step_count, lr and the slots from what state_dict returned (copied)."""
        self.step_count, self.lr = int(state["step_count"]), float(state["lr"])
        for slots, saved in zip(self.slots, state["slots"]):
            for name in self.slot_names:
                # astype copies: the loaded state must not alias the caller's arrays
                slots[name] = saved[name].astype(MASTER_DTYPE) if name in saved else None


# The rules an optimizer's settings follow: (what a value must be, the test it passes). NaN fails
# every comparison, so each test refuses it too.
Rule = tuple[str, Callable[[float], bool]]
POSITIVE: Rule = ("a positive finite number", lambda x: 0.0 < x < math.inf)
NON_NEGATIVE: Rule = ("a finite number >= 0", lambda x: 0.0 <= x < math.inf)
# A decay rate of 1 never forgets (Adam's bias correction 1 - beta^t is then 0: a division by 0);
# above 1 the running means grow without bound.
DECAY_RATE: Rule = ("in [0, 1)", lambda x: 0.0 <= x < 1.0)


def _setting(what: str, name: str, value: Any, rule: Rule) -> float:
    """value as a float, or the error PyTorch gives (\"Invalid learning rate: ...\") naming the
    argument, the value and the rule: TypeError for what is not a real number (bools and strings
    included), ValueError for a number that breaks the rule. Any: whatever a caller passed."""
    must, holds = rule
    if isinstance(value, bool) or not isinstance(value, Real):  # NumPy's numbers are Real
        raise TypeError(f"Invalid {what}: {name}={value!r} is a {type(value).__name__}; "
                        f"it must be {must}")
    if not holds(float(value)):
        raise ValueError(f"Invalid {what}: {name}={value}; it must be {must}")
    return float(value)


def _check_parameters(params: list) -> None:
    """Refuse what an optimizer cannot update: a parameter listed twice (its update would be
    applied twice per step, through two masters that disagree), anything but a floating-point
    Tensor (an integer tensor's update would round to nothing), and a 16-bit parameter (its
    master would start from the rounded weights). No parameters at all is allowed, unlike in
    PyTorch: a pipeline stage may hold none, and its optimizer then steps nothing."""
    first_index: dict[int, int] = {}
    for index, parameter in enumerate(params):
        if not isinstance(parameter, Tensor):
            raise TypeError(f"optimizer: parameter {index} is a {type(parameter).__name__}, not a "
                            "Tensor; pass Parameters (model.parameters())")
        if not casting.is_floating(parameter.dtype):
            raise TypeError(f"optimizer: parameter {index} has dtype {parameter.dtype}; only "
                            "floating-point tensors can be optimized (as in PyTorch)")
        if casting.is_low_precision(parameter.dtype):
            raise ValueError(
                f"optimizer: parameter {index} is already {parameter.dtype}; build the "
                "optimizer before model.to(...), so the float32 masters start from the exact "
                "float32 weights instead of their 16-bit rounding")
        first = first_index.setdefault(id(parameter), index)
        if first != index:
            raise ValueError(f"optimizer: parameter {index} is parameter {first} again; pass "
                             "each parameter once (in one group)")


def _parameter_groups(params: ParamsT, weight_decay: float) -> tuple[list, list[float]]:
    """(every parameter, its weight decay) from Parameters and {"params": ...} groups."""
    # `list`, not list[Tensor]: mypy cannot type the lambdas with a default argument that
    # minimp/lessons/overlap_timeline.py registers as hooks on these parameters.
    parameters, decays = [], []
    for item in params:
        # A lone Parameter is a group of one, with the optimizer's weight decay.
        group: dict[str, Any] = item if isinstance(item, dict) else {"params": [item]}
        unknown = set(group) - {"params", "weight_decay"}
        if unknown:
            raise ValueError(f"optimizer: unknown parameter group settings {sorted(unknown)}")
        members = list(group["params"])
        parameters += members
        decay = _setting("weight_decay value", "weight_decay",
                         group.get("weight_decay", weight_decay), NON_NEGATIVE)
        decays += [decay] * len(members)
    return parameters, decays


def sgd(master: Array, grad: Array, momentum_buffer: Array | None, *, lr: float, momentum: float,
        weight_decay: float) -> Array | None:
    """SGD's update rule (PyTorch's, without dampening or Nesterov) on float32 arrays, in place:

        g <- g + weight_decay * w
        b <- momentum * b + g         (b <- g on the first step: b is the momentum buffer)
        w <- w - lr * b               (w <- w - lr * g without momentum)

    Each arithmetic operation rounds once in float32, in this order; `grad` is changed too (the
    weight decay is added into it). Returns the momentum buffer for the caller to keep: a copy of
    the gradient when momentum_buffer is None, momentum_buffer itself otherwise.
    """
    if weight_decay:
        grad += weight_decay * master
    if momentum:
        if momentum_buffer is None:
            momentum_buffer = grad.copy()
        else:
            momentum_buffer *= momentum
            momentum_buffer += grad
        grad = momentum_buffer
    master -= lr * grad
    return momentum_buffer


class SGD(Optimizer):
    """SGD with momentum and weight decay on the masters (the rule: `sgd`).

    params: Parameters or groups (see Optimizer); lr: the learning rate, positive (default 0.01);
    momentum: the factor in [0, 1) the momentum buffer is multiplied by each step before the
    gradient is added (0 = plain SGD); weight_decay: L2, added to the gradient as
    weight_decay * w (0 = none); master_weights, rounding: as in Optimizer.
    """

    slot_names = ("momentum_buffer",)

    def __init__(self, params: ParamsT, lr: float = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, master_weights: bool = True,
                 rounding: WeightRounding = to_nearest):
        # [0, 1) as Adam's betas: a factor of 1 or more makes the buffer grow without bound
        self.momentum = _setting("momentum value", "momentum", momentum, DECAY_RATE)
        super().__init__(params, lr, weight_decay, master_weights=master_weights,
                         rounding=rounding)

    def update(self, master: Array, grad: Array, slots: Slots, weight_decay: float) -> None:
        slots["momentum_buffer"] = sgd(master, grad, slots["momentum_buffer"], lr=self.lr,
                                       momentum=self.momentum, weight_decay=weight_decay)


def adam(master: Array, grad: Array, exp_avg: Array | None, exp_avg_sq: Array | None, *, step: int,
         lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
         decoupled_weight_decay: bool) -> tuple[Array, Array]:
    """Adam's update rule (Kingma & Ba 2015) on float32 arrays, in place, at step number `step`
    (1 for the first); with decoupled_weight_decay, AdamW's (Loshchilov & Hutter 2019), whose
    decay shrinks the weight directly instead of joining the gradient:

        w <- w * (1 - lr * weight_decay)     AdamW
        g <- g + weight_decay * w            Adam
        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g * g
        w <- w - lr / (1 - beta1^step) * m / ((v / (1 - beta2^step)) ** 0.5 + eps)

    Each arithmetic operation on an array rounds once in float32, in this order, left to right
    (the scalars, such as lr / (1 - beta1^step), are computed in Python floats first); `grad` is
    changed too. m and v start as `w * 0`, made here when they are None. Returns (m, v) for the
    caller to keep.
    """
    beta1, beta2 = betas
    if weight_decay and decoupled_weight_decay:
        master *= 1.0 - lr * weight_decay
    elif weight_decay:
        grad += weight_decay * master
    exp_avg = master * 0 if exp_avg is None else exp_avg
    exp_avg_sq = master * 0 if exp_avg_sq is None else exp_avg_sq
    exp_avg *= beta1
    exp_avg += (1.0 - beta1) * grad
    exp_avg_sq *= beta2
    exp_avg_sq += (1.0 - beta2) * grad * grad
    correction1 = 1.0 - beta1**step
    correction2 = 1.0 - beta2**step
    denominator = (exp_avg_sq / correction2) ** 0.5 + eps
    master -= (lr / correction1) * exp_avg / denominator
    return exp_avg, exp_avg_sq


class Adam(Optimizer):
    """Adam on the masters (the rule: `adam`); `decoupled_weight_decay=True` gives AdamW.

    params: Parameters or groups (see Optimizer); lr: the learning rate, positive (default 1e-3);
    betas: (beta1, beta2), the decay rates, each in [0, 1), of the running means of the gradient
    and of its square; eps: added to the square root of the second moment (positive, default
    1e-8), so that a tiny second moment cannot blow the step up; weight_decay: L2, added to the
    gradient as weight_decay * w (0 = none), or with decoupled_weight_decay, AdamW's shrink of
    the weight by lr * weight_decay each step; master_weights, rounding: as in Optimizer.
    """

    slot_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False, *, master_weights: bool = True,
                 rounding: WeightRounding = to_nearest):
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"Invalid betas: {betas!r}; betas must be a pair (beta1, beta2), "
                            "each in [0, 1), e.g. (0.9, 0.999)")
        self.betas = (_setting("beta parameter at index 0", "betas[0]", betas[0], DECAY_RATE),
                      _setting("beta parameter at index 1", "betas[1]", betas[1], DECAY_RATE))
        # eps > 0: with 0, a parameter whose gradients were all 0 would update by 0 / 0 = NaN
        self.eps = _setting("epsilon value", "eps", eps, POSITIVE)
        super().__init__(params, lr, weight_decay, master_weights=master_weights,
                         rounding=rounding)
        self.decoupled_weight_decay = decoupled_weight_decay

    def update(self, master: Array, grad: Array, slots: Slots, weight_decay: float) -> None:
        slots["exp_avg"], slots["exp_avg_sq"] = adam(
            master, grad, slots["exp_avg"], slots["exp_avg_sq"], step=self.step_count, lr=self.lr,
            betas=self.betas, eps=self.eps, weight_decay=weight_decay,
            decoupled_weight_decay=self.decoupled_weight_decay)


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01, as in PyTorch).

    params, lr, betas, eps: as in Adam; weight_decay: each step shrinks the weight by
    lr * weight_decay (Loshchilov & Hutter 2019) instead of adding to the gradient;
    master_weights, rounding: as in Optimizer.
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, *, master_weights: bool = True,
                 rounding: WeightRounding = to_nearest):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True,
                         master_weights=master_weights, rounding=rounding)
