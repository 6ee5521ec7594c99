"""What every lesson's exercise tests share: the reference solution passes its checker, an
unwritten stub is reported (not raised), and each plausible wrong solution a learner would write
fails it, with a message or hint that names the mistake.

A lesson's test file lists its wrong solutions by checker and takes the tests:

    WRONG = {"check_ulp16": [Wrong(ulp16_without_subnormals, "2^-14"), ...], ...}
    (test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
     test_every_wrong_solution_fails_naming_its_mistake,
     test_every_checker_refuses_two_wrong_solutions) = exercise_tests(1, WRONG)
"""

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from minimp.lessons.checking import Report

SOLUTIONS = os.path.join(os.path.dirname(__file__), "..", "..", "lessons", "solutions")


def solutions(number: int) -> Any:
    """lessons/solutions/lessonNN.py, loaded from its path (it is not a package)."""
    path = os.path.join(SOLUTIONS, f"lesson{number:02d}.py")
    spec = importlib.util.spec_from_file_location(f"lesson_solutions_{number:02d}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Wrong:
    """A wrong answer a learner would plausibly write, and the word that names its mistake.

    `solution` is what the learner passes to the checker; with `factory` it is a function that
    makes it (a Function subclass defined inside a function, say). The checker must fail it on
    its merits (not as an unwritten stub), and some failed check's description, message or hint
    must contain `names` (case-insensitive)."""

    solution: Any
    names: str
    factory: bool = False

    def made(self) -> Any:
        return self.solution() if self.factory else self.solution


def stub(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


class StubClass:
    """A Function or a scaler whose every method is unwritten."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError

    @staticmethod
    def apply(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def exercise_tests(number: int, wrong: dict[str, list[Wrong]]) -> tuple[Callable, ...]:
    """The four tests of lesson `number`'s exercises, against its WRONG solutions by checker."""
    exercises = importlib.import_module(f"minimp.lessons.lesson{number:02d}").EXERCISES
    ids = [checker.__name__ for _, checker in exercises]

    @pytest.mark.parametrize("name, checker", exercises, ids=ids)
    def test_the_reference_solution_passes(name, checker):
        report = checker(getattr(solutions(number), name), quiet=True)
        assert report.passed, f"{name} fails {report.failures}"

    @pytest.mark.parametrize("name, checker", exercises, ids=ids)
    def test_an_unwritten_stub_is_reported_not_raised(name, checker, capsys):
        report = checker(StubClass if name[0].isupper() else stub)
        assert isinstance(report, Report) and not report.passed and report.stopped
        assert "not written yet" in capsys.readouterr().out

    @pytest.mark.filterwarnings("ignore::RuntimeWarning")  # wrong solutions overflow on purpose
    @pytest.mark.parametrize("name, checker", exercises, ids=ids)
    def test_every_wrong_solution_fails_naming_its_mistake(name, checker):
        for each in wrong[checker.__name__]:
            report = checker(each.made(), quiet=True)
            assert not report.passed, f"{checker.__name__} passes the wrong {each.solution}"
            assert not report.stopped, f"{each.solution} failed as a stub, not on its merits"
            told = " ".join(" ".join(failure) for failure in report.failures).lower()
            assert each.names.lower() in told, (
                f"{checker.__name__} fails {each.solution} without naming {each.names!r}: "
                f"{report.failures}"
            )

    def test_every_checker_refuses_two_wrong_solutions():
        assert sorted(wrong) == sorted(ids)
        for checker, answers in wrong.items():
            assert len(answers) >= 2, f"{checker}: {len(answers)} wrong solution(s)"
            assert all(each.names for each in answers), f"{checker}: a mistake left unnamed"

    return (test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
            test_every_wrong_solution_fails_naming_its_mistake,
            test_every_checker_refuses_two_wrong_solutions)
