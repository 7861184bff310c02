"""The benchmarks' clipped zoo models (``benchmarks/clipped_models.py``): the zoo model with its own
optimizer, now clipping by the global norm, reachable as ``script.py:function`` by the profiles."""
from __future__ import annotations

import os

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.integration
@pytest.mark.parametrize("name", ["ncf", "dlrm"])
def test_a_clipped_zoo_model_keeps_its_optimizer_and_clips_by_the_global_norm(monkeypatch, name):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import clipped_models
    from tune_vs_baselines import source_of

    from autosync.models.zoo import get_model_def

    clipped, zoo = getattr(clipped_models, name)(), get_model_def(name)
    got, want = clipped.optimizer_fn(), zoo.optimizer_fn()
    assert type(got) is type(want) and got.global_clipnorm == clipped_models.CLIPNORM and want.global_clipnorm is None
    same = lambda config: {k: v for k, v in config.items() if k not in ("global_clipnorm", "name")}  # noqa: E731
    assert same(got.get_config()) == same(want.get_config())   # (Keras numbers a second optimizer's name)
    assert clipped.name == f"{zoo.name}-clipped" and clipped.batch_size == zoo.batch_size
    assert source_of(f"benchmarks/clipped_models.py:{name}") == f"benchmarks/clipped_models.py:{name}"
    assert source_of(name) == f"zoo:{name}"
