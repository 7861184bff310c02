"""The global batch kept on fewer workers (real Ray + TensorFlow): a checkpoint of two workers
restored onto one with ``keep_global_batch`` trains on as the uninterrupted two would, to their
weights, the one worker drawing both parts' batches (numpy's process-wide generator kept per
part, gradient accumulation's chunks in turn); its checkpoints keep both parts' positions; a
strategy that reduces inside the training step is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strategy_space import PS, AllReduce, Strategy, VarConfig
from strategy_space.errors import ConfigError
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import _model_spec

pytestmark = pytest.mark.integration


def global_rng_ids(worker: int, num_workers: int):
    """``rm.make_batches``' kind of batch, drawn from numpy's process-wide generator (unseeded here,
    as quick scripts do): each part draws what its own worker would only if its stream is its own."""
    while True:
        x = np.random.randint(0, rm.VOCAB, size=(8, rm.IDS)).astype("int32")
        yield x, np.sin(x.sum(axis=1, keepdims=True) / 7.0).astype("float32")


def _on(pool, md, where: tuple, backend: str | None = None, replicas: tuple = ()) -> Strategy:
    sync = (lambda: AllReduce(backend=backend)) if backend else (lambda: PS(where[0]))
    return Strategy(tuple(VarConfig(v.name, (sync(),)) for v in _model_spec(pool, md).variables), replicas=replicas)


def test_one_worker_keeping_two_workers_global_batch_trains_to_their_weights(pool, tmp_path):
    from autosync.runtime.trainer import Trainer

    accumulate = 2   # a step draws two batches of one part, then two of the other
    extra = {"gradient_accumulation_steps": accumulate}
    md = rm.model_def("sgd", learning_rate=0.05, dataset=global_rng_ids, **extra)   # (Adam hides a scale)
    two = _on(pool, md, ("node1",))
    with Trainer(md, two, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "two")
        trainer.fit(steps=3, steps_per_call=2)
        uninterrupted = trainer.get_weights()
    alone = _on(pool, md, ("node1",), replicas=("node0:0",))
    with Trainer(md, alone, PAIR, pool=pool, timeout_s=120, restore=tmp_path / "two", keep_global_batch=True) as one:
        one.fit(steps=3, steps_per_call=2)
        kept = one.get_weights()
        one.save(tmp_path / "one")   # (two workers go on from it exactly: ``test_runtime_multinode``)
    assert json.loads((tmp_path / "one" / "manifest.json").read_text())["data_positions"] == [5 * accumulate] * 2
    for got, want in zip(kept, uninterrupted):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


def test_keeping_the_global_batch_with_the_graph_reducing_in_the_step_is_refused_at_once(pool):
    """Refused when the trainer starts, not when an elastic fit loses a node."""
    from autosync.runtime.trainer import Trainer

    md = rm.model_def("adam", learning_rate=0.05)
    with pytest.raises(ConfigError, match="reduces all-reduce groups inside the training step"):
        Trainer(md, _on(pool, md, (), backend="graph"), PAIR, pool=pool, timeout_s=120, keep_global_batch=True)
