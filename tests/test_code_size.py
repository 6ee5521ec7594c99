"""scripts/code_size.py: lines of code without blank lines, comments or docstrings; Any params."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import code_size  # noqa: E402

SOURCE = '''"""A module's docstring,
on two lines."""

import os  # a comment


class Thing:
    """A class's docstring."""

    size = 3

    def grow(self, by, times: int, how: "Any | None" = None):
        """A method's docstring."""
        # a comment alone
        text = """not a docstring:
        a string the code uses"""
        return (by, times,
                how, text)
'''


def test_lines_of_code_count_code_only_and_strings_that_are_not_docstrings():
    # import, class, size, def, text = (2 lines), return (2 lines)
    assert code_size.lines_of_code(SOURCE) == 8


def test_a_parameter_is_any_when_typed_so_or_not_at_all_and_self_is_not_counted():
    assert code_size.any_parameters(SOURCE) == ["grow(by)", "grow(how)"]
    assert code_size.parameter_count(SOURCE) == 3


def test_the_package_is_counted_without_its_lessons(tmp_path, capsys):
    (tmp_path / "lessons").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "lessons" / "b.py").write_text("y = 2\nz = 3\n")
    assert code_size.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == "lines of code: 1; parameters typed Any: 0 of 0 (0.0%)\n"
