"""The digest of how a model trains (``autosync.models.training_key``), which keys the probe cache:
the same in every process for the same ModelDef, different for any change that changes training
while the variables stay the same."""
from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import pytest

from tests import runtime_models as rm

pytestmark = pytest.mark.integration


def _tanh_student():
    import keras

    x = keras.Input((rm.TEACHER_DIM,), name="x")
    return keras.Model(x, keras.layers.Dense(rm.TEACHER_DIM, use_bias=False, activation="tanh", name="w")(x))


def _scheduled():
    import keras

    return keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.25, decay_steps=100))


def test_the_digest_is_stable_and_moves_with_everything_that_changes_training():
    from autosync.models.training_key import training_digest

    md = rm.teacher_model_def()
    base = training_digest(md, 2)
    assert training_digest(md, 2) == base   # a second build in one process (Keras names its second SGD sgd_1)
    changes = {
        "learning rate": {"optimizer_fn": functools.partial(rm.make_optimizer, "sgd", learning_rate=0.1)},
        "optimizer": {"optimizer_fn": functools.partial(rm.make_optimizer, "adam")},
        "schedule": {"optimizer_fn": _scheduled},
        "clipping": {"optimizer_fn": functools.partial(rm.make_optimizer, "sgd", learning_rate=0.25, clipnorm=1.0)},
        "loss": {"loss_fn": lambda: "mae"},
        "activation": {"model_fn": _tanh_student},
        "seed (initial weights)": {"seed": 4},
        "data": {"dataset_fn": functools.partial(rm.teacher_batches, batch=16, seed=1)},
    }
    digests = {what: training_digest(dataclasses.replace(md, **change), 2) for what, change in changes.items()}
    digests["workers (worker 0's shard)"] = training_digest(md, 3)
    assert base not in digests.values() and len(set(digests.values())) == len(digests), digests
    # another process computes the same digest
    code = ("from tests import runtime_models as rm; from autosync.models.training_key import training_digest; "
            "print(training_digest(rm.teacher_model_def(), 2))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == base


SCRIPT = """
import keras, numpy as np
from autosync import ModelDef

def model():
    x = keras.Input((4,))
    return keras.Model(x, keras.layers.Dense(1, name="w")(x))

def my_loss(y, p):
    return keras.ops.mean(keras.ops.square(y - p)) * SCALE

def data(i, n):
    rng = np.random.default_rng(i)
    while True:
        yield rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")

def build():
    return ModelDef(name="edited", model_fn=model, loss_fn=lambda: my_loss, dataset_fn=data, batch_size=8,
                    optimizer_fn=lambda: keras.optimizers.SGD(0.1))
"""


def test_a_loss_function_edited_under_its_name_is_another_training(tmp_path):
    """Keras' config of a loss function is its name: the digest reads the script's code too."""
    script = tmp_path / "m.py"
    code = ("from autosync.sources import load_model_def; from autosync.models.training_key import training_digest; "
            f"print(training_digest(load_model_def('{script}:build'), 2))")
    digests = []
    for scale in ("1.0", "2.0"):
        script.write_text(SCRIPT.replace("SCALE", scale))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        digests.append(r.stdout.split()[-1])
    assert digests[0] != digests[1], digests   # (the same file gives the same digest: the test above)
