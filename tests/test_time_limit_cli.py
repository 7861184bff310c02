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
    env = dict(os.environ, HANG=hang, HOME=str(tmp_path), **{time_limit.ENV: "10"})
    out = subprocess.run([sys.executable, "-m", "autosync", *argv, "--model", f"{tmp_path}/hangs.py:build"],
                         capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=400)
    assert out.returncode == 2, out.stderr[-2000:]
    assert (f"autosync {argv[0]}: error: ModelDef hangs: building the model and one gradient on its first batch did "
            f"not finish within 10 s and was stopped at {tmp_path}/hangs.py:") in out.stderr
    assert where in out.stderr and "set AUTOSYNC_MODEL_TIMEOUT to more seconds (now 10)" in out.stderr
    assert "Traceback" not in out.stderr
