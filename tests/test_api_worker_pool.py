"""``autosync.worker_pool``: tuning and then training in one script run on one set of workers (real
Ray and TensorFlow): the trainer reloads the tuner's workers instead of starting its own, and the
pool's exit kills them."""
from __future__ import annotations

import os

import pytest

from strategy_space import ConfigError
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR, still_running

pytestmark = pytest.mark.integration


def _pids(pool) -> dict:
    import ray

    return {slot: ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
            for slot, actor in pool.actors.items()}


def test_training_after_tuning_reloads_the_tuners_workers_and_the_pools_exit_kills_them(ray_session, tmp_path):
    import ray

    import autosync

    ray_session.cloudpickle.register_pickle_by_value(rm)
    model = rm.model_def("sgd", learning_rate=0.1)
    with autosync.worker_pool(PAIR) as pool:
        with pytest.raises(ConfigError, match="pool is for the workers tune starts with real compute; leave it out "
                                              "with compute 'emulated'"):
            autosync.tune(model, PAIR, compute="emulated", step_time_s=0.01, pool=pool)
        assert not pool.actors   # refused before any worker started
        result = autosync.tune(model, PAIR, trials=0, confirm=0, steps=2, warmup=1, precision=None, quality="exact",
                               warm_start="none", store=tmp_path / "t.db", pool=pool)
        assert result.best_trial.ok and len(result.baselines) >= 2
        tuned = _pids(pool)
        assert sorted(tuned) == ["node0:0", "node1:0"]   # tune left its workers running in the pool
        with autosync.make_trainer(model, "ps", PAIR, pool=pool) as trainer:
            assert trainer.pool is pool
            history = trainer.fit(steps=3)
            assert _pids(pool) == tuned   # the same processes trained: reloaded, not started anew
        assert len(history.loss) == 3 and all(loss == loss for loss in history.loss)
        assert _pids(pool) == tuned   # the trainer's close leaves a given pool's workers to its owner
        actors = list(pool.actors.values())
    assert not pool.actors
    # refused before the model is read (a name that is no model would fail that read), never a Ray of
    # its own started behind the user
    with pytest.raises(ConfigError, match=r"this worker pool is closed \(its worker_pool block ended\)"):
        autosync.make_trainer("zoo:no_such_model", "ps", PAIR, pool=pool)
    # the pool's exit killed them: their processes end (``ray.kill`` is asynchronous: a call made at
    # once may still be served) and Ray has them dead
    assert not still_running(tuned.values(), within_s=60), tuned
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_call__.remote(lambda self: 1), timeout=60)
    with autosync.worker_pool(PAIR) as other:
        for call in (lambda: autosync.make_trainer("zoo:no_such_model", "ps", "local", pool=other),
                     lambda: autosync.make_runner("zoo:no_such_model", "local", pool=other),
                     lambda: autosync.tune("zoo:no_such_model", "local", pool=other, store=tmp_path / "u.db")):
            with pytest.raises(ConfigError, match=r"the shared worker pool is bound to cluster pair \(real compute\), "
                                                  r"not local; use a pool made for this cluster"):
                call()
        with pytest.raises(ConfigError, match=r"to cluster pair \(real compute\), not pair with emulated compute"):
            autosync.make_runner("zoo:no_such_model", PAIR, compute="emulated", step_time_s=0.01, pool=other)
        with pytest.raises(ConfigError, match="pool must be the pool autosync.worker_pool gives"):
            autosync.make_trainer("zoo:no_such_model", "ps", "local", pool="local")
