"""Trial records and the Runner interface the tuner drives execution through."""
from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np

from strategy_space import ClusterSpec, ModelSpec, Strategy

STATUSES = ("ok", "failed", "timeout")
# Trial fields that were keys of ``meta`` before they were fields (and still are in stored trials)
META_FIELDS = ("role", "run_id", "predicted_s", "aliases", "compute", "measurements")


@dataclass(frozen=True)
class Trial:
    """One measured (or failed) run of a strategy.

    Attributes:
        strategy: what was run.
        model_fingerprint, cluster_fingerprint: where it was run (see the specs' ``fingerprint``).
        status: ``ok``, ``failed`` (raised) or ``timeout`` (exceeded its time limit).
        step_times: seconds of each timed step (after warm-up); empty unless ``ok``.
        error: the reason when not ``ok``.
        batch_size: global batch (all replicas) per step, for samples/s.
        breakdown: mean seconds per step by phase, e.g. ``{"compute": .., "sync": ..}``.
        origin: who proposed it (a builder name, ``search``, ``random``).
        started_at, finished_at: UNIX times.
        role: what the tuning loop measured it for: ``baseline``, ``search``, ``confirm`` (empty
            outside a tuning run; ``benchmarks/make_warmstart.py`` adds ``repeat``).
        run_id: the tuning run it belongs to (empty outside one).
        predicted_s: the step time the tuner predicted for it, if it predicted one.
        aliases: other builders whose strategy it also measured (baselines).
        compute: ``real`` or ``emulated`` compute (empty when the runner does not say).
        measurements: how many measurements of the strategy its step times pool (more than 1
            only for ``tuner.records.outcome.merge_measurements``'s pooled trials).
        meta: extra facts (library versions, ray calls per step, start-up seconds, ...). A key of
            ``META_FIELDS`` sets that field instead (how stores and runners wrote them before the
            fields existed): ``TrialStore`` keeps them in its ``meta`` JSON column.
    """

    strategy: Strategy
    model_fingerprint: str
    cluster_fingerprint: str
    status: str
    step_times: tuple[float, ...] = ()
    error: str = ""
    batch_size: int = 0
    breakdown: dict = field(default_factory=dict)
    origin: str = ""
    started_at: float = field(default_factory=time.time)
    finished_at: float = field(default_factory=time.time)
    role: str = ""
    run_id: str = ""
    predicted_s: float | None = None
    aliases: tuple[str, ...] = ()
    compute: str = ""
    measurements: int = 1
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "step_times", tuple(float(t) for t in self.step_times))
        if any(k in self.meta for k in META_FIELDS):
            meta = dict(self.meta)
            for k in META_FIELDS:
                if k in meta:
                    value = meta.pop(k)
                    object.__setattr__(self, k, tuple(value) if k == "aliases" else
                                       int(value) if k == "measurements" else value)
            object.__setattr__(self, "meta", meta)
        object.__setattr__(self, "aliases", tuple(self.aliases))
        if not (isinstance(self.measurements, int) and self.measurements >= 1):
            raise ValueError(f"Trial.measurements must be an integer >= 1, got {self.measurements!r}")
        if self.status not in STATUSES:
            raise ValueError(f"Trial.status must be one of {STATUSES}, got {self.status!r}")
        if self.status == "ok" and not self.step_times:
            raise ValueError("an ok Trial needs at least one step time")
        if self.status != "ok" and not self.error:
            raise ValueError(f"a {self.status} Trial needs an error text")

    def __repr__(self) -> str:
        """One line (a trial holds every step time and loss: hundreds of numbers), e.g.
        ``Trial(ps: ok, median 2.2 ms of 200 steps, baseline of run ed561cdcf86f)``."""
        how = (f"ok, median {self.median * 1e3:.3g} ms of {len(self.step_times)} steps" if self.ok
               else f"{self.status}: {self.error if len(self.error) <= 100 else self.error[:97] + '...'}")
        role = f", {self.role or 'trial'} of run {self.run_id}" if self.run_id else ""
        return f"Trial({self.origin or 'strategy'}: {how}{role})"

    def stored_meta(self) -> dict:
        """``meta`` with the ``META_FIELDS`` that differ from their defaults: what a store's
        ``meta`` column holds."""
        out = dict(self.meta)
        for k in META_FIELDS:
            value = getattr(self, k)
            if value != _META_DEFAULTS[k]:
                out[k] = list(value) if k == "aliases" else value
        return out

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def worth_another_run(self) -> bool:
        """A failure another run may not repeat: one that raised (a killed actor, a busy node can
        pass). Not a time-out: a strategy too slow for the trial limit would spend another whole
        limit on the same answer (lm1b-full's ps and ps_lb baselines on 3 nodes at 100mbit took the
        whole 300 s limit with 13 steps a trial, 23-32 s a step: a synchronous PS's push and pull of
        its 88 MB of dense kernels do not overlap there). Nor a strategy the runner refused before
        running it (``meta["refused"]``: it does not validate, or cannot fit a node's memory)."""
        return self.status == "failed" and not self.meta.get("refused")

    @property
    def median(self) -> float:
        return float(np.median(self.step_times)) if self.step_times else math.inf

    @property
    def mean(self) -> float:
        return float(np.mean(self.step_times)) if self.step_times else math.inf

    @property
    def median_ci(self) -> tuple[float, float] | None:
        """Distribution-free 95 % interval of the median step time (``tuner.records.precision``); None
        when failed or with fewer than 6 steps. For pooled measurements (``merge_measurements``)
        it is the interval of the pooled steps, which ignores the noise between measurements."""
        from tuner.records.precision import median_interval

        return median_interval(self.step_times) if self.ok else None

    @property
    def p90(self) -> float:
        return float(np.percentile(self.step_times, 90)) if self.step_times else math.inf

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.median if self.step_times and self.median > 0 else 0.0

    def summary(self) -> dict:
        """JSON-able summary (the CLI's ``--json`` shape)."""
        return {
            "status": self.status,
            "origin": self.origin,
            "error": self.error or None,
            "step_time_s": {"median": self.median, "mean": self.mean, "p90": self.p90,
                            "median_ci95": list(self.median_ci) if self.median_ci else None}
            if self.ok else None,
            "samples_per_s": self.samples_per_s if self.ok else None,
            "steps": len(self.step_times),
            "breakdown": dict(self.breakdown),
            "strategy_fingerprint": self.strategy.fingerprint,
        }


_META_DEFAULTS = {f.name: f.default for f in fields(Trial) if f.name in META_FIELDS}


class Runner(abc.ABC):
    """Runs strategies of one model on one cluster and measures them.

    Implementations: the Ray runtime (``autosync.runtime``) and fakes in tests.
    """

    model: ModelSpec
    cluster: ClusterSpec

    @abc.abstractmethod
    def run(self, strategies: Sequence[Strategy], origins: Sequence[str] | None = None) -> list[Trial]:
        """Run each strategy (warm-up, then timed steps) and return one Trial per strategy, in
        order. Never raises for a strategy that fails: that Trial has status failed/timeout."""

    def optimizer_config(self) -> dict:
        """The model's optimizer as the trials run it (a Keras ``get_config()`` plus ``class``);
        empty where the runner has none to say (fakes, emulated models without options)."""
        return {}

    def lost_nodes(self) -> list[str]:
        """The cluster's nodes that have left it since the runner started (no trial can run there
        again: a tuning run stops, ``lost_nodes_note``); none where the runner cannot tell."""
        return []

    def close(self) -> None:
        """Release everything the runner holds (actors, processes)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def lost_nodes_note(names: Sequence[str], workers: bool = True) -> str:
    """What a trial or a tuning run says of nodes that left the cluster (``Runner.lost_nodes``):
    nodes that held workers (``workers``), without which no strategy runs, or nodes that held
    none, without which no strategy that places parameter servers there runs."""
    shown = ", ".join(list(names)[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    which = "no strategy can run on this cluster" if workers else "no strategy that places parameter servers there can run"
    return (f"node(s) {shown} left the Ray cluster (Ray reports them dead), so {which}: bring them back (or give "
            f"a cluster without them) and run again")


def workers_lost(names: Sequence[str], cluster) -> list[str]:
    """Of the lost nodes ``names``, those that held workers of ``cluster`` (a name the cluster does
    not know counts as one): every strategy trains on every worker, so none runs after their loss."""
    known = {n.name: n for n in cluster.nodes}
    return [n for n in names if n not in known or (known[n].workers or 0) > 0]
