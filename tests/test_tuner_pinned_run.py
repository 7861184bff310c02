"""Behaviour pinned across refactors: a short tuning run on the synthetic runner, seeded, gives the
same trial sequence (origin, role, strategy fingerprint) and the same recommendation as the code
it was recorded from, with and without warm-start groups (recorded at f24fa00 before the tuner was
refactored, which kept it; re-recorded when the tuner stopped proposing strategies whose features
equal a measured one's, and when the analytic model's PS round trip became the data plane's
0.2 ms instead of a Ray call's 0.7 ms, and when the search gained its trust region — with 7
baselines, fewer than the 12 own trials that can prove the predictor, both runs now search near
the incumbents, without picks at random; ``open``, the cold run without the region, keeps the
trials recorded before it; and ``warm``'s last three when the search followed the ranker's order
alone instead of fusing it with the seconds' (2026-11-28), and all three when a synchronous PS
step's pulls were counted after its pushes unless pipelined (2026-11-28): intended changes). A change that alters
what the tuner proposes for the same seed fails here; re-record only for an intended change of
behaviour, and say so in the commit."""
from __future__ import annotations

import dataclasses

import pytest

from tests.fakes import three_node_cluster, tiny_model
from tuner.records.store import TrialStore
from tuner.search.model_based import ModelBasedTuner, SearchSettings
from tuner.search.tuning import Budget, tune_loop
from tuner.synthetic.runner import SyntheticRunner, make_dataset

MODEL, CLUSTER = tiny_model(profile=True), three_node_cluster()
SETTINGS = SearchSettings(batch=3, candidates=64, chains=12, anneal_steps=8, seed=5)

# every run measures the seven builders first, in this order
BASELINES = [
    ('ps', 'baseline', '590baa757f11d4bb'),
    ('ps_lb', 'baseline', '9ea9de15dc045bb8'),
    ('partitioned_ps', 'baseline', 'acfc8fd091f70d03'),
    ('uneven_partitioned_ps', 'baseline', '90038de3473e9b21'),
    ('all_reduce', 'baseline', 'c5a79b2294178a38'),
    ('partitioned_all_reduce', 'baseline', 'b897bcc833ce33b8'),
    ('parallax', 'baseline', '955d0446d041e32e'),
]
PINNED = {
    'open': {
        'trials': [
            *BASELINES,
            ('search', 'search', '9909a4a669b09827'),
            ('search', 'search', 'bcb8354f79a5f716'),
            ('explore', 'search', '558a17767cc9348c'),
            ('search', 'search', 'eb1080acd0061731'),
            ('search', 'search', '7565ad944cbdaf73'),
            ('explore', 'search', '9d44e895330a50dd'),
            ('all_reduce', 'confirm', 'c5a79b2294178a38'),
            ('explore', 'confirm', '558a17767cc9348c'),
        ],
        'best': '558a17767cc9348c', 'stop': 'trials',
    },
    'cold': {
        'trials': [
            *BASELINES,
            ('search', 'search', '62ffbb7dfd8f0191'),
            ('search', 'search', '468d7300eaf477cf'),
            ('search', 'search', 'aadbcfd536d40635'),
            ('search', 'search', '2ab7386e6df24c7c'),
            ('search', 'search', '66d9de285cc4d520'),
            ('search', 'search', 'aa0d955d3b762b61'),
            ('all_reduce', 'confirm', 'c5a79b2294178a38'),
            ('search', 'confirm', 'aadbcfd536d40635'),
        ],
        'best': 'aadbcfd536d40635', 'stop': 'trials',
    },
    'warm': {
        'trials': [
            *BASELINES,
            ('search', 'search', '62ffbb7dfd8f0191'),
            ('search', 'search', '468d7300eaf477cf'),
            ('search', 'search', 'aadbcfd536d40635'),
            ('search', 'search', 'e5304df86295f65b'),
            ('search', 'search', 'b5a704d84fe3b43c'),
            ('search', 'search', 'ff80c2fa6643e30f'),
            ('all_reduce', 'confirm', 'c5a79b2294178a38'),
            ('search', 'confirm', 'aadbcfd536d40635'),
        ],
        'best': 'aadbcfd536d40635', 'stop': 'trials',
    },
}


def _warm(name):
    return make_dataset(n_models=2, n_clusters_each=1, per_group=12, seed=3, include_configs=False) if name == "warm" else ()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_seeded_run_gives_the_pinned_trials_and_recommendation(tmp_path, name):
    with TrialStore(tmp_path / "p.db") as store:
        settings = dataclasses.replace(SETTINGS, trust_radius=0) if name == "open" else SETTINGS
        tuner = ModelBasedTuner(MODEL, CLUSTER, settings=settings, warm_start=_warm(name))
        out = tune_loop(SyntheticRunner(MODEL, CLUSTER, seed=7), store, tuner, Budget(trials=6, patience=10, confirm=1))
    got = [(t.origin, t.role, t.strategy.fingerprint[:16]) for t in out.trials]
    assert got == PINNED[name]["trials"]
    assert (out.best.strategy.fingerprint[:16], out.stop_reason) == (PINNED[name]["best"], PINNED[name]["stop"])

