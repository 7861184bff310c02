"""The checkpoint directory (``autosync.runtime.checkpoint``): atomic commits, damaged and foreign
manifests refused with messages that say why. No Ray, no TensorFlow: the weights writer is a fake."""
from __future__ import annotations

import json

import numpy as np
import pytest

from autosync.runtime import checkpoint as ck
from strategy_space.errors import ConfigError

VARIABLES = (("dense/kernel", (3, 2), "float32"), ("dense/bias", (2,), "float32"))
STRATEGY = {"version": 1, "variables": [{"var": "dense/kernel", "ps": {"destination": "node0"}},
                                        {"var": "dense/bias", "ps": {"destination": "node0"}}]}


def _manifest(step: int, **changes) -> ck.Manifest:
    fields = dict(step=step, data_positions=(step, step), model="m", variables=VARIABLES, optimizer="Adam",
                  strategy=STRATEGY, strategy_fingerprint="f" * 16,
                  ps_versions={"ps@node0": {"version": step, "chunk_version": [step]}})
    fields.update(changes)
    return ck.Manifest(**fields)


def _write(store, step: int, weights: bytes = b"weights", **kw):
    def write_weights(path):
        with open(path, "wb") as f:
            f.write(weights + bytes([step]))

    return store.write(_manifest(step), write_weights, {"ps/ps@node0/0.0/m": np.full(3, step, np.float32)}, **kw)


def _assert_step(store, step: int) -> None:
    manifest, info = store.read()
    assert manifest.step == step and manifest.data_positions == (step, step)
    with open(info.weights_path, "rb") as f:
        assert f.read() == b"weights" + bytes([step])
    arrays = store.arrays(manifest)
    assert list(arrays) == ["ps/ps@node0/0.0/m"] and np.array_equal(arrays["ps/ps@node0/0.0/m"], np.full(3, step))


def test_write_read_and_replace(tmp_path):
    store = ck.CheckpointStore(tmp_path / "ckpt")
    info = _write(store, 1)
    assert info.step == 1 and info.bytes > 0 and info.weights_path.endswith("/model.weights.h5")
    _assert_step(store, 1)
    _write(store, 2)
    _assert_step(store, 2)
    # one committed checkpoint: the previous step directory is gone
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["manifest.json", "step-00000002"]


@pytest.mark.parametrize("crash", ["weights", "state", "commit"])
def test_a_crash_mid_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch, crash):
    store = ck.CheckpointStore(tmp_path / "ckpt")
    _write(store, 1)

    class Crash(Exception):
        pass

    def half_written_weights(path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise Crash("disk gone while writing the weights")

    def half_written_state(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise Crash("disk gone while writing the state")

    def no_commit(src, dst):
        raise Crash("power cut before the manifest was replaced")

    if crash == "state":
        monkeypatch.setattr(ck.np, "savez", half_written_state)
    elif crash == "commit":
        monkeypatch.setattr(ck.os, "replace", no_commit)
    with pytest.raises(Crash):
        if crash == "weights":
            store.write(_manifest(2), half_written_weights, {})
        else:
            _write(store, 2)
    monkeypatch.undo()
    _assert_step(store, 1)
    # the next write commits and clears what the crash left behind
    _write(store, 3)
    _assert_step(store, 3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["manifest.json", "step-00000003"]


def test_missing_damaged_and_foreign_checkpoints_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint .*nowhere does not exist"):
        ck.CheckpointStore(tmp_path / "nowhere").read()
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="is not a checkpoint directory"):
        ck.CheckpointStore(tmp_path / "plain").read()
    store = ck.CheckpointStore(tmp_path / "ckpt")
    _write(store, 1)
    manifest = tmp_path / "ckpt" / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[: len(good) // 2])
    with pytest.raises(ConfigError, match="manifest .* cannot be read .* damaged"):
        store.read()
    body = json.loads(good)
    del body["step"]
    manifest.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=r"damaged checkpoint manifest: missing keys \['step'\]"):
        store.read()
    manifest.write_text(json.dumps(dict(json.loads(good), version=99)))
    with pytest.raises(ConfigError, match="format version 99 is not supported"):
        store.read()
    manifest.write_text(good)
    (tmp_path / "ckpt" / json.loads(good)["directory"] / "state.npz").unlink()
    with pytest.raises(ConfigError, match="lacks state.npz"):
        store.read()


def test_writing_refuses_a_file_or_a_foreign_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        _write(ck.CheckpointStore(tmp_path / "file"), 1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="non-empty directory without manifest.json"):
        _write(ck.CheckpointStore(tmp_path / "mine"), 1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_mismatches_say_what_differs():
    saved = _manifest(3)
    assert saved.mismatches(_manifest(0)) == []
    other = dict(STRATEGY, variables=[STRATEGY["variables"][0], {"var": "dense/bias", "all_reduce": {}}])
    problems = saved.mismatches(_manifest(0, strategy=other, strategy_fingerprint="0" * 16, optimizer="SGD",
                                          data_positions=(0, 0, 0),
                                          variables=(("dense/kernel", (3, 4), "float32"), VARIABLES[1])))
    text = "\n".join(problems)
    assert "dense/kernel is ((3, 2), 'float32') in the checkpoint but ((3, 4), 'float32') in the model" in text
    assert "the optimizer is SGD but the checkpoint holds Adam state" in text
    assert "the strategy trains 3 workers but the checkpoint has 2" in text
    assert "the strategy differs" in text and "dense/bias: checkpoint" in text and "all_reduce" in text
    assert "keras.Model.load_weights" in text
