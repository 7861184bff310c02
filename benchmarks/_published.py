"""Published tables: loading, scoring, and the leave-one-table-out fit of the analytic model.

A table (``benchmarks/published/*.yaml``) is one published comparison of synchronization strategies
on one model and cluster (see ``published_tables.py``). Scoring compares predicted with published
step times relative to the table's reference strategy:

* pairwise order agreement over the pairs whose published figures differ by at least ``min_gap``
  (5 %: closer figures order nothing that a measurement could tell); a predicted tie is a miss;
* ratio error ``predicted_rel / published_rel - 1`` of every strategy but the reference.

Leave one out: for each table in turn, the analytic model's parameters (``tuner.features.alpha_beta.AlphaBeta``:
per-call and per-ring-step latencies, bandwidth efficiency, CPU byte rate, per-call server time,
compute scale) are fitted on the relative step times of every other table, and the held-out table
is scored with them. The fit never sees the held-out table; ``leave_one_out`` takes the fit and
score functions as arguments so a test can prove that with fakes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Callable, Sequence

import numpy as np

from strategy_space import ClusterSpec, ComputeProfile, ConfigError, load_model_spec
from strategy_space.builders import get_builder
from strategy_space.space import StrategySpace
from strategy_space.yaml_io import parse_text, read_text
from tuner.features.alpha_beta import AlphaBeta, step_time
from tuner.features.batch import featurize, terms_of
from tuner.features.tables import FeatureTables

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_KEYS = {"source", "model", "batch_size", "compute", "cluster", "reference", "strategies"}
OPTIONAL_KEYS = {"sparse_rows_per_step"}   # {variable: unique rows a worker touches per step at this batch}
SOURCE_KEYS = {"citation", "where", "quote", "notes"}
STRATEGY_KEYS = {"name", "builder", "options", "published"}
MIN_GAP = 0.05           # pairs whose published figures are closer than this are excluded
RIDGE = 0.1              # pull of each log-parameter towards its physical default, per table of data
BOUND = np.log(30.0)     # a fitted parameter stays within 30x of its default


def load_table(path: str) -> dict:
    """A published table: its specs built and its strategies built by their builders.

    Raises:
        ConfigError: a missing or unknown key, an empty quote, a reference that is not a strategy,
            a bad spec or builder option.
    """
    data = parse_text(read_text(path), path) or {}
    keys = set(data)
    if not TABLE_KEYS <= keys <= TABLE_KEYS | OPTIONAL_KEYS:
        raise ConfigError(f"{path}: keys must be {sorted(TABLE_KEYS)} (optional {sorted(OPTIONAL_KEYS)}); missing "
                          f"{sorted(TABLE_KEYS - keys)}, unknown {sorted(keys - TABLE_KEYS - OPTIONAL_KEYS)}")
    source = data["source"] or {}
    if set(source) != SOURCE_KEYS or not all(isinstance(source[k], str) and source[k].strip() for k in SOURCE_KEYS):
        raise ConfigError(f"{path}: source must have non-empty {sorted(SOURCE_KEYS)}, got {sorted(source)}")
    model = load_model_spec(os.path.join(os.path.dirname(path), data["model"]))
    rows = data.get("sparse_rows_per_step") or {}
    unknown = set(rows) - {v.name for v in model.variables if v.sparse}
    if unknown:
        raise ConfigError(f"{path}: sparse_rows_per_step names {sorted(unknown)}, not sparse variables of the model")
    variables = tuple(replace(v, rows_per_step=int(rows[v.name])) if v.name in rows else v for v in model.variables)
    model = replace(model, variables=variables, batch_size=int(data["batch_size"]),
                    profile=ComputeProfile(float(data["compute"]["step_time_s"]), device="published constants"))
    cluster = ClusterSpec.from_dict(data["cluster"])
    rows = data["strategies"]
    for r in rows:
        if set(r) != STRATEGY_KEYS:
            raise ConfigError(f"{path}: a strategy needs exactly {sorted(STRATEGY_KEYS)}, got {sorted(r)}")
        if not float(r["published"]) > 0:
            raise ConfigError(f"{path}: strategy {r['name']!r}: published must be > 0, got {r['published']!r}")
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: strategy names repeat: {names}")
    if data["reference"] not in names:
        raise ConfigError(f"{path}: reference {data['reference']!r} is not one of the strategies {names}")
    # builder "none": the same compute without any communication (what scaling efficiency compares with)
    strategies = [None if r["builder"] == "none" else get_builder(r["builder"], **(r["options"] or {})).build(
        model, cluster) for r in rows]
    return {"path": os.path.relpath(path, REPO), "source": source, "model": model, "cluster": cluster,
            "reference": data["reference"], "names": names, "strategies": strategies,
            "published": np.array([float(r["published"]) for r in rows])}


@dataclass
class TableTerms:
    """What predicting a table's step times needs, computed once: the alpha-beta terms of its
    strategies (``tuner.features.batch``), where they sit in the table, and the compute time."""

    path: str
    names: list
    ref: int
    published_rel: np.ndarray
    compute_s: float
    synced: np.ndarray          # indices of the strategies that communicate
    terms: dict | None

    @classmethod
    def of(cls, table: dict) -> "TableTerms":
        model, cluster = table["model"], table["cluster"]
        synced = [i for i, s in enumerate(table["strategies"]) if s is not None]
        terms = None
        if synced:
            enc = StrategySpace(model, cluster).encode([table["strategies"][i] for i in synced])
            terms = terms_of(featurize(FeatureTables.from_specs(model, cluster), enc))
        ref = table["names"].index(table["reference"])
        return cls(table["path"], table["names"], ref, table["published"] / table["published"][ref],
                   model.profile.step_time_s, np.array(synced, dtype=int), terms)

    def predict_s(self, params: AlphaBeta) -> np.ndarray:
        """Predicted seconds per step of every strategy (compute alone for builder ``none``)."""
        out = np.full(len(self.names), params.compute_scale * self.compute_s)
        if self.terms is not None:
            out[self.synced] = step_time(self.terms, params)
        return out


def order_and_errors(predicted_rel: np.ndarray, published_rel: np.ndarray, ref: int,
                     min_gap: float = MIN_GAP) -> tuple[int, int, np.ndarray]:
    """(pairs, pairs agreeing, ratio errors of the non-reference strategies).

    A pair counts when its published figures differ by at least ``min_gap`` (relative to the
    smaller); it agrees when the prediction orders it the same way (a predicted tie does not)."""
    n = len(published_rel)
    total = agree = 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = published_rel[i], published_rel[j]
            if abs(a - b) < min_gap * min(a, b):
                continue
            total += 1
            agree += (predicted_rel[i] - predicted_rel[j]) * (a - b) > 0
    others = [i for i in range(n) if i != ref]
    return total, int(agree), predicted_rel[others] / published_rel[others] - 1.0


def score(tt: TableTerms, params: AlphaBeta, min_gap: float = MIN_GAP) -> dict:
    """Predicted vs published relative step times of one table under ``params``."""
    predicted_s = tt.predict_s(params)
    predicted = predicted_s / predicted_s[tt.ref]
    pairs, agree, errors = order_and_errors(predicted, tt.published_rel, tt.ref, min_gap)
    return {"table": tt.path, "strategies": tt.names, "predicted_s": predicted_s.tolist(),
            "predicted": predicted.tolist(), "published": tt.published_rel.tolist(), "pairs": pairs,
            "pairs_agreeing": agree, "ratio_errors": errors.tolist(),
            "median_abs_ratio_error": float(np.median(np.abs(errors))) if len(errors) else float("nan")}


def fit_params(train: Sequence[TableTerms], prior: AlphaBeta | None = None, ridge: float = RIDGE,
               loss: str = "linear") -> AlphaBeta:
    """AlphaBeta fitted to the relative step times of ``train`` (never anything else).

    Least squares on log(predicted_rel) - log(published_rel) of every non-reference strategy, each
    table weighted equally, plus a ridge pull of every log-parameter towards ``prior`` (the
    physical defaults): relative times cannot pin all seven parameters (a common scale of compute
    and communication cancels), and the ridge keeps what the data do not identify where it was.
    """
    from scipy.optimize import least_squares

    prior = prior or AlphaBeta()
    theta0 = prior.to_vector()
    train = list(train)
    lam = np.sqrt(ridge * max(len(train), 1))

    def residuals(theta):
        p = AlphaBeta.from_vector(theta)
        parts = []
        for tt in train:
            s = tt.predict_s(p)
            others = np.arange(len(s)) != tt.ref
            r = np.log(s[others] / s[tt.ref]) - np.log(tt.published_rel[others])
            parts.append(r / np.sqrt(max(len(r), 1)))
        parts.append(lam * (theta - theta0))
        return np.concatenate(parts)

    if not train:
        return prior
    res = least_squares(residuals, theta0, bounds=(theta0 - BOUND, theta0 + BOUND), diff_step=1e-4, max_nfev=200,
                        loss=loss, f_scale=0.1)
    return AlphaBeta.from_vector(res.x)


RIDGES = (0.1, 1.0, 10.0, 100.0)   # the ridge strengths the inner leave-one-out chooses from


def select_by_inner_loo(train: Sequence, fits: dict, score_one: Callable[[object, object], dict]) -> tuple:
    """Choose among ``fits`` (label -> fit function of a list of tables) the one whose own
    leave-one-out over ``train`` has the least median |ratio error| (ties: the later label, so
    order ``fits`` from least to most regularized), and fit it on all of ``train``: what is
    chosen is chosen on ``train`` alone, so an outer leave-one-out stays honest.

    Returns:
        (label, fitted on all of ``train``, {label: inner median |ratio error|}).
    """
    inner = {}
    for label, fit in fits.items():   # one choice, or one table: nothing to choose by
        inner[label] = summary(leave_one_out(list(train), fit, score_one))["median_abs_ratio_error"] \
            if len(train) > 1 and len(fits) > 1 else float("nan")
    finite = {k: v for k, v in inner.items() if np.isfinite(v)}
    label = min(reversed(list(finite)), key=finite.get) if finite else list(fits)[-1]
    return label, fits[label](list(train)), inner


def fit_params_selected(train: Sequence[TableTerms], min_gap: float = MIN_GAP, ridges: Sequence[float] = RIDGES
                        ) -> "SelectedFit":
    """``fit_params`` with the ridge strength chosen by leave-one-out within ``train``
    (``select_by_inner_loo``): where fitting some tables does not predict another better, the
    strongest pull keeps the physical defaults."""
    fits = {r: (lambda tables, r=r: fit_params(tables, ridge=r)) for r in sorted(ridges)}
    ridge, fitted, inner = select_by_inner_loo(train, fits, lambda tt, p: score(tt, p, min_gap))
    return SelectedFit(fitted, ridge, inner)


@dataclass(frozen=True)
class SelectedFit:
    """Parameters fitted with a ridge chosen by inner leave-one-out, and how it was chosen."""

    params: AlphaBeta
    ridge: float
    inner_errors: dict


def leave_one_out(tables: Sequence, fit: Callable[[list], object], score_one: Callable[[object, object], dict]
                  ) -> list[dict]:
    """For each table in turn: ``fit`` on all the others, ``score_one(held_out, fitted)``.

    Returns:
        one score per table, in order, each with the fitted quantity under ``"fitted"``.
    """
    out = []
    for i, held_out in enumerate(tables):
        fitted = fit([t for j, t in enumerate(tables) if j != i])
        r = score_one(held_out, fitted)
        r["fitted"] = fitted
        out.append(r)
    return out


def summary(results: Sequence[dict]) -> dict:
    """Overall pairwise order agreement and median absolute ratio error of scored tables."""
    pairs = sum(r["pairs"] for r in results)
    agree = sum(r["pairs_agreeing"] for r in results)
    errors = np.concatenate([np.asarray(r["ratio_errors"], dtype=float) for r in results] or [np.zeros(0)])
    return {"tables": len(results), "pairs": pairs, "pairs_agreeing": agree,
            "order_agreement": agree / pairs if pairs else float("nan"),
            "median_abs_ratio_error": float(np.median(np.abs(errors))) if len(errors) else float("nan"),
            "worst_abs_ratio_error": float(np.abs(errors).max()) if len(errors) else float("nan")}


def params_dict(p: AlphaBeta) -> dict:
    return {f.name: getattr(p, f.name) for f in fields(p)}
