"""Synthetic trials: generated models and clusters measured by the flow-level simulation.

``SyntheticRunner`` implements ``tuner.records.trial.Runner`` on top of ``netsim.simulate_step`` (so the
search loop can be tested without Ray), and ``make_dataset`` produces trials for many (model,
cluster) pairs: the specs in ``configs/models`` and ``configs/clusters`` when present, plus random
CNN-, transformer- and recommender-shaped models and random clusters.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import time
from typing import Iterator, Sequence

import numpy as np

from strategy_space import ClusterSpec, ComputeProfile, ModelSpec, NodeSpec, Strategy, VariableSpec, validate
from strategy_space.builders import build_all
from strategy_space.errors import ConfigError
from strategy_space.space import StrategySpace
from strategy_space.yaml_io import load

from tuner.features.tables import estimate_compute_s
from tuner.records.trial import Runner, Trial
from tuner.synthetic.netsim import Truth, simulate_step


class SyntheticRunner(Runner):
    """A fake Runner whose measurements come from the network simulation.

    Args:
        model, cluster: what it "runs".
        seed: seeds the noise; the same seed and strategies give the same trials.
        steps: timed steps per trial.
        truth: constants of the synthetic world.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, seed: int = 0, steps: int = 5,
                 truth: Truth = Truth()):
        self.model, self.cluster, self.seed, self.steps, self.truth = model, cluster, seed, steps, truth
        self._rng = np.random.default_rng(seed)

    def run(self, strategies: Sequence[Strategy], origins: Sequence[str] | None = None) -> list[Trial]:
        if origins is not None and len(origins) != len(strategies):
            raise ValueError(f"origins has {len(origins)} entries for {len(strategies)} strategies")
        origins = list(origins) if origins is not None else [s.origin or "synthetic" for s in strategies]
        compute = estimate_compute_s(self.model)
        out = []
        for s, origin in zip(strategies, origins):
            started = time.time()
            try:
                validate(s, self.model, self.cluster)   # what the runtime refuses fails here too
                base, breakdown = simulate_step(self.model, self.cluster, s, compute, self._rng, self.truth)
            except (ConfigError, KeyError, ValueError) as e:
                out.append(Trial(s, self.model.fingerprint, self.cluster.fingerprint, "failed",
                                 error=f"{type(e).__name__}: {e}", origin=origin, started_at=started,
                                 meta={"refused": True}))
                continue
            run_bias = np.exp(self._rng.normal(0, self.truth.step_noise / 2))
            noise = np.exp(self._rng.normal(0, self.truth.step_noise, self.steps))
            spikes = np.where(self._rng.random(self.steps) < self.truth.straggler_p, self.truth.straggler_x, 1.0)
            times = base * run_bias * noise * spikes
            out.append(Trial(s, self.model.fingerprint, self.cluster.fingerprint, "ok", step_times=tuple(times),
                             batch_size=self.model.batch_size * self.cluster.num_workers, origin=origin,
                             breakdown={k: float(v) for k, v in breakdown.items()}, started_at=started,
                             meta={"runner": "synthetic", "seed": self.seed}))
        return out


def noiseless_step_s(model: ModelSpec, cluster: ClusterSpec, strategies: Sequence[Strategy],
                     truth: Truth = Truth()) -> np.ndarray:
    """The synthetic world's noiseless seconds per step of each strategy: ``truth`` without node
    jitter, stragglers or step noise (what repeated measurements of a trial scatter around)."""
    quiet = dataclasses.replace(truth, node_jitter=0.0, straggler_p=0.0, step_noise=0.0)
    compute, rng = estimate_compute_s(model), np.random.default_rng(0)   # the rng draws change nothing
    return np.array([simulate_step(model, cluster, s, compute, rng, quiet)[0] for s in strategies])


# ---- generated models ---------------------------------------------------------------------------
def _cnn(rng, name) -> list[VariableSpec]:
    vs, c = [], 3
    for i in range(int(rng.integers(4, 14))):
        co = int(min(1024, c * rng.choice([1, 2]) if i else rng.choice([32, 64])))
        vs += [VariableSpec(f"conv{i}/kernel", (3, 3, c, co)), VariableSpec(f"conv{i}/bias", (co,))]
        c = co
    hidden = int(rng.choice([256, 1024, 4096]))
    vs += [VariableSpec("fc/kernel", (c * 4, hidden)), VariableSpec("fc/bias", (hidden,)),
           VariableSpec("out/kernel", (hidden, 1000)), VariableSpec("out/bias", (1000,))]
    return vs


def _transformer(rng, name) -> list[VariableSpec]:
    d, vocab = int(rng.choice([256, 512, 768])), int(rng.choice([8000, 30000]))
    vs = [VariableSpec("embed", (vocab, d), sparse=bool(rng.random() < 0.5), rows_per_step=None)]
    if vs[0].sparse:
        vs[0] = VariableSpec("embed", (vocab, d), sparse=True, rows_per_step=int(min(vocab, rng.integers(500, 4000))))
    for i in range(int(rng.integers(2, 8))):
        vs += [VariableSpec(f"l{i}/qkv", (d, 3 * d)), VariableSpec(f"l{i}/proj", (d, d)),
               VariableSpec(f"l{i}/ff1", (d, 4 * d)), VariableSpec(f"l{i}/ff2", (4 * d, d)),
               VariableSpec(f"l{i}/ln", (d,))]
    return vs


def _recsys(rng, name) -> list[VariableSpec]:
    vs = []
    for i in range(int(rng.integers(1, 5))):
        rows, width = int(rng.choice([1e4, 1e5, 1e6])), int(rng.choice([16, 32, 64]))
        vs.append(VariableSpec(f"emb{i}", (rows, width), sparse=True, rows_per_step=int(min(rows, rng.integers(200, 5000)))))
    prev = 128
    for i in range(int(rng.integers(2, 5))):
        h = int(rng.choice([256, 512, 1024]))
        vs += [VariableSpec(f"mlp{i}/kernel", (prev, h)), VariableSpec(f"mlp{i}/bias", (h,))]
        prev = h
    return vs


SHAPES = {"cnn": _cnn, "transformer": _transformer, "recsys": _recsys}


def random_model(rng: np.random.Generator, name: str) -> ModelSpec:
    """A random CNN-, transformer- or recommender-shaped ModelSpec with a compute profile."""
    shape = str(rng.choice(sorted(SHAPES)))
    vs = SHAPES[shape](rng, name)
    m = ModelSpec(f"{name}-{shape}", tuple(vs), batch_size=int(rng.choice([32, 64, 128])))
    compute = estimate_compute_s(m) * float(np.exp(rng.normal(0, 0.5)))
    return ModelSpec(m.name, m.variables, m.batch_size, ComputeProfile(step_time_s=compute, device="synthetic"))


def random_cluster(rng: np.random.Generator, name: str) -> ClusterSpec:
    """2-6 nodes with 1-4 workers each; bandwidth 1-25 Gbit/s, sometimes uneven."""
    n = int(rng.integers(2, 7))
    workers = int(rng.integers(1, 5))
    bw = float(rng.choice([1.0, 2.5, 10.0, 25.0]))
    uneven = rng.random() < 0.3
    return ClusterSpec(name, tuple(NodeSpec(f"n{i}", workers=workers, cpus=max(1, workers),
                                            bandwidth_gbps=bw * (float(rng.choice([0.5, 1, 2])) if uneven else 1))
                                   for i in range(n)))


def config_specs(root: str | None = None) -> tuple[list[ModelSpec], list[ClusterSpec]]:
    """Model and cluster specs under ``root/configs`` (skipping files that do not load)."""
    root = root or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
    found: dict[str, list] = {"model": [], "cluster": []}
    for kind, folder in (("model", "models"), ("cluster", "clusters")):
        for path in sorted(glob.glob(os.path.join(root, folder, "*.yaml"))):
            try:
                found[kind].append(load(path, kind))
            except ConfigError:
                continue
    return found["model"], found["cluster"]


def candidate_strategies(model: ModelSpec, cluster: ClusterSpec, rng: np.random.Generator, n: int) -> list[Strategy]:
    """The baselines, mutations of them, and random strategies (``n`` in all, de-duplicated)."""
    space = StrategySpace(model, cluster, staleness=(0, 1, 2), backends=("auto", "objectstore"))
    out = {s.fingerprint: s for s in build_all(model, cluster).values()}
    base = list(out.values())
    enc = space.encode(base)
    for _ in range(3):
        enc = space.mutate_encoded(enc, rng)
        for i in range(len(enc)):
            s = space.decode(enc, i, origin="mutation")
            out.setdefault(s.fingerprint, s)
    rand = space.sample_encoded(rng, max(n, 1) * 2)
    for i in range(len(rand)):
        if len(out) >= n:
            break
        s = space.decode(rand, i, origin="random")
        out.setdefault(s.fingerprint, s)
    return list(out.values())[:n]


def iter_groups(n_models: int, n_clusters_each: int, seed: int = 0,
                include_configs: bool = True) -> Iterator[tuple[ModelSpec, ClusterSpec]]:
    """(model, cluster) pairs: config specs (capped at ``n_models``) then random ones."""
    rng = np.random.default_rng(seed)
    models, clusters = config_specs() if include_configs else ([], [])
    models = [m for m in models if len(m.variables) <= 400][:n_models]
    while len(models) < n_models:
        models.append(random_model(rng, f"syn{len(models)}"))
    for i, m in enumerate(models):
        picks = list(clusters[: 1]) + [random_cluster(rng, f"c{i}-{j}") for j in range(n_clusters_each)]
        for c in picks[:n_clusters_each]:
            yield m, c


def make_dataset(n_models: int = 12, n_clusters_each: int = 3, per_group: int = 40, seed: int = 0,
                 include_configs: bool = True) -> list[tuple[ModelSpec, ClusterSpec, list[Trial]]]:
    """Trials for many (model, cluster) groups: ``[(model, cluster, trials), ...]``."""
    rng = np.random.default_rng(seed + 1)
    data = []
    for g, (m, c) in enumerate(iter_groups(n_models, n_clusters_each, seed, include_configs)):
        strategies = candidate_strategies(m, c, rng, per_group)
        trials = SyntheticRunner(m, c, seed=seed * 1000 + g).run(strategies)
        data.append((m, c, trials))
    return data
