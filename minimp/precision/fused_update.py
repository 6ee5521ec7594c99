"""Fused optimizer updates on a GPU: unscale, update and round into float16 in one CuPy kernel.

Unfused, one parameter's AdamW step on CuPy arrays is an elementwise kernel per arithmetic
operation of optim.py (the unscale, the two moments, the denominator, the step), then the cast
and the copy into the float16 parameter, each reading and writing whole arrays in GPU memory.
Fused, it is one ElementwiseKernel that reads the gradient, the master and the two moments once
and writes the master, the moments and the float16 copy once, as PyTorch's `fused=True`
optimizers and apex's FusedAdam do.

The arithmetic is not written here: the kernel body is rendered from the same program the CPU
tests run through NumPy (minimp/precision/update_programs.py), so the fused update performs the
unfused path's float32 operations in the same order, each rounded once (tests/test_gpu_fused.py
checks the bits on a device). Only minimp's own SGD and Adam/AdamW rules are fused; a subclass
that overrides `_update`, a ZeRO shard's piece, or any NumPy array takes the unfused path.
"""

import functools
from typing import Any

import numpy as np

from minimp.backend import array_module, is_device_array
from minimp.precision.update_programs import (
    UpdateProgram,
    adam_program,
    cuda_source,
    sgd_program,
    used_scalars,
)


FUSED_RULES = ("SGD._update", "Adam._update")  # minimp/optim/optimizer.py's rules (AdamW is Adam's)


def fuses(optimizer: Any) -> bool:
    """True when the optimizer's update rule is one of minimp's own (an overridden `_update`
    must run as written, so it is never fused)."""
    return getattr(type(optimizer)._update, "__qualname__", "") in FUSED_RULES


def program_for(optimizer: Any, index: int, grad_scale: float) -> UpdateProgram | None:
    """The update program of parameter `index` in the step under way (step_count already
    counts it), or None when the optimizer's rule is not one fuses() accepts."""
    if not fuses(optimizer):
        return None
    rule = type(optimizer)._update.__qualname__
    slots, weight_decay = optimizer.slots[index], optimizer.weight_decays[index]
    if rule == "SGD._update":
        first_step = slots["momentum_buffer"] is None
        return sgd_program(optimizer.lr, optimizer.momentum, weight_decay, first_step, grad_scale)
    return adam_program(
        optimizer.lr,
        optimizer.betas,
        optimizer.eps,
        weight_decay,
        optimizer.decoupled_weight_decay,
        optimizer.step_count,
        grad_scale,
    )


@functools.lru_cache(maxsize=64)  # a handful of programs per run: compile each once
def _kernel(program_lines: tuple, reads: tuple, updates: tuple, scalars: tuple, rounds: bool):
    import cupy

    program = UpdateProgram(program_lines, reads, updates, dict.fromkeys(scalars, 0.0))
    in_params = ", ".join(f"float32 {name}" for name in reads + scalars)
    outputs = [f"float32 {name}" for name in updates] + (["float16 compute_copy"] if rounds else [])
    source = cuda_source(program, "compute_copy" if rounds else None)
    return cupy.ElementwiseKernel(in_params, ", ".join(outputs), source, "minimp_fused_update")


def fused_step(optimizer: Any, index: int, grad: Any, grad_scale: float = 1.0) -> bool:
    """Update parameter `index` of `optimizer` from its float32 gradient with one kernel, and
    round the new master into the float16 compute copy in the same kernel; the gradient is only
    read. Returns False, having done nothing, where the kernels do not apply (NumPy arrays, a
    rule not minimp's, a compute copy that is neither the master nor float16)."""
    master, parameter = optimizer.master_weights[index], optimizer.params[index]
    if not is_device_array(master):
        return False
    program = program_for(optimizer, index, grad_scale)
    copy = None if parameter.data is master else parameter.data
    if program is None or (copy is not None and copy.dtype != np.float16):
        return False
    slots = optimizer.slots[index]
    for name in program.updates[1:]:  # the slots, allocated as the unfused path allocates them
        if slots[name] is None and name == "momentum_buffer":
            slots[name] = array_module(master).empty_like(master)  # the kernel copies grad in
        elif slots[name] is None:
            optimizer._slot(slots, name, master)  # zeros, as Adam's first step makes them
    scalars = tuple(used_scalars(program))
    kernel = _kernel(program.lines, program.reads, program.updates, scalars, copy is not None)
    arguments = [grad] + [np.float32(program.scalars[name]) for name in scalars]
    outputs = [master] + [slots[name] for name in program.updates[1:]]
    kernel(*arguments, *outputs, *([copy] if copy is not None else []))
    return True
