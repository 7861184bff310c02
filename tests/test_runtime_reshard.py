"""A checkpoint restored under another strategy (real Ray + TensorFlow): the optimizer state is
re-cut for the new strategy's shards and holders, and training goes on as one process on the
global batch would, whichever holders kept the state before (parameter servers on the numpy rules
or on the Keras optimizer, the numpy all-reduce, the graph) and after."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import autosync

from strategy_space import PS, AllReduce, Strategy, VarConfig
from strategy_space.errors import ConfigError
from tests import runtime_models as rm
from tests.runtime_helpers import PAIR
from tests.test_runtime_ps import _model_spec

pytestmark = pytest.mark.integration


def _strategy(pool, md, name: str):
    from strategy_space.builders import get_builder

    if name == "mix":   # a variable's shards on a PS and all-reduced (gloo), others in the graph and on PSs
        return Strategy((
            VarConfig("emb/embeddings", (PS("node0"), PS("node1"))),
            VarConfig("hidden/kernel", (AllReduce(backend="gloo", group=0), PS("node1")), axis=1),
            VarConfig("hidden/bias", (AllReduce(backend="graph", group=1),)),
            VarConfig("out/kernel", (PS("node0"),)),
            VarConfig("out/bias", (AllReduce(backend="gloo", group=0),)),
        ))
    builder, options = {"ps": ("ps", {}), "partitioned_ps": ("partitioned_ps", {"min_partition_bytes": 1}),
                        "graph": ("all_reduce", {"backend": "graph"}),
                        "gloo": ("all_reduce", {"backend": "gloo", "chunk_bytes": 64})}[name]
    return get_builder(builder, **options).build(_model_spec(pool, md), PAIR)


# before -> after: every kind of holder gives its state and takes one (Adam: numpy rules on PSs and
# the numpy all-reduce; RMSprop with momentum: the Keras optimizer there; the graph: Keras' own)
CASES = [("adam", "partitioned_ps", "gloo"), ("adam", "mix", "partitioned_ps"), ("adam", "graph", "ps"),
         ("rmsprop", "mix", "graph")]


@pytest.mark.parametrize("optimizer,before,after", CASES)
def test_a_checkpoint_restored_under_another_strategy_trains_on_as_one_process(pool, tmp_path, optimizer, before,
                                                                              after):
    from autosync.runtime.trainer import Trainer

    opts = {"adam": {}, "rmsprop": {"momentum": 0.5}}[optimizer]
    md = rm.model_def("adam" if optimizer == "adam" else "RMSprop", learning_rate=0.05, **opts)
    first, second = _strategy(pool, md, before), _strategy(pool, md, after)
    assert first.fingerprint != second.fingerprint
    with Trainer(md, first, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "ckpt")
    index = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["state_index"]
    assert any(isinstance(e, list) for e in index.values())   # the slots are described
    if after == "ps":   # as the README shows it: the strategy by name
        again = autosync.make_trainer(md, "ps", PAIR, pool=pool, timeout_s=120, restore=str(tmp_path / "ckpt"))
        assert again.strategy.fingerprint == second.fingerprint
    else:
        again = Trainer(md, second, PAIR, pool=pool, timeout_s=120, restore=tmp_path / "ckpt")
    with again:
        assert again.step == 2
        again.fit(steps=3, steps_per_call=1)
        continued = again.get_weights()
    for got, want in zip(continued, rm.reference_weights(md, num_workers=2, steps=5)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


def test_the_state_is_needed_a_restore_without_it_trains_otherwise(pool, tmp_path, monkeypatch):
    """The check above can fail: the same restore with the re-cut slots zeroed ends elsewhere."""
    from autosync.runtime import reshard
    from autosync.runtime.trainer import Trainer

    md = rm.model_def("adam", learning_rate=0.05)
    with Trainer(md, _strategy(pool, md, "partitioned_ps"), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "ckpt")
    cut = reshard.Recut._cut
    monkeypatch.setattr(reshard.Recut, "_cut", lambda self, *a: np.zeros_like(cut(self, *a)))
    with Trainer(md, _strategy(pool, md, "gloo"), PAIR, pool=pool, timeout_s=120, restore=tmp_path / "ckpt") as again:
        again.fit(steps=3, steps_per_call=1)
        continued = again.get_weights()
    want = rm.reference_weights(md, num_workers=2, steps=5)
    assert not all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(continued, want))


def test_a_checkpoint_without_its_index_or_of_an_asynchronous_ps_is_refused_saying_why(pool, tmp_path):
    from autosync.runtime.trainer import Trainer

    md = rm.model_def("adam", learning_rate=0.05)
    names = ["emb/embeddings", "hidden/kernel", "hidden/bias", "out/kernel", "out/bias"]
    async_ps = Strategy(tuple(VarConfig(n, (PS("node0", sync=False),)) for n in names))
    with Trainer(md, async_ps, PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "async")
    gloo = _strategy(pool, md, "gloo")
    with pytest.raises(ConfigError, match=r"restore .*async: the checkpoint was written under another strategy, "
                                          r"and its parameter servers' update counters"):
        Trainer(md, gloo, PAIR, pool=pool, timeout_s=120, restore=tmp_path / "async")

    manifest = json.loads((tmp_path / "async" / "manifest.json").read_text())
    del manifest["state_index"]   # as a checkpoint written before the index was kept
    (tmp_path / "async" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"the strategy differs from the checkpoint's, the only one it restores "
                                          r"onto \(it predates the index that lets optimizer state be re-cut"):
        Trainer(md, gloo, PAIR, pool=pool, timeout_s=120, restore=tmp_path / "async")


@pytest.mark.parametrize("before,after", [("ps", "gloo")])
def test_the_update_count_after_a_skipped_step_survives_a_change_of_strategy(pool, tmp_path, before, after):
    """Dynamic loss scaling skipped step 1: Adam's bias correction goes on from 1 applied update,
    whether the old strategy's holders counted it (the numpy all-reduce) or not (its parameter
    servers are told by the workers: the count is the step less the skipped steps)."""
    from autosync.runtime.trainer import Trainer

    md = rm.model_def("adam", dataset=rm.nan_batches, learning_rate=0.05,
                      loss_scale={"initial_scale": 2.0 ** 10, "dynamic_growth_steps": 1})
    with Trainer(md, _strategy(pool, md, before), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "ckpt")
    with Trainer(md, _strategy(pool, md, after), PAIR, pool=pool, timeout_s=120, restore=tmp_path / "ckpt") as again:
        again.fit(steps=2, steps_per_call=1)
        weights = again.get_weights()
    for got, want in zip(weights, rm.reference_weights(md, num_workers=2, steps=4)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


def test_parameter_servers_cut_into_blocks_for_pipelining_restore_whole_elsewhere(pool, tmp_path, monkeypatch):
    """A PS variable cut into row blocks for pipelining (``SyncPlan.segmented``) is saved by
    block; restored under partitioned shards the blocks are joined and cut again, and back."""
    from autosync.runtime import engine
    from autosync.runtime.trainer import Trainer

    monkeypatch.setattr(engine, "PS_CHUNK_MIN_BYTES", 1)   # the tiny model's dense variables cut
    md = rm.model_def("adam", learning_rate=0.05)
    with Trainer(md, _strategy(pool, md, "ps"), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "ckpt")
    index = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["state_index"]
    blocks = {tuple(e[:4]) for e in index.values() if isinstance(e, list) and e[0] == 1}
    assert len(blocks) > 1, index   # hidden/kernel was held in row blocks
    monkeypatch.undo()
    with Trainer(md, _strategy(pool, md, "partitioned_ps"), PAIR, pool=pool, timeout_s=120,
                 restore=tmp_path / "ckpt") as again:
        again.fit(steps=3, steps_per_call=1)
        continued = again.get_weights()
    for got, want in zip(continued, rm.reference_weights(md, num_workers=2, steps=5)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


def test_a_checkpoint_before_some_holders_had_updated_restores_elsewhere(pool, tmp_path):
    """Saved at step 0 under a mix (RMSprop: the Keras optimizer on the parameter servers and the
    numpy all-reduce builds its slots at its first update; the graph's is built already): the
    graph after it takes the slots the checkpoint has and starts the others as they start."""
    from autosync.runtime.trainer import Trainer

    md = rm.model_def("RMSprop", learning_rate=0.05, momentum=0.5)
    with Trainer(md, _strategy(pool, md, "mix"), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.save(tmp_path / "ckpt")
    index = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["state_index"]
    assert {e[0] for e in index.values() if isinstance(e, list)} == {2}   # hidden/bias, in the graph
    with Trainer(md, _strategy(pool, md, "graph"), PAIR, pool=pool, timeout_s=120, restore=tmp_path / "ckpt") as again:
        again.fit(steps=3, steps_per_call=1)
        continued = again.get_weights()
    for got, want in zip(continued, rm.reference_weights(md, num_workers=2, steps=3)):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


def test_a_checkpoint_restores_onto_another_number_of_workers(pool, tmp_path):
    """Two workers, saved, one worker (another strategy), saved, two again: each
    worker goes on from the saved position in its own part of the data, on the new global batch,
    as one process would; a checkpoint whose workers drew different numbers of batches is refused."""
    from autosync.runtime.checkpoint import Manifest
    from autosync.runtime.trainer import Trainer

    md = rm.model_def("adam", learning_rate=0.05)
    with Trainer(md, _strategy(pool, md, "ps"), PAIR, pool=pool, timeout_s=120) as trainer:
        trainer.fit(steps=2, steps_per_call=1)
        trainer.save(tmp_path / "two")
    # one worker of the pair trains, its parameter server on the other node
    alone = Strategy(tuple(VarConfig(v.name, (PS("node1"),)) for v in _model_spec(pool, md).variables),
                     replicas=("node0:0",))
    with Trainer(md, alone, PAIR, pool=pool, timeout_s=120, restore=tmp_path / "two") as again:
        assert again.step == 2
        again.fit(steps=3, steps_per_call=1)
        continued = again.get_weights()
        again.save(tmp_path / "one")
    for got, want in zip(continued, rm.reference_weights(md, num_workers=2, steps=2, then=((1, 3),))):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()
    with Trainer(md, _strategy(pool, md, "gloo"), PAIR, pool=pool, timeout_s=120, restore=tmp_path / "one") as back:
        back.fit(steps=2, steps_per_call=1)
        last = back.get_weights()
    for got, want in zip(last, rm.reference_weights(md, num_workers=2, steps=2, then=((1, 3), (2, 2)))):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()

    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    uneven = Manifest.from_dict(dict(manifest, data_positions=[2, 3]), "here")
    said = uneven.mismatches(dataclasses.replace(uneven, data_positions=(0,)))
    assert len(said) == 1 and "whose data positions differ ([2, 3])" in said[0], said
