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


def test_a_checkpoint_under_home_is_written_there(tmp_path, monkeypatch):
    """``trainer.save("~/ckpt")`` from Python made a folder named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    _write(ck.CheckpointStore("~/ckpt"), 1)
    assert not (tmp_path / "~").exists()
    _assert_step(ck.CheckpointStore(tmp_path / "home" / "ckpt"), 1)


@pytest.mark.parametrize("crash", ["weights", "state", "reading", "commit"])
def test_a_crash_mid_write_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch, crash):
    store = ck.CheckpointStore(tmp_path / "ckpt")
    _write(store, 1)

    class Crash(Exception):
        pass

    def half_written_weights(path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise Crash("disk gone while writing the weights")

    def half_written_state(path, items):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half a zip")
        raise Crash("disk gone while writing the state")

    def actor_dies_while_read():
        yield "ps/ps@node0/0.0/m", np.full(3, 2, np.float32)
        raise Crash("a parameter server died while its state was read")

    def no_commit(src, dst):
        raise Crash("power cut before the manifest was replaced")

    if crash == "state":
        monkeypatch.setattr(ck, "_write_npz", half_written_state)
    elif crash == "commit":
        monkeypatch.setattr(ck.os, "replace", no_commit)
    with pytest.raises(Crash):
        if crash == "weights":
            store.write(_manifest(2), half_written_weights, {})
        elif crash == "reading":
            store.write(_manifest(2), lambda path: open(path, "wb").close(), actor_dies_while_read())
        else:
            _write(store, 2)
    monkeypatch.undo()
    _assert_step(store, 1)
    # the next write commits and clears what the crash left behind
    _write(store, 3)
    _assert_step(store, 3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["manifest.json", "step-00000003"]


def test_arrays_stream_in_and_out_one_at_a_time(tmp_path):
    """``write`` takes (name, array) pairs as they come (a save reads the actors a batch at a
    time) and ``arrays`` reads an array only when asked: what np.savez/np.load would hold whole."""
    store = ck.CheckpointStore(tmp_path / "ckpt")
    produced, made = [], {"ps/a/0.0/m": np.arange(6, dtype=np.float32).reshape(2, 3),
                          "ps/a/0.0/v": np.ones(5, np.float64), "channel0/version": np.array(7)}

    def one_by_one():
        for name, array in made.items():
            produced.append(name)
            yield name, array

    store.write(_manifest(4), lambda path: open(path, "wb").close(), one_by_one())
    assert produced == list(made)
    manifest, info = store.read()
    with np.load(tmp_path / "ckpt" / manifest.directory / "state.npz") as plain:   # what np.load reads
        assert sorted(plain.files) == sorted(made)
    arrays = store.arrays(manifest)
    read = []
    real = arrays._npz.__class__.__getitem__
    try:
        arrays._npz.__class__.__getitem__ = lambda npz, k: read.append(k) or real(npz, k)
        assert sorted(arrays) == sorted(made) and len(arrays) == 3 and not read   # listing reads nothing
        for name, array in made.items():
            got = arrays[name]
            assert got.dtype == array.dtype and np.array_equal(got, array)
        assert read == list(made)
    finally:
        arrays._npz.__class__.__getitem__ = real
        arrays.close()
    with pytest.raises(KeyError):
        store.arrays(manifest)["ps/nothing"]


def test_a_damaged_state_file_is_refused_when_read(tmp_path):
    store = ck.CheckpointStore(tmp_path / "ckpt")
    _write(store, 1)
    manifest, _ = store.read()
    state = tmp_path / "ckpt" / manifest.directory / "state.npz"
    good = state.read_bytes()
    state.write_bytes(good[: len(good) // 3])   # cut: the archive's directory is gone
    with pytest.raises(ConfigError, match=r"restore: .*state.npz cannot be read .*the checkpoint is damaged"):
        store.arrays(manifest)
    state.write_bytes(b"not an archive at all")
    with pytest.raises(ConfigError, match=r"state.npz cannot be read .*damaged"):
        store.arrays(manifest)
    np.save(state.with_suffix(".npy"), np.zeros(3))
    state.write_bytes(state.with_suffix(".npy").read_bytes())   # an array, not an archive
    with pytest.raises(ConfigError, match=r"state.npz is not an .npz archive; the checkpoint is damaged"):
        store.arrays(manifest)
    header = good.index(b"\x93NUMPY")   # the array's header inside the archive, garbled
    state.write_bytes(good[:header] + b"\x00" * 10 + good[header + 10:])
    with pytest.raises(ConfigError, match=r"state.npz cannot be read .*damaged"):
        arrays = store.arrays(manifest)
        arrays["ps/ps@node0/0.0/m"]


def test_a_large_array_is_read_as_a_memory_map_checked_against_its_crc(tmp_path):
    """A restore holds the file's pages (the page cache), not a private copy of each large array;
    a damaged byte or a cut file is still refused when the array is read."""
    from autosync.runtime.state_file import MAP_BYTES

    store = ck.CheckpointStore(tmp_path / "ckpt")
    rng = np.random.default_rng(0)
    big = rng.standard_normal((MAP_BYTES // 8 + 3, 4)).astype(np.float32)   # over MAP_BYTES
    fortran = np.asfortranarray(rng.standard_normal((300, 500)))   # float64, column-major
    small = np.arange(5, dtype=np.int64)
    store.write(_manifest(2), lambda path: open(path, "wb").close(), {"big": big, "fortran": fortran, "small": small})
    manifest, _ = store.read()
    from autosync.runtime import state_file

    arrays, checked = store.arrays(manifest), []
    try:
        real = state_file.crc
        state_file.crc = lambda raw: checked.append(len(raw)) or real(raw)
        for name, want in (("big", big), ("fortran", fortran), ("small", small)):
            got = arrays[name]
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
            assert isinstance(got.base, np.memmap) == (want.nbytes >= MAP_BYTES)
            assert not got.flags.writeable or want.nbytes < MAP_BYTES
        assert arrays["fortran"].flags.f_contiguous and np.array_equal(arrays["big"], big)
        assert len(checked) == 2   # each mapped member's CRC once (a re-cut reads an old shard per new one)
    finally:
        state_file.crc = real
        arrays.close()
    state = tmp_path / "ckpt" / manifest.directory / "state.npz"
    good = state.read_bytes()
    data = good.index(big.tobytes()[:64])   # a byte inside the big array's values, flipped
    state.write_bytes(good[:data + 100] + bytes([good[data + 100] ^ 1]) + good[data + 101:])
    arrays = store.arrays(manifest)
    try:
        np.testing.assert_array_equal(arrays["small"], small)   # the other members read as before
        with pytest.raises(ConfigError, match=r"state.npz cannot be read \(big.npy: its bytes do not match the "
                                              r"archive's CRC\); the checkpoint is damaged"):
            arrays["big"]
    finally:
        arrays.close()


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
    for under in (tmp_path / "file" / "ckpt", tmp_path / "file" / "a" / "b"):   # was NotADirectoryError
        with pytest.raises(ConfigError, match=rf"checkpoint path {under} cannot be made: {tmp_path / 'file'} is a "
                                              rf"file, not a directory"):
            _write(ck.CheckpointStore(under), 1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="non-empty directory without manifest.json"):
        _write(ck.CheckpointStore(tmp_path / "mine"), 1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_mismatches_say_what_differs():
    saved = _manifest(3, data_positions=(3, 4))   # workers that drew different numbers of batches
    assert saved.mismatches(_manifest(0)) == []
    # as many batches each: another number of workers goes on (each from that position)
    assert _manifest(3).mismatches(_manifest(0, data_positions=(0, 0, 0))) == []
    other = dict(STRATEGY, variables=[STRATEGY["variables"][0], {"var": "dense/bias", "all_reduce": {}}])
    problems = saved.mismatches(_manifest(0, strategy=other, strategy_fingerprint="0" * 16, optimizer="SGD",
                                          data_positions=(0, 0, 0),
                                          variables=(("dense/kernel", (3, 4), "float32"), VARIABLES[1])))
    text = "\n".join(problems)
    assert "dense/kernel is ((3, 2), 'float32') in the checkpoint but ((3, 4), 'float32') in the model" in text
    assert "the optimizer is SGD but the checkpoint holds Adam state" in text
    assert "the strategy trains 3 workers but the checkpoint has 2, whose data positions differ ([3, 4])" in text
    assert "the strategy differs" in text and "dense/bias: checkpoint" in text and "all_reduce" in text
    assert "keras.Model.load_weights" in text


def test_a_save_reads_the_actors_in_bounded_batches():
    from autosync.runtime.session_state import BATCH_BYTES, batches

    sizes = {"a": 100, "b": 200, "c": 50, "d": 400, "e": 1}
    assert batches(sizes, 300) == [["a", "b"], ["c"], ["d"], ["e"]]   # d alone: bigger than the limit
    assert batches(sizes, 1) == [[k] for k in sizes] and batches({}, 300) == []
    assert batches(sizes) == [list(sizes)] and BATCH_BYTES >= 2 ** 20


@pytest.mark.parametrize("where", ["weights", "manifest"])
def test_a_full_disk_is_said_in_one_line_and_leaves_nothing_of_the_write(tmp_path, monkeypatch, where):
    import errno

    store = ck.CheckpointStore(tmp_path / "ckpt")
    _write(store, 1)

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "weights":
        write = lambda: store.write(_manifest(2), full, {})  # noqa: E731
    else:
        real_open = open
        monkeypatch.setattr("builtins.open", lambda path, *a, **k: full(path) if str(path).endswith(
            f"{ck._TMP_PREFIX}{ck.MANIFEST}") else real_open(path, *a, **k))
        write = lambda: _write(store, 2)  # noqa: E731
    with pytest.raises(OSError, match=r"checkpoint .*ckpt not written: No space left on device; what it wrote was "
                                      r"removed and the checkpoint written before is whole") as failed:
        write()
    monkeypatch.undo()
    assert failed.value.errno == errno.ENOSPC
    _assert_step(store, 1)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["manifest.json", "step-00000001"]
