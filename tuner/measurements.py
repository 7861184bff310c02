"""What a tuning run measured, kept once: ``Measurements``, the trials in measurement order.

``tune_loop`` appends each trial as it is measured; the outcome's statistics (``TuneOutcome``) and
the tuners' views (``Tuner.measured``) read the same record. The tuners keep only indexes into it
(encoded keys, canonical fingerprints, feature rows), never the measured times themselves.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence, overload

from .trial import Trial


class Measurements(Sequence[Trial]):
    """Trials in measurement order; append-only.

    Args:
        trials: the first trials (e.g. those of a resumed run).
    """

    def __init__(self, trials: Iterable[Trial] = ()):
        self._trials: list[Trial] = []
        self._held: set[int] = set()   # ids of the trials held (each trial object is held once)
        self.add(trials)

    def append(self, trial: Trial) -> None:
        """Record one measured trial (a trial object already held is refused: it would count twice)."""
        if id(trial) in self._held:
            raise ValueError(f"this trial of {trial.origin} is recorded already")
        self._trials.append(trial)
        self._held.add(id(trial))

    def add(self, trials: Iterable[Trial]) -> None:
        """Record the trials not held yet, in order (those already held were recorded by whoever
        measured them, e.g. the loop before it hands them to a tuner sharing this record)."""
        for t in trials:
            if id(t) not in self._held:
                self.append(t)

    @overload
    def __getitem__(self, i: int) -> Trial: ...

    @overload
    def __getitem__(self, i: slice) -> list[Trial]: ...

    def __getitem__(self, i):
        return self._trials[i]

    def __len__(self) -> int:
        return len(self._trials)

    def __iter__(self) -> Iterator[Trial]:
        return iter(self._trials)

    def __eq__(self, other) -> bool:
        if isinstance(other, Measurements):
            return self._trials == other._trials
        return isinstance(other, list) and self._trials == other

    __hash__ = None   # mutable

    def __repr__(self) -> str:
        return f"Measurements({len(self)} trials)"

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self._trials if t.ok]

    def latest_seconds(self, key_of) -> dict:
        """``key_of(trial)`` -> the median of that key's latest measurement (inf when it failed), for
        the trials whose key is not None; keys ordered by first measurement."""
        out: dict = {}
        for t in self._trials:
            key = key_of(t)
            if key is not None:
                out[key] = t.median if t.ok else float("inf")
        return out


def as_measurements(trials: Sequence[Trial] | Measurements) -> Measurements:
    """``trials`` as a Measurements (the same object when it is one)."""
    return trials if isinstance(trials, Measurements) else Measurements(trials)
