"""User-script loading: the example works, every broken script gives a ConfigError saying what to fix."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from autosync.model_def import ModelDef
from autosync.models import script
from strategy_space.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "my_model.py")


def _write(tmp_path, body: str, name: str = "user_model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.integration
def test_example_script_returns_a_model_def_with_sparse_embedding():
    from autosync.models import ingest

    model_def = script.load_model_def(EXAMPLE, "build")
    assert isinstance(model_def, ModelDef) and model_def.name == "my_model"
    spec = ingest.model_spec_from_def(model_def)
    assert [v.name for v in spec.variables if v.sparse] == ["user_embedding/embeddings"]
    assert spec.var("user_embedding/embeddings").rows_per_step <= model_def.batch_size
    assert not spec.var("hidden/kernel").sparse


@pytest.mark.integration
def test_example_model_def_unpickles_in_a_process_that_cannot_import_the_script(tmp_path):
    import cloudpickle

    blob = tmp_path / "model_def.pkl"
    blob.write_bytes(cloudpickle.dumps(script.load_model_def(EXAMPLE, "build")))
    code = ("import pickle, sys; d = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "b = next(iter(d.dataset_fn(1, 2))); print(d.name, b[0][0].shape, d.batch_size)")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, cwd=str(tmp_path),
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["my_model", "(64,)", "64"]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"model script not found: .*nope\.py \(give the path of an existing"):
        script.load_model_def(str(tmp_path / "nope.py"), "build")


def test_missing_function_lists_the_functions_there(tmp_path):
    path = _write(tmp_path, """
        def make_model():
            return None
    """)
    with pytest.raises(ConfigError, match=r"has no function 'build' \(functions defined there: make_model\); define def build\(\)"):
        script.load_model_def(path, "build")


def test_wrong_return_type(tmp_path):
    path = _write(tmp_path, """
        def build():
            return [1, 2]
    """)
    with pytest.raises(ConfigError, match=r"build\(\) returned list, not a ModelDef; the function must take no arguments"):
        script.load_model_def(path, "build")


def test_function_raising_reports_the_line(tmp_path):
    path = _write(tmp_path, """
        def build():
            raise RuntimeError("no data here")
    """)
    with pytest.raises(ConfigError, match=r"build\(\) raised RuntimeError \(line 3 of user_model\.py\): no data here"):
        script.load_model_def(path, "build")


def test_script_failing_at_import(tmp_path):
    path = _write(tmp_path, "import not_a_real_module_xyz\n", name="broken.py")
    with pytest.raises(ConfigError, match=r"importing model script .*broken\.py failed \(line 1 of broken\.py\): "
                                          r"ModuleNotFoundError"):
        script.load_model_def(path, "build")


def test_attribute_that_is_not_a_function(tmp_path):
    path = _write(tmp_path, "build = 3\n", name="const.py")
    with pytest.raises(ConfigError, match=r"build is not callable \(it is a int value\)"):
        script.load_model_def(path, "build")


@pytest.mark.integration
def test_sources_resolve_script_form():
    from autosync.sources import load_model_def

    assert load_model_def(f"{EXAMPLE}:build").name == "my_model"
