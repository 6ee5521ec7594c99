"""Optimizers that always update float32 master weights and round them into the model's compute
copies.

Why masters: float16 numbers near 1.0 are 2^-10 apart above it and 2^-11 below, so an update of
2^-12 rounds away in either direction and the weight never moves (tests/test_casting.py shows it).
The optimizer therefore keeps a float32 copy of every weight, applies updates there, and writes the
rounded result into the float16 parameter the model computes with. For a float32 model the master
*is* the parameter's array.

Build the optimizer before casting the model (`model.to(float16)`), so the masters keep the exact
float32 initial values.
"""

from minimp.precision.casting import MASTER_DTYPE, round_to


class Optimizer:
    """Masters, float32 gradient accumulators, and the write-back; subclasses supply `_update`."""

    slot_names = ()

    def __init__(self, params, lr):
        if lr <= 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        self.params = list(params)
        self.lr = lr
        self.master_weights = [
            p.data if p.dtype == MASTER_DTYPE else p.data.astype(MASTER_DTYPE) for p in self.params
        ]
        # float32 sums of each parameter's gradients over micro-batches (None: nothing accumulated).
        self.master_gradients = [None] * len(self.params)
        self.slots = [{name: None for name in self.slot_names} for _ in self.params]
        self.step_count = 0

    def zero_grad(self):
        """Forget the gradients: the parameters' and the float32 accumulators."""
        for parameter in self.params:
            parameter.grad = None
        self.master_gradients = [None] * len(self.params)

    def accumulate_gradients(self):
        """Move each parameter's gradient into its float32 accumulator and clear it.

        Called after every micro-batch's backward: summing micro-batch gradients in float16 would
        lose the small ones; summing them in float32 gives the big batch's gradient to float32
        rounding.
        """
        taken = set()
        for index, parameter in enumerate(self.params):
            if parameter.grad is None:
                continue
            grad = parameter.grad
            if grad.dtype != MASTER_DTYPE or not _owned(grad) or id(grad) in taken:
                grad = grad.astype(MASTER_DTYPE, copy=True)  # ours to scale in place
            taken.add(id(grad))
            if self.master_gradients[index] is None:
                self.master_gradients[index] = grad
            else:
                self.master_gradients[index] += grad
            parameter.grad = None

    def step(self, grad_scale=1.0):
        """Update every master with its accumulated gradient divided by grad_scale, then round the
        masters into the parameters. Parameters with no gradient are left alone. The accumulated
        gradients are consumed (a second step without a new backward changes nothing)."""
        self.accumulate_gradients()
        self.step_count += 1
        inverse_scale = 1.0 / grad_scale
        for index, grad in enumerate(self.master_gradients):
            if grad is None:
                continue
            if inverse_scale != 1.0:
                grad *= inverse_scale  # in float32: unscaling after the fp16 backward is the point
            self._update(self.master_weights[index], grad, self.slots[index])
            self._write_back(index)
        self.master_gradients = [None] * len(self.params)

    def _write_back(self, index):
        parameter, master = self.params[index], self.master_weights[index]
        if parameter.data is not master:
            parameter.data[...] = round_to(master, parameter.dtype)

    def _update(self, master, grad, slots):
        raise NotImplementedError

    def _slot(self, slots, name, like):
        if slots[name] is None:
            slots[name] = like * 0
        return slots[name]

    def state_dict(self):
        """step_count, lr and every slot array, by parameter index (float32 arrays)."""
        return {
            "step_count": self.step_count,
            "lr": self.lr,
            "slots": [{k: v for k, v in slot.items() if v is not None} for slot in self.slots],
        }

    def load_state_dict(self, state):
        self.step_count, self.lr = int(state["step_count"]), float(state["lr"])
        for slots, saved in zip(self.slots, state["slots"]):
            for name in self.slot_names:
                slots[name] = saved[name].astype(MASTER_DTYPE) if name in saved else None

    def load_master_weights(self, arrays):
        """Set the masters (float32) and round them into the parameters."""
        for index, array in enumerate(arrays):
            self.load_master_weights_at(index, array)

    def load_master_weights_at(self, index, array):
        master = self.master_weights[index]
        if array is not master:
            master[...] = array
        self._write_back(index)


def _owned(array):
    """A float32 gradient may be adopted without a copy only when it is a writeable array that
    owns its memory (a broadcast or reshaped view of another gradient is not) and no other
    parameter got it."""
    return (
        getattr(array.flags, "writeable", True) and array.base is None
    )  # CuPy flags lack writeable


class SGD(Optimizer):
    """w -= lr * v,  v = momentum * v + (g + weight_decay * w)   (PyTorch's SGD without
    dampening)."""

    slot_names = ("momentum_buffer",)

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr)
        self.momentum, self.weight_decay = momentum, weight_decay

    def _update(self, master, grad, slots):
        if self.weight_decay:
            grad += self.weight_decay * master
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
    """Adam (Kingma & Ba 2015) on the masters. `decoupled_weight_decay=True` gives AdamW
    (Loshchilov & Hutter 2019): the decay shrinks the weight directly instead of joining the
    gradient."""

    slot_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        decoupled_weight_decay=False,
    ):
        super().__init__(params, lr)
        self.betas, self.eps = betas, eps
        self.weight_decay, self.decoupled_weight_decay = weight_decay, decoupled_weight_decay

    def _update(self, master, grad, slots):
        beta1, beta2 = self.betas
        if self.weight_decay and self.decoupled_weight_decay:
            master *= 1.0 - self.lr * self.weight_decay
        elif self.weight_decay:
            grad += self.weight_decay * master
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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True)
