"""Training data for the learned models: trials turned into feature rows, and the transferable
(relative) view of those rows.

Raw features carry absolute bytes and seconds, which differ by orders of magnitude between models
and clusters; the learned models read ``relative_view`` instead: times divided by the compute time
(and their logs), bytes divided by the model's gradient bytes, counts and fractions as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.encoding import EncodedStrategies
from strategy_space.errors import ConfigError
from strategy_space.space import StrategySpace

from tuner.features.tables import FeatureTables

from tuner.features.batch import COL, featurize
from tuner.records.trial import Trial

_TIMES = ("wire_s", "nic_in_s", "nic_out_s", "intra_s", "ar_ring_s", "comm_s", "analytic_s", "cpu_s")
_BYTES = ("ps_push_max_node_bytes", "ps_push_sum_bytes", "ps_pull_max_node_bytes", "ps_pull_sum_bytes",
          "server_bytes_max", "lr_saved_bytes", "sparse_ps_bytes", "ar_raw_bytes", "ar_wire_bytes",
          "ar_ring_bytes", "ar_max_group_bytes", "compressed_saved_bytes", "fp16_raw_bytes",
          "powersgd_raw_bytes", "sparse_allgather_bytes", "cpu_bytes_max", "ps_update_bytes_max", "local_agg_bytes")
_AS_IS = ("num_workers", "num_nodes", "nodes_with_workers", "ps_share", "ps_vars_frac", "ps_imbalance",
          "ps_nodes_used", "ps_latency_rounds", "ar_groups", "ar_collectives", "staleness", "stale_factor",
          "async", "exposed_frac", "ps_calls_max", "cpu_contention", "hierarchical")
RELATIVE_NAMES = (tuple(f"{n}/compute" for n in _TIMES) + ("log_compute_s", "log_analytic_s", "log_comm_s",
                  "ring_steps*alpha/compute", "ring_steps_os*alpha/compute", "ps_rounds*alpha/compute")
                  + tuple(f"{n}/model" for n in _BYTES) + _AS_IS)


def relative_view(X: np.ndarray) -> np.ndarray:
    """Transferable features (``RELATIVE_NAMES``) of raw feature rows (``features.batch.FEATURE_NAMES``)."""
    c = np.maximum(X[:, COL["compute_s"]], 1e-9)[:, None]
    mb = np.maximum(X[:, COL["model_bytes"]], 1.0)[:, None]
    parts = [
        X[:, [COL[n] for n in _TIMES]] / c,
        np.log(np.maximum(X[:, [COL["compute_s"], COL["analytic_s"], COL["comm_s"]]], 1e-9)),
        # the collectives' step latency: a CPU ring's step at 0.1 ms, an NCCL ring's at 10 us
        (X[:, [COL["ring_steps"]]] * 1e-4 + X[:, [COL["nccl_ring_steps"]]] * 1e-5) / c,
        X[:, [COL["ring_steps_objectstore"]]] * 7e-4 / c,
        X[:, [COL["ps_latency_rounds"]]] * 7e-4 / c,
        X[:, [COL[n] for n in _BYTES]] / mb,
        X[:, [COL[n] for n in _AS_IS]],
    ]
    return np.concatenate(parts, axis=1).astype(np.float32)


@dataclass
class TrialSet:
    """Feature rows of measured (ok) trials, with their group ids.

    Attributes:
        X: raw features (rows, len(FEATURE_NAMES)).
        y: median step time of each trial (s).
        group: group index of each row (into ``keys``).
        keys: (model fingerprint, cluster fingerprint) per group.
        model_names: the model name of each group (for leave-one-model-out).
    """

    X: np.ndarray
    y: np.ndarray
    group: np.ndarray
    keys: list
    model_names: list

    def subset(self, rows: np.ndarray) -> "TrialSet":
        return TrialSet(self.X[rows], self.y[rows], self.group[rows], self.keys, self.model_names)

    def __len__(self) -> int:
        return len(self.y)


def featurize_trials(model: ModelSpec, cluster: ClusterSpec, trials: Sequence[Trial],
                     cache: dict | None = None, *, space: StrategySpace | None = None,
                     tables: FeatureTables | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Raw features and median times of the ok, encodable trials of one group.

    Args:
        cache: a dict kept between calls (e.g. by a Predictor refitted every round): the feature
            row of every featurized strategy of this (model, cluster), so each is computed once.
        space, tables: this group's ``StrategySpace`` and ``FeatureTables``, for a caller that
            featurizes the same group every round (built here when not given).
    """
    cache = {} if cache is None else cache
    group = (model.fingerprint, cluster.fingerprint)
    todo: dict[tuple, Trial] = {}
    keys, ys = [], []
    for t in trials:
        if not t.ok:
            continue
        key = group + (t.strategy.fingerprint,)
        if key not in cache:
            todo.setdefault(key, t)
        keys.append(key)
        ys.append(t.median)
    if todo:
        _featurize_into(cache, model, cluster, todo, space, tables)
    rows = [(cache[k], y) for k, y in zip(keys, ys) if cache[k] is not None]
    if not rows:
        return np.zeros((0, len(COL)), dtype=np.float32), np.zeros(0)
    return np.stack([r for r, _ in rows]), np.asarray([y for _, y in rows], dtype=np.float64)


def _featurize_into(cache: dict, model: ModelSpec, cluster: ClusterSpec, todo: dict, space, tables) -> None:
    """Feature rows of ``todo`` (key -> trial) into ``cache``: encoded in one batch, or one by one
    when the batch holds a strategy outside the encodable subspace (its row is None)."""
    space = space or StrategySpace(model, cluster)
    strategies = [t.strategy for t in todo.values()]
    try:
        encoded, keys = space.encode(strategies), list(todo)
    except ConfigError:
        parts, keys = [], []
        for key, s in zip(todo, strategies):
            try:
                parts.append(space.encode([s]))
                keys.append(key)
            except ConfigError:
                cache[key] = None  # outside the encodable subspace: cannot be featurized
        if not parts:
            return
        encoded = EncodedStrategies.concat(parts)
    X = featurize(tables or FeatureTables.from_specs(model, cluster), encoded)
    for key, row in zip(keys, X):
        cache[key] = row


def build_trial_set(groups: Iterable[tuple[ModelSpec, ClusterSpec, Sequence[Trial]]],
                    cache: dict | None = None) -> TrialSet:
    """Stack the featurized trials of many (model, cluster, trials) groups (``cache``: see
    ``featurize_trials``)."""
    Xs, ys, gs, keys, names = [], [], [], [], []
    for model, cluster, trials in groups:
        X, y = featurize_trials(model, cluster, trials, cache)
        if not len(y):
            continue
        gs.append(np.full(len(y), len(keys)))
        keys.append((model.fingerprint, cluster.fingerprint))
        names.append(model.name)
        Xs.append(X)
        ys.append(y)
    if not Xs:
        raise ValueError("no ok trials to learn from")
    return TrialSet(np.concatenate(Xs), np.concatenate(ys), np.concatenate(gs), keys, names)


def store_groups(store) -> list[tuple[ModelSpec, ClusterSpec, list[Trial]]]:
    """(model, cluster, trials) of every group of a TrialStore whose specs it holds."""
    out = []
    for mfp, cfp, _ in store.groups():
        model, cluster = store.model(mfp), store.cluster(cfp)
        if model is not None and cluster is not None:
            out.append((model, cluster, store.trials_for(mfp, cfp)))
    return out
