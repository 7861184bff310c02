"""Keras' optional integrations are skipped in a worker's import, nothing else is (no TensorFlow:
a stand-in package plays scikit-learn, stand-in importers play Keras' modules and the user's)."""
from __future__ import annotations

import sys

import pytest

from autosync.runtime import lean_import

FAKE = "_autosync_fake_extra"


@pytest.fixture()
def skipping(monkeypatch, tmp_path):
    (tmp_path / f"{FAKE}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lean_import, "EXTRAS", {FAKE: ("keras.src.wrappers",)})
    monkeypatch.delenv(lean_import.ENV, raising=False)
    monkeypatch.delitem(sys.modules, FAKE, raising=False)
    before = [f for f in sys.meta_path if isinstance(f, lean_import._SkipKerasExtras)]
    for finder in before:   # (the command line's main, run in this process by another test, put one)
        sys.meta_path.remove(finder)
    yield
    sys.modules.pop(FAKE, None)
    # the list itself stays (the suite's import guard is in it, removed after this test)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, lean_import._SkipKerasExtras)] + before


def _import_as(module_name: str):
    """Run ``import FAKE`` as the module ``module_name`` would; returns the module imported, or the
    ImportError raised."""
    namespace = {"__name__": module_name}
    exec(f"try:\n    import {FAKE} as extra\nexcept ImportError as e:\n    extra = e\n", namespace)
    return namespace["extra"]


def test_keras_wrapper_import_fails_and_the_users_works(skipping):
    assert lean_import.skip_keras_extras() is True
    assert lean_import.skip_keras_extras() is True   # once in place, not twice
    assert sum(isinstance(f, lean_import._SkipKerasExtras) for f in sys.meta_path) == 1
    got = _import_as("keras.src.wrappers.fixes")
    assert isinstance(got, ImportError) and "keras.src.wrappers.fixes" in str(got) and lean_import.ENV in str(got)
    assert FAKE not in sys.modules
    assert _import_as("keras.src.layers").VALUE == 1   # another Keras module is not one of the extras' importers
    sys.modules.pop(FAKE)
    assert _import_as("my_training_script").VALUE == 1


def test_the_environment_keeps_the_extras(skipping, monkeypatch):
    monkeypatch.setenv(lean_import.ENV, "1")
    assert lean_import.skip_keras_extras() is False
    assert _import_as("keras.src.wrappers.fixes").VALUE == 1


def test_the_importer_is_the_module_running_the_import_statement():
    assert lean_import.importer(depth=0) == __name__


def test_the_command_line_skips_them_too(skipping, capsys):
    from autosync.cli import main

    assert main([]) == 2   # no command: its help, after the skip is in place
    assert sum(isinstance(f, lean_import._SkipKerasExtras) for f in sys.meta_path) == 1
    assert isinstance(_import_as("keras.src.wrappers.fixes"), ImportError)
