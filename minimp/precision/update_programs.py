"""The optimizers' update arithmetic as data: one program, run by NumPy here and compiled for CuPy.

A program is a list of lines `name = a OP b` (OP one of * / + - **), each one float32 operation
rounded once, or `name = a` (a copy), in the order minimp/optim/optimizer.py performs them.
`run_on_numpy` executes the lines with NumPy ufuncs (the CPU tests check that this equals minimp's
own update bit for bit), and `cuda_source` renders the same lines as the body of a CuPy
ElementwiseKernel (minimp/precision/fused_update.py), so both devices compute one description.

Why intrinsics in the CUDA text: nvcc and NVRTC contract `a * b + c` into one fused multiply-add
(rounded once instead of twice) unless told not to. `__fmul_rn`, `__fadd_rn`, `__fsub_rn` and
`__fdiv_rn` are never contracted, so each line rounds exactly as the separate CuPy operations of
the unfused path do. `a ** 0.5` becomes `powf(a, 0.5f)`, the function CuPy's `**` calls; NumPy's
`** 0.5` is a correctly rounded square root, so the GPU is compared with the GPU, the CPU with the
CPU.

Scalars are float32, converted from the Python floats the optimizer computes (in float64, as in
optim.py), which is what NumPy and CuPy do with a Python float next to a float32 array.
"""

import re
from typing import Any, NamedTuple

import numpy as np

from minimp.precision import casting

_LINE = re.compile(r"^(\w+) = (\w+)(?: (\*\*|[*/+-]) (\w+|0\.5))?$")
_CUDA_OPS = {"*": "__fmul_rn", "/": "__fdiv_rn", "+": "__fadd_rn", "-": "__fsub_rn"}
_NUMPY_OPS = {"*": np.multiply, "/": np.divide, "+": np.add, "-": np.subtract}


class UpdateProgram(NamedTuple):
    """One update rule for one setting of the optimizer's switches (weight decay on or off, ...)."""

    lines: tuple[str, ...]  # `name = a OP b`, in order
    reads: tuple[str, ...]  # arrays only read: the gradient
    updates: tuple[str, ...]  # arrays read and written back: the master and the optimizer's slots
    scalars: dict[str, float]  # float32 constants of this step, by name


def _unscaled(grad_scale: float) -> list[str]:
    """The unscale (mixed_precision_step's unscale_), skipped at 1.0 as unscale_ skips it."""
    return ["grad = grad * grad_scale"] if grad_scale != 1.0 else []


def sgd_program(
    lr: float, momentum: float, weight_decay: float, first_step: bool, grad_scale: float = 1.0
) -> UpdateProgram:
    """SGD's update (optim.SGD._update): first_step means no momentum buffer exists yet."""
    lines = _unscaled(grad_scale)
    if weight_decay:
        lines += ["decay = weight_decay * master", "grad = grad + decay"]
    updates = ["master"]
    if momentum:
        updates.append("momentum_buffer")
        if first_step:  # the buffer starts as a copy of the gradient
            lines += ["momentum_buffer = grad"]
        else:
            lines += [
                "momentum_buffer = momentum_buffer * momentum",
                "momentum_buffer = momentum_buffer + grad",
            ]
        lines += ["change = lr * momentum_buffer"]
    else:
        lines += ["change = lr * grad"]
    lines += ["master = master - change"]
    scalars = dict(grad_scale=grad_scale, weight_decay=weight_decay, momentum=momentum, lr=lr)
    return UpdateProgram(tuple(lines), ("grad",), tuple(updates), scalars)


def adam_program(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: int,
    grad_scale: float = 1.0,
) -> UpdateProgram:
    """Adam's and AdamW's update (optim.Adam._update) at step number `step` (1 for the first)."""
    beta1, beta2 = betas
    lines = _unscaled(grad_scale)
    if weight_decay and decoupled:
        lines += ["master = master * decay_factor"]
    elif weight_decay:
        lines += ["decay = weight_decay * master", "grad = grad + decay"]
    lines += [
        "exp_avg = exp_avg * beta1",
        "first = one_minus_beta1 * grad",
        "exp_avg = exp_avg + first",
        "exp_avg_sq = exp_avg_sq * beta2",
        "second = one_minus_beta2 * grad",
        "second = second * grad",
        "exp_avg_sq = exp_avg_sq + second",
        "denominator = exp_avg_sq / correction2",
        "denominator = denominator ** 0.5",
        "denominator = denominator + eps",
        "change = step_size * exp_avg",
        "change = change / denominator",
        "master = master - change",
    ]
    scalars = dict(
        grad_scale=grad_scale,
        weight_decay=weight_decay,
        decay_factor=1.0 - lr * weight_decay,
        beta1=beta1,
        beta2=beta2,
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
        correction2=1.0 - beta2**step,
        eps=eps,
        step_size=lr / (1.0 - beta1**step),
    )
    return UpdateProgram(tuple(lines), ("grad",), ("master", "exp_avg", "exp_avg_sq"), scalars)


def _parse(line: str) -> tuple[str, str, str | None, str | None]:
    """(target, left, op, right); op and right are None for a copy `name = a`."""
    match = _LINE.match(line)
    if match is None:
        raise ValueError(f"update program: cannot read {line!r}; write `name = a OP b`")
    target, left, op, right = match.groups()
    if op is not None and (op == "**") != (right == "0.5"):
        raise ValueError(f"update program: {line!r}; only `x ** 0.5` is a power")
    return target, left, op, right


def used_scalars(program: UpdateProgram) -> list[str]:
    """The scalars the lines read, in first-use order (the kernel's scalar parameters)."""
    arrays = set(program.reads) | set(program.updates)
    assigned, names = set(), []
    for line in program.lines:
        target, left, op, right = _parse(line)
        for name in (left, right) if right is not None else (left,):
            known = name in arrays or name in assigned or name in names or name == "0.5"
            if not known:
                if name not in program.scalars:
                    raise ValueError(f"update program: {name!r} in {line!r} is never defined")
                names.append(name)
        assigned.add(target)
    return names


def run_on_numpy(program: UpdateProgram, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """Execute the program with NumPy float32 ufuncs on copies of `arrays` (name -> float32
    array); returns the updated arrays by name (the inputs are not modified)."""
    values: dict[str, Any] = {name: np.array(arrays[name], np.float32) for name in arrays}
    for name in used_scalars(program):
        values[name] = np.float32(program.scalars[name])
    for line in program.lines:
        target, left, op, right = _parse(line)
        if op is None:
            values[target] = values[left].copy()
        elif op == "**":
            values[target] = values[left] ** 0.5  # NumPy: a correctly rounded square root
        else:
            values[target] = _NUMPY_OPS[op](values[left], values[right])
    return {name: values[name] for name in program.updates}


def round_into(master: np.ndarray, dtype: Any) -> np.ndarray:
    """The compute copy the kernel writes last: the new master rounded once into dtype."""
    return casting.round_to(master, dtype)


def cuda_source(program: UpdateProgram, compute_copy: str | None) -> str:
    """The ElementwiseKernel body: read every array into a float register, run the lines with
    non-contracting intrinsics, write the updated arrays back, and round the master into
    `compute_copy` (a float16 output parameter) when there is one."""
    arrays = program.reads + program.updates
    body = [f"float {name}_ = {name};" for name in arrays]
    declared = set(arrays) | set(used_scalars(program))
    for line in program.lines:
        target, left, op, right = _parse(line)
        left_ = f"{left}_" if left in arrays else left
        right_ = f"{right}_" if right in arrays else right
        if op is None:
            expression = left_
        elif op == "**":
            expression = f"powf({left_}, 0.5f)"
        else:
            expression = f"{_CUDA_OPS[op]}({left_}, {right_})"
        if target in arrays:
            body.append(f"{target}_ = {expression};")
        elif target in declared:
            body.append(f"{target} = {expression};")
        else:
            body.append(f"float {target} = {expression};")
            declared.add(target)
    body += [f"{name} = {name}_;" for name in program.updates]
    if compute_copy is not None:
        body.append(f"{compute_copy} = master_;  // rounded once, as astype(float16) rounds")
    return "\n".join(body)
