"""The CUDA text of the fused update, read back without a GPU: a strict interpreter of the few C
forms cuda_source writes runs the kernel body with NumPy float32; it must give run_on_numpy's
bits."""

import re

import numpy as np
import pytest
from test_gpu_fused_update import CASES, IDS, awkward_values, bits, make_program

from minimp.precision.update_programs import (
    UpdateProgram,
    adam_program,
    cuda_source,
    round_into,
    run_on_numpy,
    sgd_program,
    used_scalars,
)

# each intrinsic rounds once to float32, as the NumPy ufunc on float32 operands does
INTRINSICS = {"__fmul_rn": np.multiply, "__fdiv_rn": np.divide, "__fadd_rn": np.add,
              "__fsub_rn": np.subtract}  # fmt: skip
STATEMENT = re.compile(r"^(float )?(\w+) = (.+);(?:  //.*)?$")
CALL = re.compile(r"^(\w+)\((\w+), (\w+|0\.5f)\)$")


def run_cuda_text(source, inputs, outputs):
    """Execute an ElementwiseKernel body as C would: `inputs` (name -> float32 value) are the
    read-only parameters, `outputs` (name -> value held before the kernel) the output
    parameters; a local must be declared once (`float x = ...;`) before it is read; returns the
    values the body wrote into the outputs."""
    values, written = dict(inputs, **outputs), {}
    declared = set(inputs)
    for line in source.splitlines():
        match = STATEMENT.match(line)
        assert match, f"not a statement cuda_source writes: {line!r}"
        declaration, target, expression = match.groups()
        assert target not in inputs, f"writes the read-only input {target}: {line!r}"
        if declaration:
            assert target not in declared and target not in outputs, f"redeclared: {line!r}"
            declared.add(target)
        else:
            assert target in declared or target in outputs, f"undeclared: {line!r}"
        value = evaluate(expression, values, line)
        values[target] = value
        if target in outputs:
            written[target] = value
    assert set(written) == set(outputs), f"outputs never written: {set(outputs) - set(written)}"
    return written


def evaluate(expression, values, line):
    def read(name):
        assert name in values, f"reads {name} before it has a value: {line!r}"
        return values[name]

    call = CALL.match(expression)
    if call is None:
        return read(expression).copy()
    function, left, right = call.groups()
    if function == "powf":
        assert right == "0.5f", line
        return read(left) ** np.float32(0.5)  # float32 square root, correctly rounded
    assert function in INTRINSICS, f"not an intrinsic that rounds once: {line!r}"
    return INTRINSICS[function](read(left), read(right))


@pytest.mark.parametrize("compute_copy", [None, "compute_copy"])
@pytest.mark.parametrize("grad_scale", [1.0, 2.0**-12])
@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("name, settings", CASES, ids=IDS)
def test_the_cuda_text_computes_the_programs_bits(name, settings, step, grad_scale, compute_copy):
    """Every kernel body cuda_source renders, interpreted statement by statement, writes the
    masters, slots and float16 copy that run_on_numpy and round_into compute from the lines."""
    program = make_program(name, settings, step, grad_scale, first_step=step == 1)
    rng = np.random.default_rng(step)
    arrays = {array: awkward_values(rng, (96,), 1.0) for array in program.reads + program.updates}
    if "exp_avg_sq" in arrays:  # a sum of squares: never negative
        arrays["exp_avg_sq"] = np.abs(arrays["exp_avg_sq"])
    scalars = {key: np.float32(program.scalars[key]) for key in used_scalars(program)}
    outputs = {array: arrays[array] for array in program.updates}
    if compute_copy:
        outputs[compute_copy] = np.zeros(96, np.float32)  # the float16 parameter, overwritten
    inputs = dict({array: arrays[array] for array in program.reads}, **scalars)
    got = run_cuda_text(cuda_source(program, compute_copy), inputs, outputs)
    expected = run_on_numpy(program, arrays)
    for array in program.updates:
        assert got[array].dtype == np.float32
        np.testing.assert_array_equal(bits(got[array]), bits(expected[array]), err_msg=array)
    if compute_copy:
        rounded = got[compute_copy].astype(np.float16)  # the float16 parameter's assignment
        expected_copy = round_into(expected["master"], np.float16)
        np.testing.assert_array_equal(bits(rounded), bits(expected_copy))


def test_a_copy_line_and_a_reused_temporary_render_as_c():
    """The forms the optimizers' programs use: a copy into an array, a temporary declared once
    and assigned again, a scalar read where it is first used."""
    program = UpdateProgram(
        ("t = grad * lr", "t = t + grad", "slot = t", "master = master - slot"),
        ("grad",), ("master", "slot"), {"lr": 0.5},
    )  # fmt: skip
    source = cuda_source(program, None)
    assert source.splitlines() == [
        "float grad_ = grad;",
        "float master_ = master;",
        "float slot_ = slot;",
        "float t = __fmul_rn(grad_, lr);",
        "t = __fadd_rn(t, grad_);",
        "slot_ = t;",
        "master_ = __fsub_rn(master_, slot_);",
        "master = master_;",
        "slot = slot_;",
    ]
    grad, master = np.float32([3.0, -1.0]), np.float32([10.0, 10.0])
    outputs = {"master": master, "slot": np.zeros(2, np.float32)}
    got = run_cuda_text(source, {"grad": grad, "lr": np.float32(0.5)}, outputs)
    np.testing.assert_array_equal(got["slot"], [4.5, -1.5])
    np.testing.assert_array_equal(got["master"], master - [4.5, -1.5])


@pytest.mark.parametrize("name, settings", CASES, ids=IDS)
def test_a_grad_scale_of_one_adds_no_line_and_is_the_default(name, settings):
    """unscale_ skips a scale of 1, so the program does too: no multiply by 1.0 per element; a
    program made without a grad_scale is the one made with 1.0."""
    unscaled = make_program(name, settings, 2, 1.0, first_step=False)
    assert not any("grad_scale" in line for line in unscaled.lines)
    scaled = make_program(name, settings, 2, 2.0, first_step=False)
    assert scaled.lines[0] == "grad = grad * grad_scale"
    assert scaled.lines[1:] == unscaled.lines
    if name == "sgd":
        default = sgd_program(settings["lr"], settings["momentum"], settings["weight_decay"], False)
    else:
        default = adam_program(settings["lr"], settings["betas"], settings["eps"],
                               settings["weight_decay"], name == "adamw", 2)  # fmt: skip
    assert default == unscaled


def test_run_on_numpy_computes_in_float32_whatever_it_is_handed():
    """Arrays handed in as float64 or float16 are read as float32 first, as the kernel's float32
    parameters read them: the result is the float32 computation, not a float64 one."""
    program = sgd_program(lr=0.1, momentum=0.0, weight_decay=0.0, first_step=True)
    grad = np.array([1.0 + 2.0**-30, 3.0])  # float64; its float32 rounding is 1.0
    got = run_on_numpy(program, {"grad": grad, "master": np.float16([1.0, 1.0])})["master"]
    assert got.dtype == np.float32
    change = np.float32(0.1) * grad.astype(np.float32)
    np.testing.assert_array_equal(bits(got), bits(np.float32(1.0) - change))
