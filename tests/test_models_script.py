"""User-script loading: the example works, every broken script gives a ConfigError saying what to fix."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


def test_a_script_imports_its_own_modules_and_they_reach_a_process_that_cannot_import_them(tmp_path, monkeypatch):
    """``from helper import make_model`` beside the script failed (ModuleNotFoundError: the script's
    folder was not on the path, as ``python script.py`` puts it); a worker on another node cannot
    import the folder's modules either, so they travel by value like the script, packages too.
    Installed packages, even in a virtual environment inside the folder, are left by reference."""
    import cloudpickle

    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "helper.py").write_text("def scale(x):\n    return 2 * x\n")
    (proj / "pkg" / "__init__.py").write_text("")
    (proj / "pkg" / "sub.py").write_text("def inc(x):\n    return x + 1\n")
    venv_pkg = proj / ".venv" / "lib" / "site-packages" / "installed_thing.py"
    venv_pkg.parent.mkdir(parents=True)
    venv_pkg.write_text("VALUE = 1\n")
    _write(proj, """
        import sys
        sys.path.append(%r)
        import helper
        import installed_thing
        from pkg.sub import inc
        from autosync.model_def import ModelDef

        def build():
            return ModelDef(name="sib", model_fn=lambda: helper.scale(3), loss_fn=lambda: None,
                            optimizer_fn=lambda: inc(1), dataset_fn=lambda w, n: iter(()), batch_size=1)
        """ % str(venv_pkg.parent), name="model.py")
    md = script.load_model_def(str(proj / "model.py"), "build")
    assert (md.model_fn(), md.optimizer_fn()) == (6, 2)
    assert sys.path[-1] == str(proj.resolve())   # last once imported: shadows nothing this process imports later
    assert not script._beside(sys.modules["installed_thing"], proj.resolve())
    # AutoSync's own packages stay by reference even for a script in the checkout it is installed from
    assert not script._beside(sys.modules["autosync.model_def"], Path(REPO).resolve())
    assert script._beside(sys.modules["pkg.sub"], proj.resolve())
    # a project under the Python's prefix (/usr/local/src with a system Python at /usr) is still the
    # user's: only the standard library and installed packages stay by reference
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path))
    assert script._beside(sys.modules["pkg.sub"], proj.resolve())
    assert not script._beside(sys.modules["json"], Path(sys.modules["json"].__file__).parents[1])
    monkeypatch.undo()
    blob = tmp_path / "fns.pkl"
    blob.write_bytes(cloudpickle.dumps((md.model_fn, md.optimizer_fn)))
    code = "import pickle, sys; f, g = pickle.loads(open(sys.argv[1], 'rb').read()); print(f(), g())"
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["6", "2"]


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
