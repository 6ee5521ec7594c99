"""Optimizers that always update float32 master weights and round them into the compute copies.

Why masters: float16 numbers near 1.0 are 2^-10 apart above it and 2^-11 below, so an update of
2^-12 rounds away in either direction and the weight never moves (tests/test_casting.py shows it).
The optimizer therefore keeps a float32 copy of every weight, applies updates there, and writes the
rounded result into the float16 parameter the model computes with. For a float32 model the master
*is* the parameter's array.

Build the optimizer before casting the model (`model.to(float16)`), so the masters keep
the exact float32 initial values.
"""

from typing import Any, Iterable

from minimp import backend
from minimp.backend import array_module
from minimp.precision import casting
from minimp.precision.casting import MASTER_DTYPE
from minimp.precision.fused_update import fused_step


class Optimizer:
    """Float32 masters and gradient accumulators, and the update; subclasses supply `_update`.

    Its part of the mixed-precision step (minimp/precision/step.py, which shows the whole):
    `accumulate_gradients()` after each backward, `step()` to update, `zero_grad()` to forget.
    """

    slot_names: tuple[str, ...] = ()
    # On CuPy arrays: unscale, update and rounding in one kernel per parameter (PyTorch's
    # fused=True; minimp/precision/fused_update.py). Off until a GPU run has shown its bits equal
    # the unfused path's (scripts/gpu_check.sh runs that test; no GPU has run it yet).
    fused: bool = False

    def __init__(self, params: Iterable[Any], lr: float, weight_decay: float = 0.0):
        """params: Parameters, or groups as in PyTorch, dicts {"params": [...], "weight_decay":
        x} whose settings override the optimizer's for their parameters (nanoGPT decays only the
        2-D weights this way)."""
        if lr <= 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        self.params, self.weight_decays = _parameter_groups(params, weight_decay)
        for index, parameter in enumerate(self.params):
            if casting.is_low_precision(parameter.dtype):
                raise ValueError(
                    f"optimizer: parameter {index} is already {parameter.dtype}; build the "
                    "optimizer before model.to(...), so the float32 masters start from the exact "
                    "float32 weights instead of their 16-bit rounding"
                )
        self.lr = lr
        # A float32 parameter is its own master (the same array); others get a float32 copy.
        self.master_weights = [casting.round_to(p.data, MASTER_DTYPE) for p in self.params]
        # This step's float32 sums of each parameter's gradients over micro-batches (None: nothing
        # arrived yet). They live in one buffer per parameter, kept between steps (as DDP keeps
        # its gradient buckets; ZeRO's memory account, minimp/measure/accounts.py, counts
        # them as held): a step's first gradient is copied into it, or, when nothing else holds
        # that gradient, becomes it (no copy; the one it replaces is released, to the memory pool
        # when it came from there).
        self.master_gradients: list[Any] = [None] * len(self.params)
        self.accumulators: list[Any] = [None] * len(self.params)
        self.slots: list[dict[str, Any]] = [dict.fromkeys(self.slot_names) for _ in self.params]
        self.step_count = 0

    def zero_grad(self) -> None:
        """Forget the gradients: the parameters' and this step's float32 sums (buffers stay)."""
        for parameter in self.params:
            parameter.grad = None
        self.master_gradients = [None] * len(self.params)

    def accumulate_gradients(self) -> list[Any]:
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
        if self.master_gradients[index] is not None:
            self.master_gradients[index] += incoming[0]
        elif self._can_adopt(index, incoming):
            # The step's first gradient, held by nothing else: it becomes the accumulator instead
            # of being copied into it (PyTorch's AccumulateGrad steals such a gradient too).
            self.accumulators[index] = self.master_gradients[index] = incoming.pop()
        else:
            self.master_gradients[index] = self._accumulator(index)
            self.master_gradients[index][...] = incoming[0]

    def _can_adopt(self, index: int, incoming: list) -> bool:
        """Whether incoming[0] may become parameter index's accumulator: nothing else refers to
        it (the step changes the accumulator in place: unscale, clip, weight decay) nor to the
        accumulator it replaces, and it is a float32 array of the master's shape, type and
        layout that owns its memory (ZeRO writes accumulators through reshape(-1) views)."""
        replaced_is_free = self.accumulators[index] is None or backend.sole_holder(
            self.accumulators, index
        )
        if not (replaced_is_free and backend.sole_holder(incoming, 0)):
            return False
        array, master = incoming[0], self.master_weights[index]
        return (
            type(array) is type(master)
            and array.dtype == MASTER_DTYPE
            and array.shape == master.shape
            and array.base is None
            and array.flags.c_contiguous
        )

    def _accumulator(self, index: int) -> Any:
        """Parameter index's float32 gradient buffer, allocated once and kept."""
        if self.accumulators[index] is None:
            master = self.master_weights[index]
            self.accumulators[index] = array_module(master).empty_like(master)
        return self.accumulators[index]

    def step(self, grad_scale: float = 1.0) -> None:
        """Update every master with its accumulated float32 gradient times grad_scale (1: as it
        is, unscaled and clipped already; 1 / S: the unscale, done here), then round the masters
        into the parameters. Parameters without a gradient are left alone; the accumulated
        gradients are consumed."""
        pending = sum(parameter.grad is not None for parameter in self.params)
        if pending:
            raise RuntimeError(
                f"optimizer.step(): {pending} parameter(s) hold gradients that were not "
                "accumulated; call optimizer.accumulate_gradients() first, or let "
                "minimp.mixed_precision_step(optimizer, scaler) run the whole step"
            )
        self.step_count += 1
        for index, grad in enumerate(self.master_gradients):
            if grad is None:
                continue
            if self.fused and fused_step(self, index, grad, grad_scale):
                continue  # one GPU kernel: unscale, update, round into the compute copy
            if grad_scale != 1.0:  # as unscale_ in minimp/precision/step.py
                grad *= grad_scale
            weight_decay = self.weight_decays[index]
            self.update(self.master_weights[index], grad, self.slots[index], weight_decay)
            self._write_back(index)
        self.master_gradients = [None] * len(self.params)

    def update(self, master: Any, grad: Any, slots: dict[str, Any], weight_decay: float) -> None:
        """The update rule on float32 arrays, in place: a whole parameter's master here, a piece
        of a shard in ZeRO (minimp/parallel/zero/optimizer.py). Every rule is elementwise, so
        updating a piece gives the same bits as updating the whole and taking the piece."""
        self._update(master, grad, slots, weight_decay)

    def set_master_weight(self, index: int, array: Any) -> None:
        """Overwrite master `index` with array (float32) and round it into its parameter."""
        master = self.master_weights[index]
        if array is not master:
            master[...] = array
        self._write_back(index)

    def _write_back(self, index: int) -> None:
        """The compute copy = the master rounded once into the parameter's dtype."""
        parameter, master = self.params[index], self.master_weights[index]
        if parameter.data is not master:
            parameter.data[...] = casting.round_to(master, parameter.dtype)

    def _update(self, master: Any, grad: Any, slots: dict[str, Any], weight_decay: float) -> None:
        raise NotImplementedError

    def _slot(self, slots: dict[str, Any], name: str, like: Any) -> Any:
        if slots[name] is None:
            slots[name] = like * 0
        return slots[name]

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


def _parameter_groups(params: Iterable[Any], weight_decay: float) -> tuple[list, list[float]]:
    """(every parameter, its weight decay) from Parameters and {"params": ...} groups."""
    parameters, decays = [], []
    for item in params:
        if isinstance(item, dict):
            unknown = set(item) - {"params", "weight_decay"}
            if unknown:
                raise ValueError(f"optimizer: unknown parameter group settings {sorted(unknown)}")
            group = list(item["params"])
            parameters += group
            decays += [float(item.get("weight_decay", weight_decay))] * len(group)
        else:
            parameters.append(item)
            decays.append(float(weight_decay))
    return parameters, decays



class SGD(Optimizer):
    """w -= lr * v,  v = momentum * v + (g + weight_decay * w)   (PyTorch's SGD, no dampening)."""

    slot_names = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, lr, weight_decay)
        self.momentum = momentum

    def _update(self, master, grad, slots, weight_decay):
        if weight_decay:
            grad += weight_decay * master
        if self.momentum:
            buffer = slots["momentum_buffer"]
            if buffer is None:
                buffer = slots["momentum_buffer"] = grad.copy()
            else:
                buffer *= self.momentum
                buffer += grad
            grad = buffer
        master -= self.lr * grad


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015) on the masters.
    `decoupled_weight_decay=True` gives AdamW (Loshchilov & Hutter 2019): the decay shrinks the
    weight directly instead of joining the gradient."""

    slot_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
    ):
        super().__init__(params, lr, weight_decay)
        self.betas, self.eps = betas, eps
        self.decoupled_weight_decay = decoupled_weight_decay

    def _update(self, master, grad, slots, weight_decay):
        beta1, beta2 = self.betas
        if weight_decay and self.decoupled_weight_decay:
            master *= 1.0 - self.lr * weight_decay
        elif weight_decay:
            grad += weight_decay * master
        exp_avg = self._slot(slots, "exp_avg", master)
        exp_avg_sq = self._slot(slots, "exp_avg_sq", master)
        exp_avg *= beta1
        exp_avg += (1.0 - beta1) * grad
        exp_avg_sq *= beta2
        exp_avg_sq += (1.0 - beta2) * grad * grad
        correction1 = 1.0 - beta1**self.step_count
        correction2 = 1.0 - beta2**self.step_count
        denominator = (exp_avg_sq / correction2) ** 0.5 + self.eps
        master -= (self.lr / correction1) * exp_avg / denominator


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01, as in PyTorch)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True)
