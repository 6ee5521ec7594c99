"""The fused optimizer update: its arithmetic equals minimp's update bit for bit (here, through
NumPy), and on a GPU the one-kernel update equals the unfused CuPy path bit for bit."""

import re

import numpy as np
import pytest
from conftest import HAS_GPU, requires_gpu

from minimp import nn, optim
from minimp.precision import fused_update
from minimp.precision.update_programs import (
    UpdateProgram,
    adam_program,
    cuda_source,
    round_into,
    run_on_numpy,
    sgd_program,
    used_scalars,
)

if HAS_GPU:
    import cupy

# name, optimizer factory, program factory (step number, grad_scale, first step) -> UpdateProgram
SGD_SETTINGS = dict(lr=0.05, momentum=0.0, weight_decay=0.0)
CASES = [
    ("sgd", dict(SGD_SETTINGS)),
    ("sgd", dict(SGD_SETTINGS, momentum=0.9)),
    ("sgd", dict(SGD_SETTINGS, weight_decay=1e-2)),
    ("sgd", dict(SGD_SETTINGS, momentum=0.9, weight_decay=1e-2)),
    ("adam", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)),
    ("adam", dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)),  # L2: into the grad
    ("adamw", dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)),
]
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]
STEPS = 3


def make_optimizer(name, settings, parameters):
    if name == "sgd":
        return optim.SGD(parameters, **settings)
    if name == "adam":
        return optim.Adam(parameters, **settings)
    return optim.AdamW(parameters, **settings)


def make_program(name, settings, step, grad_scale, first_step):
    if name == "sgd":
        return sgd_program(
            settings["lr"], settings["momentum"], settings["weight_decay"], first_step, grad_scale
        )
    decoupled = name == "adamw"
    return adam_program(
        settings["lr"], settings["betas"], settings["eps"], settings["weight_decay"], decoupled,
        step, grad_scale,
    )  # fmt: skip


def awkward_values(rng, shape, scale):
    """Normal values over many binades, with zeros of both signs and float32 subnormals."""
    values = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 8, shape))
    flat = values.reshape(-1)
    flat[:4] = [0.0, -0.0, 1e-40, -3e-42]
    return (values * scale).astype(np.float32)


def bits(array):
    return np.asarray(array).view(np.uint32 if array.dtype == np.float32 else np.uint16)


@pytest.mark.parametrize("grad_scale", [1.0, 2.0, 2.0**-12])  # 2.0: neither 1 nor small
@pytest.mark.parametrize("name, settings", CASES, ids=IDS)
def test_the_programs_arithmetic_is_minimps_update_bit_for_bit(name, settings, grad_scale):
    """The lines the kernel is rendered from, run by NumPy, against optim.py's own update and
    write-back over three steps of a float16 parameter, unscale included."""
    rng = np.random.default_rng(7)
    initial = awkward_values(rng, (64, 33), 1.0)
    parameter = nn.Parameter(initial.copy())
    optimizer = make_optimizer(name, settings, [parameter])
    parameter.data = parameter.data.astype(np.float16)  # the model cast: masters stay float32
    slot_names = optimizer.slot_names
    state = {"master": initial.copy()}
    for step in range(1, STEPS + 1):
        grad = awkward_values(rng, initial.shape, 1.0 / grad_scale)
        program = make_program(name, settings, step, grad_scale, first_step=step == 1)
        if name != "sgd" and step == 1:  # Adam's moments start as master * 0, as optim._slot
            state.update({slot: state["master"] * 0 for slot in slot_names})
        state.update(run_on_numpy(program, dict(state, grad=grad)))
        parameter.grad = grad.copy()
        optimizer.accumulate_gradients()
        optimizer.step(grad_scale=grad_scale)
        np.testing.assert_array_equal(bits(optimizer.master_weights[0]), bits(state["master"]))
        for slot in program.updates[1:]:
            np.testing.assert_array_equal(bits(optimizer.slots[0][slot]), bits(state[slot]))
        expected_copy = round_into(state["master"], np.float16)
        np.testing.assert_array_equal(bits(parameter.data), bits(expected_copy))


def test_step_with_a_grad_scale_equals_unscaling_first():
    """optimizer.step(grad_scale=1/S) gives the bits of unscale_(grads, S) then step()."""
    from minimp.precision.step import unscale_

    rng = np.random.default_rng(3)
    initial, grad = awkward_values(rng, (40,), 1.0), awkward_values(rng, (40,), 2.0**10)
    results = []
    for fold_in in (True, False):
        parameter = nn.Parameter(initial.copy())
        optimizer = optim.AdamW([parameter], lr=1e-2)
        parameter.grad = grad.copy()
        gradients = optimizer.accumulate_gradients()
        if fold_in:
            optimizer.step(grad_scale=2.0**-10)
        else:
            unscale_(gradients, 2.0**10)
            optimizer.step()
        results.append(bits(optimizer.master_weights[0]).copy())
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("name, settings", CASES, ids=IDS)
def test_the_cuda_text_rounds_every_operation_alone(name, settings):
    """Each line becomes one non-contracting intrinsic (or powf for ** 0.5): no bare + - * /
    that the compiler could fuse into a multiply-add, and the lines keep their order."""
    program = make_program(name, settings, step=2, grad_scale=2.0**-8, first_step=False)
    source = cuda_source(program, "compute_copy")
    statements = [line for line in source.splitlines() if "__f" in line or "powf" in line]
    operations = [line for line in program.lines if len(line.split()) == 5]  # not the copies
    assert len(statements) == len(operations)
    for line in source.splitlines():
        code = line.split("//")[0]
        assert not re.search(r"[\w)]\s*[-+*/]\s*[\w(]", code.replace("0.5f", "")), line
    targets = [line.split(" = ")[0].split()[-1].rstrip("_") for line in statements]
    assert targets == [line.split(" = ")[0] for line in operations]
    assert source.splitlines()[-1].startswith("compute_copy = master_;")


def test_a_program_naming_an_undefined_value_is_refused():
    program = UpdateProgram(("master = master - nothing",), ("grad",), ("master",), {})
    with pytest.raises(ValueError, match="'nothing' .* is never defined"):
        used_scalars(program)
    with pytest.raises(ValueError, match="only `x \\*\\* 0.5` is a power"):
        used_scalars(UpdateProgram(("master = master ** grad",), ("grad",), ("master",), {}))


def test_only_minimps_own_rules_are_fused():
    """A subclass that overrides _update keeps its own arithmetic; NumPy arrays are never fused."""

    class Doubled(optim.SGD):
        def _update(self, master, grad, slots, weight_decay):
            master -= 2 * self.lr * grad

    parameter = nn.Parameter(np.ones(3, np.float32))
    assert fused_update.fuses(optim.AdamW([parameter]))
    assert fused_update.fuses(optim.Adam([parameter]))
    assert fused_update.fuses(optim.SGD([parameter], lr=0.1))
    assert not fused_update.fuses(Doubled([parameter], lr=0.1))
    assert fused_update.program_for(Doubled([parameter], lr=0.1), 0, 1.0) is None
    grad = np.ones(3, np.float32)
    assert fused_update.fused_step(optim.SGD([parameter], lr=0.1), 0, grad) is False


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("grad_scale", [1.0, 2.0**-12])
@pytest.mark.parametrize("name, settings", CASES, ids=IDS)
def test_the_fused_kernel_equals_the_unfused_cupy_path_bit_for_bit(name, settings, grad_scale):
    """Two optimizers on the same CuPy arrays, fused (one kernel per parameter) and not: masters,
    slots and float16 copies agree in every bit after each of three steps."""
    rng = np.random.default_rng(11)
    initial = [awkward_values(rng, shape, 1.0) for shape in ((257, 129), (129,))]
    runs = []
    for fused in (True, False):
        parameters = [nn.Parameter(cupy.asarray(array)) for array in initial]
        optimizer = make_optimizer(name, settings, parameters)
        optimizer.fused = fused
        parameters[0].data = parameters[0].data.astype(cupy.float16)  # the other stays float32
        runs.append((parameters, optimizer))
    for _ in range(STEPS):
        grads = [awkward_values(rng, array.shape, 1.0 / grad_scale) for array in initial]
        for parameters, optimizer in runs:
            for parameter, grad in zip(parameters, grads):
                parameter.grad = cupy.asarray(grad)
            optimizer.accumulate_gradients()
            assert fused_update.fuses(optimizer)
            optimizer.step(grad_scale=grad_scale)
        (fused_parameters, fused), (plain_parameters, plain) = runs
        for index in range(len(initial)):
            pairs = [(fused.master_weights[index], plain.master_weights[index])]
            pairs += [(fused.slots[index][n], plain.slots[index][n]) for n in fused.slot_names]
            pairs += [(fused_parameters[index].data, plain_parameters[index].data)]
            for a, b in pairs:
                assert (a is None) == (b is None)  # SGD without momentum keeps no buffer
                if a is not None:
                    np.testing.assert_array_equal(bits(cupy.asnumpy(a)), bits(cupy.asnumpy(b)))


def test_numpys_power_of_one_half_is_its_square_root():
    """What update_programs says of the CPU side: NumPy's `** 0.5` (Adam's denominator) gives
    the bits of np.sqrt, the correctly rounded square root."""
    values = awkward_values(np.random.default_rng(5), (100_000,), 1.0)
    values = np.abs(values)
    np.testing.assert_array_equal(bits(values**0.5), bits(np.sqrt(values)))


def test_an_update_rule_without_a_qualname_is_not_fused():
    """A callable object set as `_update` (no __qualname__) is someone else's rule: fuses() says
    no instead of raising."""

    class Rule:
        def __call__(self, master, grad, slots, weight_decay):
            master -= grad

    class Custom(optim.SGD):
        _update = Rule()

    assert not hasattr(Custom._update, "__qualname__")
    assert fused_update.fuses(Custom([nn.Parameter(np.ones(3, np.float32))], lr=0.1)) is False


@pytest.mark.gpu
@requires_gpu
def test_fused_step_runs_the_kernel_and_without_a_grad_scale_leaves_the_gradient_unscaled():
    """On CuPy arrays fused_step does the update (returns True) and, given no grad_scale, gives
    the bits of the unfused step with none."""
    rng = np.random.default_rng(13)
    initial, grad = awkward_values(rng, (33,), 1.0), awkward_values(rng, (33,), 1.0)
    masters = []
    for fused in (True, False):
        parameter = nn.Parameter(cupy.asarray(initial))
        optimizer = optim.AdamW([parameter], lr=1e-2)
        optimizer.fused = False
        parameter.grad = cupy.asarray(grad)
        gradients = optimizer.accumulate_gradients()
        if fused:
            optimizer.step_count += 1  # what step() does before it calls fused_step
            assert fused_update.fused_step(optimizer, 0, gradients[0]) is True
        else:
            optimizer.step()
        masters.append(bits(cupy.asnumpy(optimizer.master_weights[0])))
    np.testing.assert_array_equal(masters[0], masters[1])
