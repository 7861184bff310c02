"""What a tuning run measured, kept once: ``History``, owned by the loop (``tuner.search.tuning``) and read
by the tuners the way Optuna's samplers read ``study.trials``.

Each trial becomes a ``HistoryEntry`` once, when it arrives: the trial, its strategy's encoded row
(carried over from its proposal; encoded here only for a trial nobody proposed, e.g. a resumed one),
its canonical key, its feature row (carried over from the proposal too when the tuner computed it)
and its uid. A strategy measured again (confirmation) shares its first entry's row, key and
features: nothing is encoded or featurized twice. Tuners keep only what they cannot read here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence, overload

import numpy as np

from strategy_space import ClusterSpec, ConfigError, ModelSpec
from strategy_space.encoding import EncodedStrategies
from strategy_space.space import StrategySpace

from tuner.features.batch import featurize
from tuner.features.tables import FeatureTables
from tuner.records.store import trial_uid
from tuner.records.trial import Trial


@dataclass(frozen=True)
class HistoryEntry:
    """One measured trial with what the tuners read of its strategy.

    Attributes:
        trial: the measurement.
        encoded: the strategy as one encoded row (None outside the encoded space).
        key: the encoded row's key (``EncodedStrategies.row_keys``; None outside the encoded space).
        canonical: the fingerprint of the strategy's canonical form (equal for strategies that run
            identically: ``Strategy.canonical``).
        features: the strategy's feature row (``features.batch.featurize``; None outside the encoded space).
        feature_key: ``features`` as a hashable key (``feature_keys``), or None.
        uid: the trial's content hash (``store.trial_uid``).
    """

    trial: Trial
    encoded: EncodedStrategies | None
    key: bytes | None
    canonical: str
    features: np.ndarray | None
    feature_key: bytes | None
    uid: str


@dataclass(frozen=True)
class _Known:
    """What is derived from one strategy, shared by its entries."""

    encoded: EncodedStrategies | None
    key: bytes | None
    canonical: str
    features: np.ndarray | None
    feature_key: bytes | None


class History(Sequence[Trial]):
    """The trials of one run, in measurement order, each with its entry; append-only.

    As a sequence it holds the trials (``TuneOutcome`` reads them); ``entries`` holds what the
    tuners read.

    Args:
        model, cluster: the run's target (strategies are encoded and featurized for them).
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec):
        self.model, self.cluster = model, cluster
        self.entries: list[HistoryEntry] = []
        # strategy fingerprint -> lossy strategies' measured statistical efficiency (the loop's probes)
        self.efficiency: dict = {}
        self._held: set[int] = set()          # ids of the trial objects held (each is held once)
        self._known: dict[str, _Known] = {}   # strategy fingerprint -> what was derived from it
        self._first: dict[str, HistoryEntry] = {}   # strategy fingerprint -> its first entry
        self._space: StrategySpace | None = None
        self._tables: FeatureTables | None = None

    # ---- adding ---------------------------------------------------------------------------------
    def add(self, trials: Iterable[Trial], proposals: Sequence = ()) -> list[HistoryEntry]:
        """Record the trials not held yet, in order, and return their entries.

        Args:
            proposals: the ``Proposal``s the trials came from: their encoded rows (and feature rows,
                when given) are taken over instead of computed again.
        """
        new = []
        for t in trials:
            if id(t) not in self._held:
                self._held.add(id(t))
                new.append(t)
        self._derive([t.strategy for t in new], proposals)
        out = []
        for t in new:
            k = self._known[t.strategy.fingerprint]
            out.append(HistoryEntry(t, k.encoded, k.key, k.canonical, k.features, k.feature_key, trial_uid(t)))
        self.entries.extend(out)
        for e in out:
            self._first.setdefault(e.trial.strategy.fingerprint, e)
        return out

    def _derive(self, strategies, proposals) -> None:
        """Encoded rows, canonical keys and feature rows of the strategies not known yet (those
        without a proposal's row encoded here, those without its feature row featurized in one call)."""
        given = {p.strategy.fingerprint: p for p in proposals}
        todo: dict[str, tuple] = {}   # fingerprint -> (strategy, encoded row or None, feature row or None)
        for s in strategies:
            fp = s.fingerprint
            if fp in self._known or fp in todo:
                continue
            p = given.get(fp)
            row = p.encoded if p is not None and p.encoded is not None else self._encode(s)
            todo[fp] = (s, row, getattr(p, "features", None) if p is not None else None)
        missing = [fp for fp, (_, row, X) in todo.items() if row is not None and X is None]
        if missing:
            if self._tables is None:
                self._tables = FeatureTables.from_specs(self.model, self.cluster)
            X = featurize(self._tables, EncodedStrategies.concat([todo[fp][1] for fp in missing]))
            for fp, x in zip(missing, X):
                todo[fp] = (todo[fp][0], todo[fp][1], x)
        for fp, (s, row, x) in todo.items():
            fkey = None if x is None else feature_keys(x[None, :])[0]
            self._known[fp] = _Known(row, None if row is None else row.row_keys()[0],
                                     s.canonical(self.cluster).fingerprint, x, fkey)

    def _encode(self, strategy) -> EncodedStrategies | None:
        if self._space is None:
            self._space = StrategySpace(self.model, self.cluster)
        try:   # encoding depends on the model and cluster only, not on the space's options
            return self._space.encode([strategy])
        except (ConfigError, KeyError):
            return None

    # ---- reading --------------------------------------------------------------------------------
    def latest_seconds(self) -> dict[bytes, float]:
        """Encoded key -> the median of its latest measurement (inf: failed), keys in order of
        first measurement (strategies outside the encoded space have no key)."""
        return {e.key: (e.trial.median if e.trial.ok else float("inf")) for e in self.entries if e.key is not None}

    def canonical_keys(self) -> set[str]:
        """Canonical fingerprints of every strategy measured."""
        return {e.canonical for e in self.entries}

    def feature_keys(self) -> set[bytes]:
        """Feature keys of every strategy measured (those in the encoded space)."""
        return {e.feature_key for e in self.entries if e.feature_key is not None}

    def entry(self, fingerprint: str) -> HistoryEntry | None:
        """The first entry of the strategy with this fingerprint, or None."""
        return self._first.get(fingerprint)

    # ---- a sequence of trials --------------------------------------------------------------------
    @overload
    def __getitem__(self, i: int) -> Trial: ...

    @overload
    def __getitem__(self, i: slice) -> list[Trial]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [e.trial for e in self.entries[i]]
        return self.entries[i].trial

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Trial]:
        return (e.trial for e in self.entries)

    def __eq__(self, other) -> bool:
        return isinstance(other, (History, list)) and list(self) == list(other)

    __hash__ = None   # mutable

    def __repr__(self) -> str:
        return f"History({len(self)} trials)"

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self if t.ok]


def feature_keys(X: np.ndarray) -> list[bytes]:
    """One hashable key per feature row (float32, rounded to 6 significant digits: rows computed
    in different batches may differ in the last bit)."""
    rounded = np.asarray(X, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(rounded != 0, 10.0 ** (5 - np.floor(np.log10(np.abs(rounded)))), 1.0)
    return [r.tobytes() for r in np.round(rounded * scale) / scale]

