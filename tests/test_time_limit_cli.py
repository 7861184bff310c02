"""A model whose code hangs in the driver: `inspect` and `tune` stop at AUTOSYNC_MODEL_TIMEOUT with exit code 2
and say where it hung (real TensorFlow, a process of its own: in-process, pytest-timeout owns SIGALRM)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from autosync import time_limit

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
    import os, time
    import numpy as np
    import keras
    import autosync

    def _model():
        if os.environ["HANG"] == "model":
            time.sleep(10_000)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])

    def _data(i, n):
        if os.environ["HANG"] == "data":
            import socket
            server = socket.create_server(("127.0.0.1", 0))
            socket.create_connection(server.getsockname()).recv(10)   # a source that never answers
        while True:
            yield np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32")

    def build():
        return autosync.ModelDef(name="hangs", model_fn=_model, loss_fn=lambda: "mse",
                                 optimizer_fn=lambda: keras.optimizers.SGD(0.1), dataset_fn=_data, batch_size=8)
"""


@pytest.mark.parametrize("hang, argv, where", [
    ("model", ["inspect"], "in _model"),
    ("data", ["tune", "--trials", "1", "--cluster", "local"], "in _data"),
])
def test_a_hanging_model_is_stopped_with_a_message(tmp_path, hang, argv, where):
    (tmp_path / "hangs.py").write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, HANG=hang, HOME=str(tmp_path), **{time_limit.ENV: "18"})
    out = subprocess.run([sys.executable, "-m", "autosync", *argv, "--model", f"{tmp_path}/hangs.py:build"],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=400)
    assert out.returncode == 2, out.stderr[-2000:]
    assert (f"autosync {argv[0]}: error: ModelDef hangs: building the model and one gradient on its first batch did "
            f"not finish within 18 s and was stopped at {tmp_path}/hangs.py:") in out.stderr
    assert where in out.stderr and "set AUTOSYNC_MODEL_TIMEOUT to more seconds (now 18)" in out.stderr
    assert "Traceback" not in out.stderr


def _hangs_on_workers():
    import keras
    import numpy as np

    from autosync import ModelDef

    driver = os.getpid()

    def data(i, n):
        if os.getpid() != driver:   # a source the workers cannot reach
            import time

            time.sleep(10_000)
        while True:
            yield np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32")

    return ModelDef(name="hangs_there", model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
                    loss_fn=lambda: "mse", optimizer_fn=lambda: keras.optimizers.SGD(0.1), dataset_fn=data,
                    batch_size=8)


def test_a_model_that_hangs_on_the_workers_fails_its_trial_saying_where(ray_session):
    """The driver reads the model; the workers' dataset_fn hangs: the trial times out saying where it
    hung, before the limit (it said only "time limit reached with 2 of 2 unfinished"), and is not run
    again (a time-out: ``Trial.worth_another_run``)."""
    trial = _ps_trial(_hangs_on_workers(), warmup=1, steps=2)
    text = trial.error
    assert trial.status == "timeout" and not trial.worth_another_run, text
    assert "ModelDef hangs_there: worker " in text and " building the model and drawing its first batches did not " \
        "finish within " in text, text
    assert f"was stopped at {__file__}:" in text and " in data (a wait on" in text


def _hangs_later():
    import keras
    import numpy as np

    from autosync import ModelDef

    driver = os.getpid()

    def data(i, n):
        for k in range(10_000):
            if k == 6 and i == 1 and os.getpid() != driver:   # worker 1's source stops answering mid-run
                import time

                time.sleep(10_000)
            yield np.full((8, 4), i, "float32"), np.zeros((8, 1), "float32")

    return ModelDef(name="hangs_later", model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
                    loss_fn=lambda: "mse", optimizer_fn=lambda: keras.optimizers.SGD(0.1), dataset_fn=data,
                    batch_size=8)


def test_a_dataset_that_hangs_in_a_later_step_fails_its_trial_saying_where(ray_session):
    """Worker 1's dataset_fn hangs at its 7th batch, drawn ahead on the prefetching thread while worker 0
    waits for its push: the trial times out naming worker 1 and the line in data where it hung (it said
    only "time limit reached with 2 of 2 unfinished"); worker 0, waiting, is not the one blamed."""
    trial = _ps_trial(_hangs_later(), warmup=2, steps=8)
    text = trial.error
    assert trial.status == "timeout" and not trial.worth_another_run, text
    assert "ModelDef hangs_later: worker 1 running 11 training steps, drawing their batches from dataset_fn, did not " \
        "finish within " in text, text
    assert f"was stopped at {__file__}:" in text and " in data (a wait on" in text, text


def _ps_trial(model_def, warmup: int, steps: int):
    """One trial of the ``ps`` builder's strategy on ``local``, its limit 35 s (a hang waits it out)."""
    from autosync.runtime.runner import RayRunner
    from autosync.sources import local_cluster
    from strategy_space.builders import get_builder

    runner = RayRunner(model_def, local_cluster(), warmup=warmup, steps=steps, trial_timeout_s=35)
    try:
        strategy = get_builder("ps").build(runner.given_spec or _spec(model_def), local_cluster())
        [trial] = runner.run([strategy])
    finally:
        runner.close()
    return trial


def _spec(model_def):
    from autosync.models.ingest import model_spec_from_def

    return model_spec_from_def(model_def)
