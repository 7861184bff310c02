"""Keras' optional integrations left out of a training process's TensorFlow import.

``import tensorflow`` imports Keras, and Keras imports, whenever they are installed, scikit-learn
for its ``keras.wrappers`` estimators and matplotlib for ``keras.visualization``'s galleries: 2.0 s
of the 6.3 s of CPU that the import costs (measured here: 6.3 -> 4.4 s; scikit-learn pulls SciPy's
``sparse`` and ``special`` in). Its array data adapters (``model.fit``/``evaluate``/``predict`` on
arrays) import pandas to accept DataFrames, and pandas imports pyarrow: another 0.3 s (see
``docs/cli.md``). AutoSync installs scikit-learn for its tuner (XGBoost's ``XGBRegressor`` needs
it) and pandas for its trial tables, so every Ray worker, parameter server and command paid them
on every start, for code that none of them runs: a worker differentiates the model's loss on
each batch itself (``fit_batch.batch_loss``) and never calls ``fit``.

``skip_keras_extras`` (called by a Ray actor's process and by the ``autosync`` command before they
import TensorFlow) makes those imports fail, as if the packages were missing, when **Keras' own
wrapper, visualization or data-adapter module** asks for them; Keras guards them and goes on
without. Any other import of them (the user's ``model_fn``, ``dataset_fn``, a loss; XGBoost's and
the trial tables' in the tuner) works as usual. What is lost in such a process: Keras'
``SKLearnClassifier``, ``SKLearnRegressor``, ``SKLearnTransformer`` and ``keras.visualization``'s
plots say the package is missing, and ``model.fit``/``evaluate``/``predict`` there take no
DataFrame (a numpy array, ``df.to_numpy()``, still works). ``AUTOSYNC_KERAS_EXTRAS=1`` in the
environment keeps them (Ray passes it to the workers of a cluster it starts; on a ``ray start``
cluster set it there). A process that uses the Python API (``autosync.tune``, ``make_trainer``) is
never changed: it is the user's. (``autosync inspect --model zoo:ncf`` took 8.1-8.6 s, now 5.8-6.0 s
without the first two.)
"""
from __future__ import annotations

import importlib.abc
import os
import sys

ENV = "AUTOSYNC_KERAS_EXTRAS"

# package -> the Keras modules whose import of it is skipped (a prefix of the importer's __name__)
EXTRAS = {
    "sklearn": ("keras.src.wrappers",),
    "matplotlib": ("keras.src.visualization",),
    "pandas": ("keras.src.trainers.data_adapters",),   # and pyarrow, which pandas imports
}


def wanted() -> bool:
    """Whether the user asked to keep Keras' integrations (``AUTOSYNC_KERAS_EXTRAS=1``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def importer(depth: int = 1) -> str:
    """The ``__name__`` of the module whose import statement is running (the first frame above
    ``depth`` that is not the import system's own)."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class _SkipKerasExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        wanted_by = EXTRAS.get(name.partition(".")[0])
        if wanted_by is None:
            return None
        who = importer()
        if who.startswith(wanted_by):
            raise ImportError(f"{name} is not imported by {who} in an AutoSync worker or command ({ENV}=1 keeps it)")
        return None


def skip_keras_extras() -> bool:
    """Make Keras' optional scikit-learn, matplotlib and pandas imports fail in this process (see the
    module docstring). Call it before TensorFlow or Keras is imported, in a worker's process or the
    command line's, never in a user's own process.

    Returns:
        whether the skip is in place (False when ``AUTOSYNC_KERAS_EXTRAS=1``).
    """
    if wanted():
        return False
    if not any(isinstance(f, _SkipKerasExtras) for f in sys.meta_path):
        sys.meta_path.insert(0, _SkipKerasExtras())
    return True
