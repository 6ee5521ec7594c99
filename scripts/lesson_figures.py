"""Trace every figure a lesson's prose states to the code cell above it that prints it.

    python scripts/lesson_figures.py 11          # lessons/11_*.ipynb, as stored (executed)

For each markdown cell, each number in its prose (code spans and fenced blocks left out, since
they are code) is looked up in the stored outputs of the code cells above it, in the forms a
cell prints it (65,504 as 65504 or 65,504; 0.53 as .53 inside 0.530). A figure no cell above
prints is listed as NOT PRINTED: a definition (fp16, 2 ranks, 10 mantissa bits) is fine, a
measurement is not. It reads what scripts/execute_lessons.py stored, so run that first.
"""

import argparse
import os
import re
import sys

import nbformat

LESSONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lessons")
# 1,024 / 0.53 / 1e-5 / 55% / 2^-24 (a power is one figure)
NUMBER = re.compile(r"(?<![\w.^])-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:e-?\d+|\^-?\d+)?%?")


def printed(cell) -> str:
    """All the text a stored code cell shows: streams and the text of results and displays."""
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append(output["text"])
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def forms(figure: str) -> list[str]:
    """The ways a cell may print what the prose writes as `figure`."""
    bare = figure.rstrip("%").replace(",", "")
    found = {figure, bare, figure.rstrip("%")}
    if "," in figure:
        found.add(f"{int(bare):_}")
    return sorted(found, key=len, reverse=True)


def trace(path: str) -> list[tuple[int, str, int | None]]:
    """(markdown cell index, figure, index of the first code cell above printing it, or None)."""
    cells = nbformat.read(path, as_version=4).cells
    rows = []
    for index, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        prose = re.sub(r"```.*?```|`[^`]*`|\$[^$]*\$", " ", cell.source, flags=re.S)
        for figure in dict.fromkeys(NUMBER.findall(prose)):
            where = next(
                (above for above in range(index) if cells[above].cell_type == "code"
                 and any(re.search(rf"(?<![\d.]){re.escape(form)}(?!\d)", printed(cells[above]))
                         for form in forms(figure))),
                None,
            )
            rows.append((index, figure, where))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("number", type=int, help="the lesson's number")
    args = parser.parse_args(argv)
    names = [name for name in os.listdir(LESSONS) if name.startswith(f"{args.number:02d}_")]
    if not names:
        raise SystemExit(f"no lesson {args.number} in {LESSONS}")
    rows = trace(os.path.join(LESSONS, names[0]))
    for index, figure, where in rows:
        print(f"cell {index:3d}: {figure:>12}  " + (f"printed by cell {where}" if where is not None
                                                    else "NOT PRINTED"))
    missing = sum(where is None for _, _, where in rows)
    print(f"{len(rows)} figures, {missing} not printed by a cell above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
