"""The model-based tuner's training data, in memory: featurized rows of every measured trial, by
(model, cluster) group, appended as trials arrive.

The store is read once at the start of a run (warm-start groups, then the store's groups:
``add_groups``); after that each measured trial is featurized once when it arrives (``add``, from
its proposal's encoded row when there is one), so a refit costs the new trials' featurization, not a
re-read of the store. A trial seen twice (a store that imported the warm-start dataset, a resumed
run's trials) counts once (``store.trial_uid``). The rows and their order are those of
``dataset.build_trial_set`` over the same trials: groups in first-seen order, trials in arrival order.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.encoding import EncodedStrategies

from .dataset import TrialSet, featurize_trials
from .feature_tables import FeatureTables
from .features import featurize
from .store import trial_uid
from .trial import Trial
from .warmstart import Group


class _GroupRows:
    def __init__(self, model: ModelSpec, cluster: ClusterSpec):
        self.model, self.cluster = model, cluster
        self.X: list[np.ndarray] = []
        self.y: list[float] = []
        self.cache: dict = {}   # featurize_trials' feature row of each strategy of the group


class TrainingSet:
    """Featurized ok trials of many (model, cluster) groups; append-only."""

    def __init__(self):
        self._groups: dict[tuple[str, str], _GroupRows] = {}
        self._uids: set[str] = set()
        self._data: TrialSet | None = None
        self._tables: dict[tuple[str, str], FeatureTables] = {}

    def add_groups(self, groups: Sequence[Group]) -> int:
        """Add (model, cluster, trials) groups (the warm-start dataset, the store at start); returns
        how many trials were new."""
        return sum(self.add(model, cluster, trials) for model, cluster, trials in groups)

    def add(self, model: ModelSpec, cluster: ClusterSpec, trials: Sequence[Trial],
            encoded: Mapping[str, EncodedStrategies] | None = None) -> int:
        """Append the ok, encodable trials of one group (others only count as seen).

        Args:
            encoded: strategy fingerprint -> its encoded row, for strategies the caller encoded
                already (a proposal's); the others are encoded here.

        Returns:
            the number of trials not seen before.
        """
        key = (model.fingerprint, cluster.fingerprint)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _GroupRows(model, cluster)
        new = []
        for t in trials:
            uid = trial_uid(t)
            if uid not in self._uids:
                self._uids.add(uid)
                new.append(t)
        if encoded:
            self._prefeaturize(group, [t for t in new if t.ok], encoded)
        X, y = featurize_trials(model, cluster, new, group.cache)
        if len(y):
            group.X.append(X)
            group.y.extend(y)
            self._data = None
        return len(new)

    def _prefeaturize(self, group: _GroupRows, trials: list[Trial], encoded: Mapping[str, EncodedStrategies]) -> None:
        """Feature rows of strategies whose encoded rows are given, into the group's cache."""
        todo = {}
        for t in trials:
            key = (group.model.fingerprint, group.cluster.fingerprint, t.strategy.fingerprint)
            row = encoded.get(t.strategy.fingerprint)
            if key not in group.cache and row is not None:
                todo[key] = row
        if todo:
            gkey = (group.model.fingerprint, group.cluster.fingerprint)
            tables = self._tables.get(gkey)
            if tables is None:
                tables = self._tables[gkey] = FeatureTables.from_specs(group.model, group.cluster)
            X = featurize(tables, EncodedStrategies.concat(list(todo.values())))
            for key, row in zip(todo, X):
                group.cache[key] = row

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
