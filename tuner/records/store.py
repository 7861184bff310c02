"""TrialStore: every trial ever measured, in one SQLite file.

The file is opened in WAL mode, so readers in other processes never block the writer and never
see a half-written trial; every insert of a trial (with its strategy and, when given, its model
and cluster specs) is one transaction, so a crash at any moment keeps every committed trial and
nothing of the one in flight. Trials are append-only; each has a content hash (``uid``) so merging
stores (``import_store``) never duplicates a measurement.

Tables: ``models`` and ``clusters`` (fingerprint -> name and spec YAML), ``strategies``
(fingerprint -> canonical YAML), ``trials`` (one row per measurement), ``probes`` (statistical-efficiency
probes, ``tuner.records.goodput``, by cache key), ``info`` (schema version).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sqlite3
import sys
import time
from typing import Iterable

from strategy_space import ClusterSpec, ModelSpec, Strategy, dumps, loads
from strategy_space.errors import ConfigError, short_repr

from tuner.records.goodput import ProbeResult
from tuner.records.store_file import SCHEMA_VERSION, StoreError, check_store_file, store_error, write_error
from tuner.records.trial import Trial

_SCHEMA = """
CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (fingerprint TEXT PRIMARY KEY, name TEXT NOT NULL, spec_yaml TEXT NOT NULL,
                                   added_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS clusters (fingerprint TEXT PRIMARY KEY, name TEXT NOT NULL, spec_yaml TEXT NOT NULL,
                                     added_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS strategies (fingerprint TEXT PRIMARY KEY, yaml TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS trials (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    uid TEXT NOT NULL UNIQUE,
    model_fp TEXT NOT NULL, cluster_fp TEXT NOT NULL,
    strategy_fp TEXT NOT NULL REFERENCES strategies(fingerprint),
    status TEXT NOT NULL, median_s REAL, step_times TEXT NOT NULL, error TEXT NOT NULL,
    batch_size INTEGER NOT NULL, breakdown TEXT NOT NULL, origin TEXT NOT NULL,
    started_at REAL NOT NULL, finished_at REAL NOT NULL, meta TEXT NOT NULL, env TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS trials_group ON trials (model_fp, cluster_fp);
CREATE INDEX IF NOT EXISTS trials_strategy ON trials (model_fp, cluster_fp, strategy_fp);
CREATE TABLE IF NOT EXISTS probes (key TEXT PRIMARY KEY, model_key TEXT NOT NULL, lossy_key TEXT NOT NULL,
                                   result TEXT NOT NULL, added_at REAL NOT NULL);
"""
_TRIAL_COLS = ("uid", "model_fp", "cluster_fp", "strategy_fp", "status", "median_s", "step_times", "error",
               "batch_size", "breakdown", "origin", "started_at", "finished_at", "meta", "env")


def open_existing_store(path: str | os.PathLike) -> "TrialStore":
    """Open a trial store that must already exist and hold the tables (for commands that only
    read one: a missing, empty or damaged file is an error and is not created or changed).

    Raises:
        StoreError: as ``check_store_file``, or the file is missing or empty.
    """
    path = os.path.expanduser(os.fspath(path))
    check_store_file(path)
    if not os.path.isfile(path):
        raise StoreError(f"trial store not found: {path} (give the path of an existing trial store file)")
    if os.path.getsize(path) == 0:
        raise store_error(path, "the file is empty")
    return TrialStore(path)


def runtime_versions() -> dict:
    """Python, platform and library versions; TensorFlow and Ray only if the process loaded them
    (the tuner never imports them)."""
    env = {"python": platform.python_version(), "platform": platform.platform()}
    for name in ("numpy", "xgboost", "tensorflow", "keras", "ray", "autosync"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__version__", None):
            env[name] = str(mod.__version__)
    return env


def canonical_yaml(strategy: Strategy) -> str:
    """YAML of ``strategy`` without its origin (the origin is stored per trial)."""
    return dumps(Strategy(strategy.variables, strategy.replicas))


def trial_uid(t: Trial) -> str:
    """Content hash of a measurement: equal for the same trial in two stores."""
    key = json.dumps([t.model_fingerprint, t.cluster_fingerprint, t.strategy.fingerprint, t.status,
                      list(t.step_times), t.error, t.started_at, t.finished_at], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class TrialStore:
    """Trials in one SQLite file (see module doc). Usable as a context manager.

    Args:
        path: the database file (created with its tables if missing).
        timeout_s: how long to wait for another writer's lock.

    Raises:
        StoreError: ``path`` is not a trial store or is damaged (``check_store_file``); the file
            is left as it was.
    """

    def __init__(self, path: str | os.PathLike, timeout_s: float = 30.0):
        self.path = os.path.expanduser(os.fspath(path))
        self._parsed: dict[str, Strategy] = {}
        # (table, fingerprint) of the specs this store has committed: a spec is immutable, so it is
        # written (and dumped to YAML) once, not with every trial
        self._specs_stored: set[tuple[str, str]] = set()
        check_store_file(self.path)
        self._db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
        try:
            self._open()
        except (sqlite3.DatabaseError, UnicodeDecodeError, StoreError) as e:
            self._db.close()
            if isinstance(e, StoreError):
                raise
            if isinstance(e, sqlite3.OperationalError):   # a full disk, a read-only folder, a lock
                raise write_error(self.path, e) from None
            raise store_error(self.path, f"SQLite cannot use it ({e})") from None

    def _open(self) -> None:
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._tx():
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            self._db.execute("INSERT OR IGNORE INTO info VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        found = self._db.execute("SELECT value FROM info WHERE key='schema_version'").fetchone()[0]
        if str(found) != str(SCHEMA_VERSION):
            self._db.close()
            raise store_error(self.path, f"it has schema version {str(found)[:20]}, this AutoSync reads "
                              f"{SCHEMA_VERSION}")

    # ---- plumbing ---------------------------------------------------------------------------
    class _Tx:
        """One write transaction. A write SQLite refuses (a full disk, a read-only file, a lock
        held past the timeout) is rolled back and raised as a ``StoreError`` naming the store."""

        def __init__(self, store: "TrialStore"):
            self.db, self.path = store._db, store.path

        def __enter__(self):
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                raise write_error(self.path, e) from None

        def __exit__(self, exc_type, exc, _tb):
            try:
                if exc_type is None:
                    self.db.execute("COMMIT")
            except sqlite3.OperationalError as e:
                exc = e
            if self.db.in_transaction:   # (SQLite has rolled back some failed writes itself)
                self.db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError):
                raise write_error(self.path, exc) from None

    def _tx(self) -> "_Tx":
        return self._Tx(self)

    def close(self) -> None:
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- writing ----------------------------------------------------------------------------
    def _new_specs(self, *pairs) -> list[tuple[str, object]]:
        """The (table, spec) pairs this store has not committed yet (specs None are left out)."""
        return [(table, spec) for table, spec in pairs
                if spec is not None and (table, spec.fingerprint) not in self._specs_stored]

    def _put_specs(self, specs: list[tuple[str, object]]) -> None:
        for table, spec in specs:
            self._db.execute(f"INSERT OR IGNORE INTO {table} VALUES (?, ?, ?, ?)",
                             (spec.fingerprint, spec.name, dumps(spec), time.time()))

    def _committed(self, specs: list[tuple[str, object]]) -> None:
        self._specs_stored.update((table, spec.fingerprint) for table, spec in specs)

    def add_model(self, model: ModelSpec) -> str:
        new = self._new_specs(("models", model))
        with self._tx():
            self._put_specs(new)
        self._committed(new)
        return model.fingerprint

    def add_cluster(self, cluster: ClusterSpec) -> str:
        new = self._new_specs(("clusters", cluster))
        with self._tx():
            self._put_specs(new)
        self._committed(new)
        return cluster.fingerprint

    def _row(self, t: Trial, env: dict) -> tuple:
        return (trial_uid(t), t.model_fingerprint, t.cluster_fingerprint, t.strategy.fingerprint, t.status,
                t.median if t.ok else None, json.dumps(list(t.step_times)), t.error, t.batch_size,
                json.dumps(t.breakdown, sort_keys=True), t.origin, t.started_at, t.finished_at,
                json.dumps(t.stored_meta(), sort_keys=True, default=str), json.dumps(env, sort_keys=True))

    def _insert(self, t: Trial, env: dict, yaml_text: str | None = None) -> bool:
        self._db.execute("INSERT OR IGNORE INTO strategies VALUES (?, ?)",
                         (t.strategy.fingerprint, yaml_text or canonical_yaml(t.strategy)))
        cur = self._db.execute(f"INSERT OR IGNORE INTO trials ({', '.join(_TRIAL_COLS)}) VALUES "
                               f"({', '.join('?' * len(_TRIAL_COLS))})", self._row(t, env))
        return cur.rowcount == 1

    def add(self, trial: Trial, model: ModelSpec | None = None, cluster: ClusterSpec | None = None) -> bool:
        """Append one trial (and its strategy, model and cluster) in one transaction.

        Returns:
            False when the identical measurement is already stored.

        Raises:
            ValueError: ``model``/``cluster`` do not match the trial's fingerprints.
        """
        for spec, fp, what in ((model, trial.model_fingerprint, "model"), (cluster, trial.cluster_fingerprint, "cluster")):
            if spec is not None and spec.fingerprint != fp:
                raise ValueError(f"{what} {spec.name} has fingerprint {spec.fingerprint} but the trial was "
                                 f"measured on {fp}")
        new = self._new_specs(("models", model), ("clusters", cluster))
        with self._tx():
            self._put_specs(new)
            added = self._insert(trial, runtime_versions())
        self._committed(new)
        return added

    def add_many(self, trials: Iterable[Trial], model: ModelSpec | None = None,
                 cluster: ClusterSpec | None = None) -> int:
        """``add`` each trial (one transaction each); returns how many were new."""
        return sum(self.add(t, model, cluster) for t in trials)

    def add_probe(self, key: str, result) -> bool:
        """Store a statistical-efficiency probe (``tuner.records.goodput.ProbeResult``) under its cache key
        (``tuner.records.goodput.probe_cache_key``); False when that key is stored already."""
        with self._tx():
            cur = self._db.execute("INSERT OR IGNORE INTO probes VALUES (?, ?, ?, ?, ?)",
                                   (key, result.model_key, result.lossy_key, result.to_json(), time.time()))
        return cur.rowcount == 1

    def probe(self, key: str):
        """The stored probe of a cache key, or None."""
        rows = self._query("SELECT result FROM probes WHERE key = ?", (key,))
        return ProbeResult.from_json(rows[0][0]) if rows else None

    def probes(self, model_key: str | None = None) -> list:
        """Every stored probe (of one model, ``tuner.records.goodput.probe_model_key``), oldest first."""
        sql, args = "SELECT result FROM probes", ()
        if model_key is not None:
            sql, args = sql + " WHERE model_key = ?", (model_key,)
        return [ProbeResult.from_json(r[0]) for r in self._query(sql + " ORDER BY added_at", args)]

    # ---- reading ----------------------------------------------------------------------------
    def _query(self, sql: str, args=()) -> list:
        """All rows of a query; a file damaged past what opening it checks (a page, a value that is
        not UTF-8) is a StoreError, not an sqlite3 exception."""
        try:
            return self._db.execute(sql, args).fetchall()
        except (sqlite3.Error, UnicodeDecodeError) as e:
            why = " ".join(str(e).split())
            raise store_error(self.path, f"reading it failed ({why[:160]}{'...' if len(why) > 160 else ''}); it "
                              f"is damaged") from None

    def _trial(self, row: sqlite3.Row) -> Trial:
        (uid, mfp, cfp, sfp, status, _, steps, error, bs, breakdown, origin, t0, t1, meta, _env, yaml_text) = row
        s = self._parsed.get(sfp)
        if s is None:  # strategies are immutable: parse each one once per open store
            s = self._parsed[sfp] = loads(yaml_text, "strategy", source=f"strategy {sfp}")
        step_times, breakdown, meta = json.loads(steps), json.loads(breakdown), json.loads(meta)
        if not (isinstance(step_times, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                     and math.isfinite(x) and x > 0 for x in step_times)):
            raise TypeError(f"step_times is not a list of finite times > 0: {short_repr(step_times)}")
        for name, value in (("breakdown", breakdown), ("meta", meta)):
            if not isinstance(value, dict):
                raise TypeError(f"{name} is not a JSON object: {short_repr(value)}")
        return Trial(Strategy(s.variables, s.replicas, origin=origin), mfp, cfp, status,
                     step_times=tuple(step_times), error=error, batch_size=bs, breakdown=breakdown, origin=origin,
                     started_at=t0, finished_at=t1, meta=meta)

    def trials(self, model_fp: str | None = None, cluster_fp: str | None = None,
               status: str | None = None) -> list[Trial]:
        """Stored trials in insertion order, optionally filtered."""
        where, args = [], []
        for col, val in (("model_fp", model_fp), ("cluster_fp", cluster_fp), ("status", status)):
            if val is not None:
                where.append(f"t.{col} = ?")
                args.append(val)
        sql = (f"SELECT t.id, {', '.join('t.' + c for c in _TRIAL_COLS)}, s.yaml FROM trials t "
               f"JOIN strategies s ON s.fingerprint = t.strategy_fp "
               f"{'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY t.id")
        out = []
        for row in self._query(sql, args):
            try:
                out.append(self._trial(row[1:]))
            except (ValueError, TypeError, KeyError, AttributeError) as e:   # bad JSON, a wrong type, a bad strategy
                why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                raise store_error(self.path, f"trial row id={row[0]} is damaged ({why}); delete it with "
                                  f"`sqlite3 {self.path} 'DELETE FROM trials WHERE id={row[0]}'`") from None
        return out

    def trials_for(self, model_fp: str, cluster_fp: str) -> list[Trial]:
        """All trials of one (model, cluster) group (for resuming a tuning run)."""
        return self.trials(model_fp, cluster_fp)

    def has_trial(self, model_fp: str, cluster_fp: str, strategy_fp: str, ok_only: bool = False) -> bool:
        """Whether this strategy was already tried on this (model, cluster)."""
        sql = "SELECT 1 FROM trials WHERE model_fp=? AND cluster_fp=? AND strategy_fp=?"
        return bool(self._query(sql + (" AND status='ok'" if ok_only else "") + " LIMIT 1",
                                (model_fp, cluster_fp, strategy_fp)))

    def __len__(self) -> int:
        return self._query("SELECT COUNT(*) FROM trials")[0][0]

    def groups(self) -> list[tuple[str, str, int]]:
        """(model fingerprint, cluster fingerprint, trial count) of every group."""
        return [tuple(r) for r in self._query(
            "SELECT model_fp, cluster_fp, COUNT(*) FROM trials GROUP BY model_fp, cluster_fp ORDER BY MIN(id)")]

    def model(self, fingerprint: str) -> ModelSpec | None:
        rows = self._query("SELECT spec_yaml FROM models WHERE fingerprint=?", (fingerprint,))
        return self._spec(rows, "model", fingerprint)  # type: ignore[return-value]

    def cluster(self, fingerprint: str) -> ClusterSpec | None:
        rows = self._query("SELECT spec_yaml FROM clusters WHERE fingerprint=?", (fingerprint,))
        return self._spec(rows, "cluster", fingerprint)  # type: ignore[return-value]

    def _spec(self, rows: list, kind: str, fingerprint: str):
        if not rows:
            return None
        try:
            return loads(rows[0][0], kind, source=f"{kind} {fingerprint}")
        except (ConfigError, TypeError, AttributeError) as e:   # damaged YAML, or not text at all
            why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise store_error(self.path, f"its {kind} spec {fingerprint} is damaged ({why})") from None

    # ---- export and merge -------------------------------------------------------------------
    def to_dataframe(self):
        """One row per trial (pandas), with model and cluster names and the strategy YAML."""
        import pandas as pd

        sql = (f"SELECT t.id, {', '.join('t.' + c for c in _TRIAL_COLS)}, m.name AS model, c.name AS cluster, "
               f"s.yaml AS strategy_yaml FROM trials t JOIN strategies s ON s.fingerprint = t.strategy_fp "
               f"LEFT JOIN models m ON m.fingerprint = t.model_fp "
               f"LEFT JOIN clusters c ON c.fingerprint = t.cluster_fp ORDER BY t.id")
        return pd.read_sql_query(sql, self._db)

    def export_parquet(self, path: str | os.PathLike) -> str:
        """Write ``to_dataframe()`` to a Parquet file atomically; returns the path."""
        path = os.path.expanduser(os.fspath(path))
        tmp = f"{path}.tmp{os.getpid()}"
        self.to_dataframe().to_parquet(tmp, index=False)
        os.replace(tmp, path)
        return path

    def import_store(self, other: "TrialStore | str | os.PathLike") -> int:
        """Copy every model, cluster, strategy and trial of ``other`` that this store lacks.

        Returns:
            the number of trials added (measurements already here are skipped).
        """
        src = other if isinstance(other, TrialStore) else TrialStore(other)
        try:
            added = 0
            with self._tx():
                for table in ("models", "clusters"):
                    for row in src._db.execute(f"SELECT * FROM {table}"):
                        self._db.execute(f"INSERT OR IGNORE INTO {table} VALUES (?, ?, ?, ?)", row)
                for row in src._db.execute("SELECT * FROM strategies"):
                    self._db.execute("INSERT OR IGNORE INTO strategies VALUES (?, ?)", row)
                for row in src._db.execute(f"SELECT {', '.join(_TRIAL_COLS)} FROM trials ORDER BY id"):
                    cur = self._db.execute(f"INSERT OR IGNORE INTO trials ({', '.join(_TRIAL_COLS)}) VALUES "
                                           f"({', '.join('?' * len(_TRIAL_COLS))})", row)
                    added += cur.rowcount
            return added
        finally:
            if src is not other:
                src.close()
