"""A large model read in a process of its own (``autosync.models.apart``): its variables counted as
the driver builds it, the build stopped at the limit before that variable's memory is taken, and
what the driver reads of it there (its ModelSpec, its profile, its optimizer's pins, its probe key)
the same as read here, warnings and errors included; the command line with it."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from autosync.model_def import ModelDef
from autosync.models import apart
from strategy_space.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, DIM = 3000, 24
WEIGHTS = ROWS * DIM * 4 + (2 * DIM * 7 + 7) * 2 + 4 * 7 * 4 + (7 + 1) * 4   # _functional's: table, float16 kernel...


def _functional():
    import keras

    ids = keras.Input((2,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(ROWS, DIM, name="table")(ids))
    x = keras.layers.Dense(7, name="half", dtype="float16")(x)
    x = keras.layers.BatchNormalization(name="norm")(x)   # non-trainable weights count too
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def _unused_layer():
    import keras

    ids = keras.Input((2,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(ROWS, DIM, name="table")(ids))
    unused = keras.layers.Dense(3, name="unused")
    unused.build((None, 2 * DIM))
    model = keras.Model(ids, keras.layers.Dense(1, name="out")(x))
    model.unused = unused   # tracked: its variables are the model's, and no loss depends on them
    return model


def _batches(worker_index, num_workers):
    rng = np.random.default_rng(worker_index)
    for _ in range(4):
        yield rng.integers(0, ROWS, (16, 2)).astype("int32"), rng.random((16, 1)).astype("float32")


def _no_batches(worker_index, num_workers):
    return iter(())


def _loss():
    import keras

    return keras.losses.MeanSquaredError()


def _adam():
    import keras

    return keras.optimizers.Adam(1e-3, global_clipnorm=1.0)


def _def(model_fn=_functional, dataset_fn=_batches) -> ModelDef:
    return ModelDef(name="toy", model_fn=model_fn, dataset_fn=dataset_fn, loss_fn=_loss, optimizer_fn=_adam,
                    batch_size=16)


def _counted(monkeypatch) -> list:
    calls = []
    real = apart.call

    def call(fn, *args, **kwargs):
        calls.append(fn.__name__)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(apart, "call", call)
    return calls


def _made(limit) -> tuple:
    """(the watch, whether the build was stopped, the Keras method patched during it) of a build
    of ``_functional`` while ``watching(limit)``."""
    from keras.src import backend

    with apart.watching(limit) as watch:
        patched = getattr(backend.BackendVariable, apart._MAKES_VALUE)
        try:
            _functional()
            stopped = False
        except apart.TooLarge:
            stopped = True
    return watch, stopped, patched


@pytest.mark.integration
def test_each_variable_is_counted_before_its_value_is_made_and_the_one_at_the_limit_stops_the_build():
    from keras.src import backend

    before = getattr(backend.BackendVariable, apart._MAKES_VALUE)
    watch, stopped, patched = _made(math.inf)
    weights = sum(int(np.asarray(w.numpy()).nbytes) for w in _functional().weights)
    assert not stopped and not watch.crossed
    assert watch.bytes == weights == WEIGHTS
    assert patched is not before and getattr(backend.BackendVariable, apart._MAKES_VALUE) is before
    watch, stopped, _ = _made(ROWS * DIM * 4)   # the table, the first variable, reaches it alone
    assert stopped and watch.crossed and watch.bytes == ROWS * DIM * 4
    assert getattr(backend.BackendVariable, apart._MAKES_VALUE) is before


@pytest.mark.integration
def test_only_the_watching_threads_variables_count():
    import threading

    with apart.watching(1) as watch:
        other = threading.Thread(target=_functional)
        other.start()
        other.join(timeout=120)
    assert not other.is_alive() and watch.bytes == 0 and not watch.crossed


_BUILDS = []


def _counted_unused_layer():
    _BUILDS.append(os.getpid())
    return _unused_layer()


def _swallowing():
    """A factory that falls back to a small table when the large one fails to build."""
    import keras

    ids = keras.Input((2,), dtype="int32")
    try:
        x = keras.layers.Embedding(ROWS, DIM, name="table")(ids)
    except Exception:   # noqa: BLE001 - what a user's fallback does
        x = keras.layers.Embedding(10, DIM, name="table")(ids)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(x)))


@pytest.mark.integration
def test_a_model_under_the_limit_is_built_once_here_and_one_over_it_there(monkeypatch):
    from autosync.models import ingest

    calls = _counted(monkeypatch)
    unused = "the loss does not depend on 2 trainable variable\\(s\\) \\(unused/kernel"
    # the table, the layer no loss reaches, the output layer (and the optimizer's 3 x 5 stand-ins: full_size_slots)
    monkeypatch.setenv(apart.ENV, str(ROWS * DIM * 4 + (2 * DIM * 3 + 3 + 2 * DIM + 1) * 4 + 1024))
    _BUILDS.clear()
    with pytest.warns(UserWarning, match=unused):
        small = ingest.model_spec_from_def(_def(_counted_unused_layer))
    assert _BUILDS == [os.getpid()] and calls == []
    monkeypatch.setenv(apart.ENV, str(ROWS * DIM * 4))
    with pytest.warns(UserWarning, match=unused):   # said in the child, given again here
        large = ingest.model_spec_from_def(_def(_counted_unused_layer))
    assert _BUILDS == [os.getpid(), os.getpid()] and calls == ["spec_here"]   # stopped here, built there
    assert large == small
    # a factory that swallowed the stop and built something else here is read there all the same
    swallowed = ingest.model_spec_from_def(_def(_swallowing))
    assert calls == ["spec_here", "spec_here"] and swallowed.var("table/embeddings").shape == (ROWS, DIM)


@pytest.mark.integration
def test_what_the_driver_reads_apart_is_what_it_reads_here(monkeypatch):
    from autosync.models import profile
    from autosync.models.training_key import training_digest
    from autosync.search_limits import built_model_optimizer

    model_def = _def()
    monkeypatch.setenv(apart.ENV, "inf")
    profiled_here = profile.profiled_model_spec(model_def, timed_steps=2)
    optimizer_here, digest_here = built_model_optimizer(model_def), training_digest(model_def, 2)
    calls = _counted(monkeypatch)
    monkeypatch.setenv(apart.ENV, str(ROWS * DIM * 4))   # the table alone reaches it
    profiled = profile.profiled_model_spec(model_def, timed_steps=2)
    optimizer = built_model_optimizer(model_def)
    digest = training_digest(model_def, 2)
    assert calls == ["_profiled_here", "_built_here", "built_digest"]   # (the spec alone: the test above)
    assert profiled.variables == profiled_here.variables and profiled.global_clipnorm and profiled.optimizer_slots == 2
    assert profiled.profile.step_time_s > 0 and profiled.profile.ready_order == profiled_here.profile.ready_order
    assert optimizer[0] == optimizer_here[0]
    assert ({k: v for k, v in optimizer[1].items() if k != "name"}
            == {k: v for k, v in optimizer_here[1].items() if k != "name"})
    assert digest == digest_here


@pytest.mark.integration
def test_tunes_profile_brings_the_probe_key_along_from_its_process(monkeypatch):
    """``tune`` profiles the model (``digest_workers``: its cluster's workers), then its probes ask
    for the model's probe key: a large model's one child gives both, the key equal to the one read
    here; another number of workers or another ModelDef object is read again."""
    import dataclasses

    from autosync.models import profile
    from autosync.models.training_key import training_digest

    model_def = _def()
    monkeypatch.setenv(apart.ENV, "inf")
    digest_here = training_digest(model_def, 2)
    calls = _counted(monkeypatch)
    monkeypatch.setenv(apart.ENV, str(10**9))   # a limit the model is under: read here, nothing taken along
    profile.profiled_model_spec(model_def, timed_steps=2, digest_workers=2)
    assert training_digest(model_def, 2) == digest_here and calls == []
    monkeypatch.setenv(apart.ENV, str(ROWS * DIM * 4))   # the table alone reaches it
    profiled = profile.profiled_model_spec(model_def, timed_steps=2, digest_workers=2)
    assert profiled.profile.step_time_s > 0 and profiled.var("table/embeddings").shape == (ROWS, DIM)
    assert training_digest(model_def, 2) == digest_here
    assert calls == ["_aside"]   # one process for both
    asked = []
    monkeypatch.setattr(apart, "call", lambda fn, model_def, workers, code: asked.append((fn.__name__, workers)))
    training_digest(model_def, 3)
    training_digest(dataclasses.replace(model_def), 2)
    assert asked == [("built_digest", 3), ("built_digest", 2)]   # read again (no process started here)


def _lr():
    return 0.01


def _callable_rate():
    import keras

    return keras.optimizers.SGD(learning_rate=_lr)   # refused by the runtime: a callable learning rate


@pytest.mark.integration
def test_emulated_tunes_profile_brings_the_optimizers_pins_and_the_probe_key_along(monkeypatch):
    """``tune --compute emulated`` of a trainable model profiles it, asks for its optimizer's pins,
    then its probe key: one build for the first two (here), one process for all three (apart)."""
    import dataclasses

    from autosync import search_limits
    from autosync.models.training_key import training_digest

    model_def = _def()
    monkeypatch.setenv(apart.ENV, "inf")
    pins_here, digest_here = search_limits.built_model_optimizer(model_def), training_digest(model_def, 2)
    real = search_limits._built_here
    built = []
    monkeypatch.setattr(search_limits, "_built_here", lambda md: built.append(md) or real(md))
    spec = search_limits.profiled_with_pins(model_def, 2)
    assert search_limits.built_model_optimizer(model_def)[1] == search_limits._PINNED.get(model_def)[1]
    assert built == [] and spec.profile.step_time_s > 0   # the pins from the profile's own build
    calls = _counted(monkeypatch)
    monkeypatch.setenv(apart.ENV, str(ROWS * DIM * 4))   # the table alone reaches it
    other = _def()
    spec = search_limits.profiled_with_pins(other, 2)
    pins = search_limits.built_model_optimizer(other)
    assert training_digest(other, 2) == digest_here and calls == ["_aside"] and built == []
    assert spec.variables == pins_here[0].variables and spec.profile.step_time_s > 0
    assert ({k: v for k, v in pins[1].items() if k != "name"}
            == {k: v for k, v in pins_here[1].items() if k != "name"})
    # an optimizer the runtime refuses is profiled (emulated trials apply their own) and refused
    # where the pins are asked for, as without the profile
    refused = dataclasses.replace(_def(), optimizer_fn=_callable_rate)
    with pytest.raises(ConfigError) as plain:
        search_limits.built_model_optimizer(dataclasses.replace(refused))
    assert search_limits.profiled_with_pins(refused, 2).profile.step_time_s > 0
    with pytest.raises(ConfigError) as taken:
        search_limits.built_model_optimizer(refused)
    assert str(taken.value) == str(plain.value) and "learning_rate" in str(plain.value)


HANGS = """from autosync.time_limit import bounded
import time

def hangs(model_def):
    with bounded(f"ModelDef {model_def.name}: building the model"):
        time.sleep(60)
"""


@pytest.mark.integration
def test_a_hang_there_is_stopped_there_naming_the_users_line(tmp_path, monkeypatch):
    """As a script's function reaches the child: pickled by value (``models.script``), its file kept."""
    import importlib

    from autosync.time_limit import CodeTimeout

    (tmp_path / "apart_hangs.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("apart_hangs")
    for name in apart._PICKLERS:
        importlib.import_module(name).register_pickle_by_value(module)
    monkeypatch.setenv("AUTOSYNC_MODEL_TIMEOUT", "1")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])   # by value, not by import
    try:
        with pytest.raises(CodeTimeout, match=f"^ModelDef toy: building the model did not finish within 1 s and was "
                                              f"stopped at {tmp_path / 'apart_hangs.py'}:6 in hangs "):
            apart.call(module.hangs, _def())
    finally:
        for name in apart._PICKLERS:
            importlib.import_module(name).unregister_pickle_by_value(module)


def _locked_functional(lock):
    with lock:
        return _functional()


@pytest.mark.integration
def test_a_model_that_does_not_pickle_is_read_here_with_a_warning(monkeypatch):
    import functools
    import threading

    from autosync.models import ingest

    monkeypatch.setenv(apart.ENV, str(ROWS * DIM * 4))
    with pytest.warns(UserWarning, match=r"model toy does not pickle \(TypeError: .*\), so it cannot be read in a "
                                         r"process of its own; it is read in this process, which keeps about 3x"):
        spec = ingest.model_spec_from_def(_def(functools.partial(_locked_functional, threading.Lock())))
    assert spec.var("table/embeddings").shape == (ROWS, DIM)


@pytest.mark.integration
def test_the_childs_errors_are_the_drivers(monkeypatch):
    from autosync.models import ingest

    calls = _counted(monkeypatch)
    monkeypatch.setenv(apart.ENV, "inf")
    with pytest.raises(ConfigError) as here:
        ingest.model_spec_from_def(_def(dataset_fn=_no_batches))
    monkeypatch.setenv(apart.ENV, "0")
    with pytest.raises(ConfigError) as there:
        ingest.model_spec_from_def(_def(dataset_fn=_no_batches))
    assert str(there.value) == str(here.value) and "yielded no batch" in str(here.value)
    assert calls == ["spec_here"]


@pytest.mark.integration
def test_inspect_reads_the_model_apart_as_a_user_runs_it():
    from autosync.models import ingest
    from autosync.sources import load_model_def

    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "AUTOSYNC_TF_LOGS")}
    r = subprocess.run([sys.executable, "-m", "autosync", "inspect", "--model", "zoo:ncf", "--profile"],
                       capture_output=True, text=True, cwd=REPO, env=dict(env, AUTOSYNC_APART_BYTES="0"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr == "", r.stderr[-2000:]   # the child's TensorFlow start-up lines are silenced too
    spec = ingest.spec_here(load_model_def("zoo:ncf"))
    assert f"fingerprint {spec.fingerprint}" in r.stdout
    assert "ms per step (forward+backward, median) on cpu:" in r.stdout


@pytest.mark.integration
def test_a_bad_size_is_bad_input(monkeypatch, capsys):
    from autosync.cli import main

    monkeypatch.setenv(apart.ENV, "a lot")
    assert main(["inspect", "--model", "zoo:ncf"]) == 2
    err = capsys.readouterr().err
    assert "AUTOSYNC_APART_BYTES='a lot' is not a number of bytes >= 0; set it" in err and "Traceback" not in err
