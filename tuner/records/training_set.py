"""The model-based tuner's training data, in memory: featurized rows of every measured trial, by
(model, cluster) group, appended as trials arrive.

The store is read once at the start of a run (warm-start groups, then the store's groups:
``add_groups``); after that the run's trials come as ``History`` entries (``tuner.records.history``),
featurized once when they arrived (``add_entries``), so a refit costs no featurization and no
re-read of the store. A trial seen twice (a store that imported the warm-start dataset, a resumed
run's trials) counts once (``store.trial_uid``). The rows and their order are those of
``dataset.build_trial_set`` over the same trials: groups in first-seen order, trials in arrival order.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.space import StrategySpace

from tuner.features.tables import FeatureTables
from tuner.records.dataset import TrialSet, featurize_trials
from tuner.records.history import HistoryEntry
from tuner.records.store import trial_uid
from tuner.records.trial import Trial
from tuner.records.warmstart import Group


class _GroupRows:
    def __init__(self, model: ModelSpec, cluster: ClusterSpec):
        self.model, self.cluster = model, cluster
        self.X: list[np.ndarray] = []
        self.y: list[float] = []
        self.cache: dict = {}   # featurize_trials' feature row of each strategy of the group
        self._space: StrategySpace | None = None
        self._tables: FeatureTables | None = None

    def featurize(self, trials: Sequence[Trial]) -> tuple[np.ndarray, np.ndarray]:
        """``featurize_trials`` with this group's space and tables, built on first use and kept."""
        if self._space is None:
            self._space = StrategySpace(self.model, self.cluster)
            self._tables = FeatureTables.from_specs(self.model, self.cluster)
        return featurize_trials(self.model, self.cluster, trials, self.cache, space=self._space,
                                tables=self._tables)


class TrainingSet:
    """Featurized ok trials of many (model, cluster) groups; append-only."""

    def __init__(self):
        self._groups: dict[tuple[str, str], _GroupRows] = {}
        self._uids: set[str] = set()
        self._data: TrialSet | None = None

    def add_groups(self, groups: Sequence[Group]) -> int:
        """Add (model, cluster, trials) groups (the warm-start dataset, the store at start); returns
        how many trials were new."""
        return sum(self.add(model, cluster, trials) for model, cluster, trials in groups)

    def add(self, model: ModelSpec, cluster: ClusterSpec, trials: Sequence[Trial]) -> int:
        """Append the ok, encodable trials of one group (others only count as seen); returns the
        number of trials not seen before."""
        group = self._group(model, cluster)
        new = []
        for t in trials:
            uid = trial_uid(t)
            if uid not in self._uids:
                self._uids.add(uid)
                new.append(t)
        X, y = group.featurize(new)
        self._append(group, X, y)
        return len(new)

    def add_entries(self, model: ModelSpec, cluster: ClusterSpec, entries: Sequence[HistoryEntry]) -> int:
        """Append the rows of a run's history entries not seen before (their feature rows were
        computed when they arrived: nothing is featurized here); returns how many were new."""
        group = self._group(model, cluster)
        rows, y, new = [], [], 0
        for e in entries:
            if e.uid in self._uids:
                continue
            self._uids.add(e.uid)
            new += 1
            if e.trial.ok and e.features is not None:
                rows.append(e.features)
                y.append(e.trial.median)
        if rows:
            self._append(group, np.stack(rows), y)
        return new

    def _group(self, model: ModelSpec, cluster: ClusterSpec) -> _GroupRows:
        key = (model.fingerprint, cluster.fingerprint)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _GroupRows(model, cluster)
        return group

    def _append(self, group: _GroupRows, X: np.ndarray, y) -> None:
        if len(y):
            group.X.append(X)
            group.y.extend(y)
            self._data = None

    def trial_set(self) -> TrialSet | None:
        """Every row so far as one TrialSet (groups without rows left out), or None when empty."""
        if self._data is None:
            Xs, ys, gs, keys, names = [], [], [], [], []
            for key, g in self._groups.items():
                if not g.y:
                    continue
                gs.append(np.full(len(g.y), len(keys)))
                keys.append(key)
                names.append(g.model.name)
                Xs.append(np.concatenate(g.X))
                ys.append(np.asarray(g.y, dtype=np.float64))
            if not Xs:
                return None
            self._data = TrialSet(np.concatenate(Xs), np.concatenate(ys), np.concatenate(gs), keys, names)
        return self._data

    def __len__(self) -> int:
        return sum(len(g.y) for g in self._groups.values())
