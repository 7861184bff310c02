"""Goodput: time per step of lossless progress, the figure a tuning run minimizes by default.

A synchronous strategy with staleness 0 and no compressor trains exactly as one process on the
global batch (the runtime's tests hold every such strategy to that), so its statistical
efficiency is 1 without measuring. A strategy with a lossy part — a compressor, a bounded-stale or
asynchronous parameter server — may need more steps to reach the same loss. Its efficiency ``E``
is measured by a probe: the strategy and its lossless twin (the same strategy with those parts
made exact) train from the same initial weights on the same data for K steps, and

    E = mean over s in the last three quarters of (n(s) / s),

where n(s) is the step at which the twin (a monotone fit of its loss) reaches the candidate's
smoothed loss at step s; at most 1, with an interval from the noise of the batch losses
(``estimate_efficiency``).
Goodput then compares strategies by ``step_time / E`` (Pollux's goodput, OSDI'21, turned into
seconds per unit of lossless progress), so a lossy strategy wins only where its faster steps pay
for the extra steps it needs.

Quality policies (``QUALITIES``): ``exact`` never proposes a lossy part; ``goodput`` proposes
them and keeps a lossy strategy only with a measured E; ``step`` ranks by step time alone (the
behaviour before goodput), and every output says so.

Between probes, the search estimates the efficiency of candidates it has not probed from a cost
per lossy feature and per share of the model it covers, fitted to the probes so far
(``fit_feature_costs``): a feature no probe has held is still worth proposing.

Everything here is pure (numpy, scipy); the probe that trains lives in ``autosync.probe``.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from strategy_space import Strategy
from strategy_space.compressor import COMPRESSOR_KINDS, Compressor
from strategy_space.encoding import COMPRESSOR_ID, KIND_AR, KIND_PS, EncodedStrategies
from strategy_space.strategy import PS, AllReduce, VarConfig
from strategy_space.strict import fingerprint
from tuner.records.loss_curves import batch_noise, decreasing_fit, smooth, steps_to_reach

QUALITIES = ("exact", "goodput", "step")
DEFAULT_QUALITY = "goodput"
# steps a probe trains by default (each of the candidate and its twin)
DEFAULT_PROBE_STEPS = 200
# under goodput a lossy strategy is recommended only at this efficiency or above: a probe sees the
# first K steps, and what a lossy part costs late in training (a higher final loss) can only be
# larger than what it cost early, so the policy keeps a margin
DEFAULT_MIN_EFFICIENCY = 0.95


@dataclass(frozen=True)
class LossyParts:
    """What makes a strategy's training differ from one process's.

    Attributes:
        compressed: ``(variable, shard, compressor spec)`` of every all-reduced shard with a
            compressor.
        stale: ``(variable, shard, staleness)`` of every synchronous PS shard with staleness > 0.
        asynchronous: ``(variable, shard)`` of every asynchronous PS shard.
    """

    compressed: tuple[tuple[str, int, str], ...] = ()
    stale: tuple[tuple[str, int, int], ...] = ()
    asynchronous: tuple[tuple[str, int], ...] = ()

    @property
    def lossless(self) -> bool:
        return not (self.compressed or self.stale or self.asynchronous)

    @property
    def timing_dependent(self) -> bool:
        """Staleness and asynchrony depend on how fast each worker runs, so their probe must run
        on the target cluster; a compressor's effect does not depend on the network."""
        return bool(self.stale or self.asynchronous)

    @property
    def key(self) -> str:
        """Equal for strategies whose lossy parts are the same (whatever else differs)."""
        return fingerprint({"compressed": [list(c) for c in self.compressed], "stale": [list(s) for s in self.stale],
                            "asynchronous": [list(a) for a in self.asynchronous]})

    def describe(self) -> str:
        """A short human summary, e.g. ``powersgd(4) on 11 variables; staleness 2 on 3 shards``."""
        if self.lossless:
            return "lossless"
        parts = []
        by_codec: dict[str, set] = {}
        for var, _, codec in self.compressed:
            by_codec.setdefault(codec, set()).add(var)
        parts += [f"{codec} on {counted(len(v), 'variable')}" for codec, v in sorted(by_codec.items())]
        by_stale: dict[int, int] = {}
        for _, _, s in self.stale:
            by_stale[s] = by_stale.get(s, 0) + 1
        parts += [f"staleness {s} on {counted(n, 'PS shard')}" for s, n in sorted(by_stale.items())]
        if self.asynchronous:
            parts.append(f"asynchronous PS on {counted(len(self.asynchronous), 'shard')}")
        return "; ".join(parts)


def counted(n: int, noun: str) -> str:
    """``1 trial``, ``3 trials``: a count and its noun, plural unless one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def lossy_parts(strategy: Strategy) -> LossyParts:
    """The lossy parts of ``strategy`` (sorted by variable name, then shard)."""
    compressed, stale, asynchronous = [], [], []
    for c in sorted(strategy.variables, key=lambda c: c.name):
        for i, s in enumerate(c.synchronizers):
            if isinstance(s, AllReduce) and s.codec.kind != "none":
                compressed.append((c.name, i, str(s.codec)))
            elif isinstance(s, PS) and not s.sync:
                asynchronous.append((c.name, i))
            elif isinstance(s, PS) and s.staleness > 0:
                stale.append((c.name, i, s.staleness))
    return LossyParts(tuple(compressed), tuple(stale), tuple(asynchronous))


def is_lossless(strategy: Strategy) -> bool:
    return lossy_parts(strategy).lossless


def lossless_twin(strategy: Strategy) -> Strategy:
    """``strategy`` with every lossy part made exact: compressors off, parameter servers
    synchronous with staleness 0; placement, partitioning, backends and groups unchanged."""
    def exact(s):
        if isinstance(s, AllReduce) and s.codec.kind != "none":
            return dataclasses.replace(s, compressor="none")
        if isinstance(s, PS) and (not s.sync or s.staleness):
            return dataclasses.replace(s, sync=True, staleness=0)
        return s

    configs = tuple(VarConfig(c.name, tuple(exact(s) for s in c.synchronizers), c.axis) for c in strategy.variables)
    origin = f"{strategy.origin} (lossless twin)" if strategy.origin else "lossless twin"
    return Strategy(configs, strategy.replicas, origin=origin)


@dataclass(frozen=True)
class Efficiency:
    """A strategy's statistical efficiency.

    Attributes:
        value: E in [0, 1]: lossless steps per step of this strategy (1: trains as one process).
        low, high: its interval (95 % from the batch losses' noise; equal to ``value`` when not
            probed).
        probed: whether it was measured (False: lossless, 1 by construction).
        steps: steps the probe trained (0 when not probed).
        source: ``lossless`` (not measured), ``probe`` (measured in this run) or ``cache`` (a
            probe of the same model and lossy parts measured earlier), ``failed``.
        note: what the figure rests on, said in the outputs (e.g. that the probe ran on another
            cluster than the measurements); the error of a failed probe.
    """

    value: float
    low: float
    high: float
    probed: bool = False
    steps: int = 0
    source: str = "lossless"
    note: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Efficiency":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


EXACT = Efficiency(1.0, 1.0, 1.0)


def failed_efficiency(error: str) -> Efficiency:
    """The efficiency of a strategy whose probe failed: unknown, so it counts as 0 (never kept)."""
    return Efficiency(0.0, 0.0, 0.0, probed=True, source="failed", note=error[:500])


def estimate_efficiency(candidate: Sequence[float], twin: Sequence[float], *, window: int | None = None,
                        z: float = 1.96, first: float = 0.25) -> Efficiency:
    """E of a candidate from its loss curve and its lossless twin's (same start, same data).

    Both curves are smoothed by trailing means of ``window`` steps (default a tenth of the steps,
    at least 5; a mean stands for the step at its window's centre) and the twin's by a
    non-increasing fit. At every step s from ``first`` x K on, the candidate's level is matched to
    the step n(s) at which the twin reached it (at most K), and E is the mean of n(s) / s, at most 1
    (a lossy part cannot make training better than exact). Averaging over the last three quarters
    of the run, not reading one final level, keeps E steady where the curves flatten (there a small
    loss difference is many steps). The interval shifts the candidate's curve by ``z`` standard
    errors of the two curves' batch noise, averaged over the independent windows the mean spans.

    A candidate whose loss is not finite (diverged) has E = 0. Where the twin's loss does not fall
    by more than the noise, the curves cannot tell how many steps a level is worth: E is then
    unknown, [0, 1], and counts as 0 (said in the note), so a strategy no probe could judge is not
    taken for one that trains as well.
    """
    c = np.asarray(candidate, dtype=np.float64)
    t = np.asarray(twin, dtype=np.float64)
    k = min(len(c), len(t))
    if k < 2:
        raise ValueError(f"a probe needs at least 2 steps of each curve, got {len(c)} and {len(t)}")
    c, t = c[:k], t[:k]
    if not np.all(np.isfinite(c)):
        return Efficiency(0.0, 0.0, 0.0, probed=True, steps=k, source="probe", note="the candidate's loss diverged")
    if not np.all(np.isfinite(t)):
        raise ValueError("the lossless twin's loss is not finite: the model does not train at this setting")
    w = int(window or max(5, k // 10))
    w = max(1, min(w, k))
    # the twin's first and last windows: a fall within their noise is no learning that levels can be told by
    fall, noise = float(np.mean(t[:w]) - np.mean(t[-w:])), z * batch_noise(t) * math.sqrt(2.0 / w)
    if fall <= noise:
        return Efficiency(0.0, 0.0, 1.0, probed=True, steps=k, source="probe",
                          note=f"the lossless twin's loss fell by {fall:.3g} in {k} steps, within the noise "
                               f"({noise:.3g}): the probe cannot tell how this strategy trains (E anywhere in "
                               f"[0, 1], counted as 0: not recommended); more --probe-steps, or a model that learns "
                               f"in them, tells more")
    sc, fit = smooth(c, w), decreasing_fit(smooth(t, w))
    steps = np.arange(len(sc)) + (w + 1) / 2
    chosen = np.nonzero(steps >= first * k)[0]
    if not len(chosen):
        chosen = np.arange(len(sc))
    span = max(1.0, (steps[chosen[-1]] - steps[chosen[0]] + w) / w)
    se = math.sqrt(batch_noise(c) ** 2 + batch_noise(t) ** 2) / math.sqrt(w * span)

    def e_at(shift: float) -> float:
        ratios = [min(steps_to_reach(fit, sc[i] + shift, w), float(k)) / steps[i] for i in chosen]
        return min(1.0, float(np.mean(ratios)))

    value = e_at(0.0)
    low, high = e_at(z * se), e_at(-z * se)
    return Efficiency(value, min(low, value), max(high, value), probed=True, steps=k, source="probe",
                      note=_unstable_twin(smooth(t, w), z * se))


def _unstable_twin(smoothed: np.ndarray, noise: float) -> str:
    """A warning when the twin's smoothed loss ends well above its own minimum (it rose back by more
    than a quarter of its fall, beyond the noise): E then compares against one unstable run."""
    low = float(smoothed.min())
    fall, rise = float(smoothed[0]) - low, float(smoothed[-1]) - low
    if fall <= 0 or rise <= max(0.25 * fall, noise):
        return ""
    return (f"the lossless twin's loss rose back by {rise:.3g} of its {fall:.3g} fall before the probe ended "
            f"(unstable training at this learning rate): E compares against one unstable run; another "
            f"--probe-seed or a lower learning rate tells more")


class Prober(abc.ABC):
    """Measures statistical efficiencies for a tuning run (``autosync.probe.TrainingProber``
    trains the model; tests use fakes).

    Attributes:
        note: what the probes rest on, said in the outputs (e.g. that they train on another
            cluster than the one measured).
    """

    note: str = ""

    @abc.abstractmethod
    def efficiency(self, strategy: Strategy) -> Efficiency:
        """E of a lossy ``strategy`` (from a cache when it holds the same lossy parts); raises
        when the probe fails."""

    def use_lossless(self, strategy: Strategy) -> None:
        """A lossless strategy measured fastest so far: every lossless strategy trains as one
        process, so a prober may train the lossless curve with it instead of the candidate's
        own twin (the same losses, in less time). The default ignores it."""

    @property
    def training_known(self) -> str | None:
        """The digest of how the probed model trains (``ProbeResult.meta["training"]``) once a probe
        has computed it, else None (also where none is kept): a run's later trials carry it, so
        that its report reads the probes of its own training, those found in the cache too."""
        return None


def lossy_extents(e: EncodedStrategies, weights: np.ndarray) -> dict[str, np.ndarray]:
    """Per lossy feature in the batch, the share of the model's parameters each strategy holds
    under it: (B,) in [0, 1]. Features: ``async`` (asynchronous PS), ``staleness S`` and each
    compressor spec (``powersgd(4)``, ``fp16_ef``).

    Args:
        weights: (V,) each variable's share of the model's parameters (summing to 1).
    """
    out: dict[str, np.ndarray] = {}
    ar, ps = e.kind == KIND_AR, e.kind == KIND_PS
    if ps.any():
        asynchronous = ps & (e.sync == 0)
        if asynchronous.any():
            out["async"] = asynchronous @ weights
        stale = ps & (e.sync == 1) & (e.staleness > 0)
        for s in np.unique(e.staleness[stale]):
            out[f"staleness {int(s)}"] = (stale & (e.staleness == s)) @ weights
    lossy_ar = ar & (e.compressor != COMPRESSOR_ID["none"])
    for cid, rank in {(int(c), int(r)) for c, r in zip(e.compressor[lossy_ar], e.rank[lossy_ar])}:
        name = COMPRESSOR_KINDS[cid]
        spec = str(Compressor.parse(f"{name}({rank})" if name.startswith("powersgd") else name))
        out[spec] = (lossy_ar & (e.compressor == cid) & (e.rank == rank)) @ weights
    return out


def fit_feature_costs(extents: dict[str, np.ndarray], efficiency: np.ndarray, *,
                      ridge: float = 1e-3) -> dict[str, float]:
    """What each lossy feature costs per share of the parameters it covers, from probes.

    Model: ``E = exp(-sum_f x_f c_f)`` with ``x_f`` a strategy's share of parameters under
    feature f (``lossy_extents``) and a cost ``c_f >= 0``: features compound, and a feature on
    more of the model costs more (asynchronous PS on six small shards is not asynchronous PS on
    the whole model). Fitted by non-negative least squares on ``-log E``, with a small ridge that
    shares a cost among the features of a probe that cannot tell them apart (each later probe
    separates them further).

    Args:
        extents: feature -> (P,) shares of the P probed strategies.
        efficiency: (P,) their measured efficiencies (a failed probe: 0, counted as 0.001).
    """
    names = sorted(extents)
    if not names or not len(efficiency):
        return {}
    from scipy.optimize import nnls

    x = np.stack([extents[n] for n in names], axis=1).astype(float)
    y = -np.log(np.clip(np.asarray(efficiency, dtype=float), 1e-3, 1.0))
    a = np.vstack([x, math.sqrt(ridge) * np.eye(len(names))])
    b = np.concatenate([y, np.zeros(len(names))])
    costs, _ = nnls(a, b)
    return {n: float(c) for n, c in zip(names, costs)}


def estimate_encoded_efficiency(e: EncodedStrategies, weights: np.ndarray, costs: dict[str, float]) -> np.ndarray:
    """Per encoded strategy, the search's estimate of its efficiency under ``fit_feature_costs``:
    ``exp(-sum_f x_f c_f)``; a feature no probe has held costs nothing yet (1: still worth
    proposing, and probing)."""
    out = np.zeros(len(e))
    for f, x in lossy_extents(e, weights).items():
        out += x * costs.get(f, 0.0)
    return np.exp(-out)


def goodput_seconds(step_time_s: float, efficiency: Efficiency | None) -> float:
    """Seconds per step of lossless progress: ``step_time / E`` (inf when E is unknown or 0)."""
    if efficiency is None or not efficiency.value > 0:
        return float("inf")
    return step_time_s / efficiency.value


@dataclass(frozen=True)
class ProbeResult:
    """What a probe measured.

    Attributes:
        model: the model's name; ``model_key``: name and variables (``probe_model_key``).
        lossy_key, lossy: the candidate's ``LossyParts.key`` and its ``describe()``.
        workers: number of workers it trained on; ``cluster``: the cluster's name.
        steps, seed: steps trained and the seed of initial weights and data.
        efficiency: the estimate.
        candidate_loss, twin_loss: per step, the mean over workers of the batch loss.
        candidate_wall_s, twin_wall_s: seconds each training took (start-up excluded).
        started_at: UNIX time.
    """

    model: str
    model_key: str
    lossy_key: str
    lossy: str
    workers: int
    cluster: str
    steps: int
    seed: int
    efficiency: Efficiency
    candidate_loss: tuple[float, ...] = ()
    twin_loss: tuple[float, ...] = ()
    candidate_wall_s: float = 0.0
    twin_wall_s: float = 0.0
    started_at: float = 0.0
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["efficiency"] = self.efficiency.to_dict()
        return json.dumps(d, allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> "ProbeResult":
        d = json.loads(text)
        d["efficiency"] = Efficiency.from_dict(d["efficiency"])
        d["candidate_loss"], d["twin_loss"] = tuple(d.get("candidate_loss", ())), tuple(d.get("twin_loss", ()))
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def probe_model_key(model) -> str:
    """What a probe's cache is keyed on for the model: its name and variables (a ModelSpec)."""
    return f"{model.name}:{model.fingerprint}"


def probe_cache_key(model_key: str, parts: LossyParts, workers: int, steps: int, seed: int,
                    cluster_fingerprint: str | None = None, training: str | None = None) -> str:
    """The cache key of a probe: per (model, how it trains, lossy parts, workers, steps, seed); for
    staleness and asynchrony also the cluster (their effect depends on its timing). ``training``:
    a digest of the model's layers, initial weights, loss, optimizer and data
    (``autosync.models.training_key``): a probe of another learning rate is not this one's."""
    return fingerprint({"model": model_key, "lossy": parts.key, "workers": int(workers), "steps": int(steps),
                        "seed": int(seed), "cluster": cluster_fingerprint if parts.timing_dependent else None,
                        "training": training})
