"""Random layers and random data on real Ray + TensorFlow (``autosync.runtime.random_seeds``):
each worker draws its own dropout masks and noise, as one process on the global batch draws each
example's, and samples its own data from the process-wide generators; a trial does not depend on
what the warm workers ran before; a restored run draws what the uninterrupted one would have."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import _model_spec
from tests.test_runtime_user_optimizer import _strategy

pytestmark = pytest.mark.integration
STEPS = 3


def _reference(md, num_workers: int, steps: int, own_streams: bool = True) -> list:
    """One process: each step, every worker's gradient on its batch with its generators in the
    state the worker holds (``own_streams``: its own stream, and its data drawn under its own
    seed; else all share worker 0's, as before each worker had one), then their mean applied."""
    import itertools

    import keras
    import tensorflow as tf

    from autosync.runtime import random_seeds

    # each worker's batches drawn whole first: the process-wide generators are one per process
    data = [list(itertools.islice(random_seeds.seeded(random_seeds.worker_seed(md.seed, k if own_streams else 0),
                                                      md.batches(k, num_workers)), steps))
            for k in range(num_workers)]
    keras.utils.set_random_seed(md.seed)
    model = md.build_model()
    generators = random_seeds.seed_states(model)
    initial = [v.numpy() for v in generators]
    states = [[random_seeds.worker_state(s, k if own_streams else 0) for s in initial] for k in range(num_workers)]
    loss_fn, optimizer = md.loss(), md.optimizer_fn()
    streams = [iter(d) for d in data]
    for _ in range(steps):
        grads = []
        for k in range(num_workers):
            random_seeds.assign(generators, states[k])
            x, y = next(streams[k])
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads.append(tape.gradient(loss, model.trainable_variables))
            states[k] = [v.numpy() for v in generators]
        optimizer.apply_gradients(zip([sum(g) / num_workers for g in zip(*grads)], model.trainable_variables))
    return model.get_weights()


def _fit(pool, md, strategy, steps=STEPS, **kw):
    from autosync.runtime.trainer import Trainer

    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120, **kw) as trainer:
        trainer.fit(steps=steps, steps_per_call=2)
        return trainer.get_weights()


def _close(a, b) -> bool:
    return all(np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


@pytest.mark.parametrize("strategy", ["ps", "gloo", "graph"])
def test_each_worker_draws_its_own_masks_and_a_trial_does_not_depend_on_the_last(pool, strategy):
    # every worker gets the same batches: only their random layers tell their gradients apart
    md = rm.dropout_model_def("sgd", learning_rate=0.2)
    spec = _model_spec(pool, md)
    chosen = _strategy(strategy, spec)
    got = _fit(pool, md, chosen)
    expected = _reference(md, 2, STEPS)
    for g, want, var in zip(got, expected, spec.variables):
        assert np.allclose(g, want, rtol=1e-5, atol=1e-6), (strategy, var.name, np.abs(g - want).max())
    # not vacuous: with one stream shared by both workers (the masks alike) the weights differ
    assert not _close(expected, _reference(md, 2, STEPS, own_streams=False))
    # the warm workers' generators moved on during that trial: the next starts from the same state
    assert all(np.array_equal(a, b) for a, b in zip(_fit(pool, md, chosen), got))


@pytest.mark.parametrize("strategy", ["ps", "gloo"])
def test_data_sampled_from_the_global_generators_differs_per_worker(pool, strategy):
    """A ``dataset_fn`` that samples with ``np.random`` unseeded gave every worker the same
    batches (every worker had seeded the process-wide generators alike to build the model)."""
    md = rm.dropout_model_def("sgd", learning_rate=0.2, dataset=rm.global_rng_batches)
    got = _fit(pool, md, _strategy(strategy, _model_spec(pool, md)))
    expected = _reference(md, 2, STEPS)
    for g, want in zip(got, expected):
        assert np.allclose(g, want, rtol=1e-5, atol=1e-6), (strategy, np.abs(g - want).max())
    assert not _close(expected, _reference(md, 2, STEPS, own_streams=False))


def test_a_restored_run_draws_what_the_uninterrupted_run_would_have(pool, tmp_path):
    from autosync.runtime.trainer import Trainer

    # its random layers' masks and its data (sampled from numpy's global generator) alike
    md = rm.dropout_model_def("adam", learning_rate=0.05, dataset=rm.global_rng_batches)
    strategy = _strategy("ps", _model_spec(pool, md))
    ckpt = tmp_path / "ckpt"
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(ckpt)
        trainer.fit(steps=3)
        straight = trainer.get_weights()
    (npz,) = glob.glob(os.path.join(ckpt, "step-*", "state.npz"))
    with np.load(npz) as data:
        seeds = {k: data[k] for k in data.files if k.startswith("seeds/")}
    # two generators (Dropout, GaussianNoise) per worker, each worker's own, moved on by 2 steps
    assert sorted(seeds) == ["seeds/0/0", "seeds/0/1", "seeds/1/0", "seeds/1/1"], sorted(seeds)
    assert seeds["seeds/0/0"][0] != seeds["seeds/1/0"][0] and seeds["seeds/0/0"][1] >= 2
    with Trainer(md, strategy, PAIR, pool=pool, timeout_s=120, restore=ckpt) as again:
        again.fit(steps=3, steps_per_call=2)
        continued = again.get_weights()
    for got, want in zip(continued, straight):
        assert np.allclose(got, want, rtol=1e-6, atol=1e-7), np.abs(got - want).max()
    for got, want in zip(continued, _reference(md, 2, 5)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


def test_workers_that_draw_the_same_data_are_warned_of_through_the_api(pool):
    import dataclasses

    from autosync.runtime.data_check import SameDataWarning

    # a name of its own: the pool loads it afresh, and every worker reports its first batch
    md = dataclasses.replace(rm.dropout_model_def("sgd", learning_rate=0.1), name="tiny_same_data")
    with pytest.warns(SameDataWarning, match=r"model tiny_same_data: workers node0:0, node1:0 all drew the same"):
        _fit(pool, md, _strategy("ps", _model_spec(pool, md)), steps=1)


def test_weights_a_model_makes_when_first_called_are_alike_on_every_worker(pool):
    """A subclassed model builds on its first call, in the worker's load: before the worker's own
    data seed is set, so an initializer made then draws its seed alike on every worker (the
    workers' initial weights are compared: different ones are refused)."""
    import dataclasses

    md = dataclasses.replace(rm.dropout_model_def("sgd", learning_rate=0.1, dataset=rm.global_rng_batches),
                             name="tiny_lazy", model_fn=rm.build_lazy_model)
    weights = _fit(pool, md, _strategy("ps", _model_spec(pool, md)), steps=1)
    assert len(weights) == 1 and weights[0].shape == (rm.FEATURES, 1)
