"""What every exercise checker shares: run named checks on a learner's code, print what passed.

A checker never raises because the learner's code is wrong or unfinished: it prints one line per
check (a tick or a cross), a hint under each cross, and a summary, and returns a Report. A stub that
raises NotImplementedError stops the checker at its first check ("not written yet"), so a lesson
run top to bottom with the stubs in place prints a few crosses and goes on.

    report = Report("ulp16", quiet=False)

    @report.case("0 -> 2^-24, the subnormal spacing", hint="below 2^-14 the gap is fixed")
    def _():
        expect(learner(0.0) == 2.0**-24, f"got {learner(0.0)}")

    return report.finish()

Tests call checkers with quiet=True and look at `report.passed`.
"""

from typing import Any, Callable


class Failed(Exception):
    """A check's verdict: the message says what was wrong, in the learner's terms."""


def expect(condition: Any, message: str) -> None:
    """Fail the current check with `message` unless condition holds (not an assert: -O keeps it)."""
    if not condition:
        raise Failed(message)


class Report:
    """The outcome of one checker: (description, passed, detail) per check, printed as they run."""

    def __init__(self, title: str, quiet: bool = False):
        self.title, self.quiet = title, quiet
        self.results: list[tuple[str, bool, str]] = []
        # (description, detail, hint) of each failed check: the tests read what a mistake is told
        self.failures: list[tuple[str, str, str]] = []
        self.stopped = False  # set when the learner's code is not written yet
        self._say(f"{title}:")

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)

    def case(self, description: str, hint: str) -> Callable[[Callable[[], None]], None]:
        """A decorator that runs the decorated check at once and records its outcome."""

        def run(check: Callable[[], None]) -> None:
            if self.stopped:
                return
            try:
                check()
            except NotImplementedError:
                self.stopped = True
                self._record(description, False, "not written yet (it raises NotImplementedError)")
                return
            except Failed as failure:
                self._record(description, False, str(failure), hint)
                return
            except Exception as error:  # the learner's code raised: show what, not a traceback
                detail = f"raised {type(error).__name__}: {error}"
                self._record(description, False, detail, hint)
                return
            self._record(description, True, "")

        return run

    def _record(self, description: str, passed: bool, detail: str, hint: str = "") -> None:
        self.results.append((description, passed, detail))
        if not passed:
            self.failures.append((description, detail, hint))
        self._say(f"  {'✓' if passed else '✗'} {description}")
        if detail:
            self._say(f"      {detail}")
        if hint:
            self._say(f"      hint: {hint}")

    def finish(self) -> "Report":
        """Print the summary line; returns self."""
        if self.passed:
            self._say(f"  all {len(self.results)} checks passed")
        elif self.stopped:
            self._say("  write it, then run this cell again")
        else:
            self._say(f"  {self.count_passed} of {len(self.results)} checks passed")
        return self

    @property
    def count_passed(self) -> int:
        """How many checks passed."""
        return sum(passed for _, passed, _ in self.results)

    @property
    def passed(self) -> bool:
        """True when there was at least one check and every check passed."""
        return bool(self.results) and all(passed for _, passed, _ in self.results)

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"<{self.title}: {self.count_passed} of {len(self.results)} checks passed>"

    def _ipython_display_(self) -> None:
        """In a notebook the lines were printed already: show nothing more."""


def close(a: float, b: float, rtol: float) -> bool:
    """|a - b| <= rtol |b| (a relative comparison that needs no numpy)."""
    return abs(a - b) <= rtol * abs(b)


def call(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """function(*args, **kwargs); a learner's None (a function that forgot to return) becomes a
    Failed with that hint rather than a TypeError three lines later."""
    result = function(*args, **kwargs)
    if result is None:
        name = getattr(function, "__name__", "the function")
        raise Failed(f"{name} returned None: did it forget a `return`?")
    return result
