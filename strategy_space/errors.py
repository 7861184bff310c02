"""Error types shared by every package: each carries all the problems found, not just the first."""
from __future__ import annotations

import reprlib
from typing import Iterable

MAX_PROBLEM_CHARS = 1000   # a problem quoting a huge value is cut
MAX_PROBLEMS_SHOWN = 20    # a file with thousands of bad entries lists the first ones


class ConfigError(ValueError):
    """Bad user input (a spec, a strategy, a flag). Holds every problem found, each one a sentence
    that names the offending item, the bad value and what is allowed.

    The CLI turns it into a short message and exit code 2.
    """

    def __init__(self, problems: Iterable[str] | str, *, source: str | None = None):
        if isinstance(problems, str):
            problems = [problems]
        # each problem is a sentence: cut one that quotes a huge value (the cut keeps the start)
        self.problems = [p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS - 4] + " ..."
                         for p in problems if p]
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        self.source = source
        super().__init__(self._format())

    def _format(self) -> str:
        where = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            return where + self.problems[0]
        lines = [f"{where}{len(self.problems)} problems:"]
        lines += [f"  - {p}" for p in self.problems[:MAX_PROBLEMS_SHOWN]]
        if len(self.problems) > MAX_PROBLEMS_SHOWN:
            lines.append(f"  ... and {len(self.problems) - MAX_PROBLEMS_SHOWN} more (fix these first)")
        return "\n".join(lines)

    def with_source(self, source: str) -> "ConfigError":
        """The same problems, attributed to ``source`` (a file name, a flag)."""
        return ConfigError(self.problems, source=source)


class StrategyError(ConfigError):
    """A strategy that does not fit its model or cluster (see ``validate``)."""


class Problems:
    """Collects problems, then raises them together."""

    def __init__(self, error_type: type[ConfigError] = ConfigError):
        self.items: list[str] = []
        self.error_type = error_type

    def add(self, problem: str) -> None:
        self.items.append(problem)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self, source: str | None = None) -> None:
        if self.items:
            raise self.error_type(self.items, source=source)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4
_SHORT.maxlevel = 2


# Names listed in full up to this many; past it, the first and last few and how many (the nodes of
# a 512-node cluster, its 4,096 worker slots).
LISTED_NAMES = 12


def listed_names(names) -> str:
    """``names`` joined for a message: all of them, or the first and last few and the count."""
    names = list(names)
    if len(names) <= LISTED_NAMES:
        return ", ".join(names)
    return f"{', '.join(names[:6])}, ..., {', '.join(names[-2:])} ({len(names)} in all)"


def short_repr(value) -> str:
    """A repr for error messages, built from a bounded part of ``value`` (never the whole of a
    huge or deeply nested one)."""
    return _SHORT.repr(value)
