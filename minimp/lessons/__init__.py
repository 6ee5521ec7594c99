"""minimp.lessons: what the notebooks in lessons/ import, so they run from any working directory.

A notebook has no `__file__`, so a helper module next to it (lessons/plotting.py) is importable only
when the kernel happens to start in lessons/. Inside the package, it is importable wherever minimp
is: the exercise checkers (lesson01 ... lesson18, one module per lesson, on top of `checking`),
the figures (`plotting`, which needs matplotlib), the MPI jobs a lesson starts (`processes`),
pipeline timelines (`timelines`), lesson 12's cut GPT and its figure (`cutting`) and lesson 14's
data-parallel step timed with and without overlap (`overlap_timeline`). The reference solutions
live apart, in lessons/solutions/, and the tests run every checker against them and against a
wrong solution.

This is the top layer: it imports public minimp APIs (minimp.train included) and nothing imports it.
"""

# The checker modules, named by the notebooks' numbers: lessons are numbered by topic and may land
# out of order, so the numbers may skip (a position in this tuple is not a lesson's number).
LESSONS = tuple(f"lesson{number:02d}" for number in range(1, 19))
