"""Load a user's ``path/to/script.py:function`` model source.

The script is imported as a module (its top level runs once), then ``function()`` is called with
no arguments and must return an ``autosync.model_def.ModelDef``. The module is registered with
cloudpickle to be pickled by value, so the ModelDef's factories reach Ray workers that cannot
import the script by name; so are the modules it imports from its own folder (``from helper import
make_model``, as ``python script.py`` finds them: the folder is put on the path), which a worker on
another node could not import either.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import sys
import traceback
from pathlib import Path

from autosync.models import keras_names
from autosync.time_limit import Overrun, bounded, library_dirs
from strategy_space.errors import ConfigError

CONTRACT = ("the function must take no arguments and return autosync.ModelDef(name=..., model_fn=..., "
            "loss_fn=..., optimizer_fn=..., dataset_fn=..., batch_size=...)")


def _where_in_script(error: BaseException, path: Path) -> str:
    """`` (line N of script.py)`` for the deepest traceback frame inside the script, else ''."""
    line = None
    for frame in traceback.extract_tb(error.__traceback__):
        if Path(frame.filename).resolve() == path:
            line = frame.lineno
    return f" (line {line} of {path.name})" if line is not None else ""


def import_script(path: str | Path):
    """Import ``path`` as a module named ``autosync_user_<stem>_<hash>``.

    Raises:
        ConfigError: the file is missing, is not a .py file, or raises while importing.
    """
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise ConfigError(f"model script not found: {path} (give the path of an existing Python file, "
                          f"e.g. examples/my_model.py:build)")
    if p.suffix != ".py":
        raise ConfigError(f"model script {path} must be a .py file")
    digest = hashlib.sha1(str(p).encode()).hexdigest()[:8]
    module_name = f"autosync_user_{p.stem if p.stem.isidentifier() else 'script'}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import model script {path}: Python does not recognise it as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # as `python script.py` runs it: the script's folder first on the path while it imports, so that
    # it finds the modules beside it; then last, where a function of the script that imports one
    # when called still finds it but nothing this process imports later is shadowed by a user's file
    folder = str(p.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    before = set(sys.modules)
    named_before = keras_names.counts()
    try:
        with bounded(f"importing model script {path}"):
            try:
                spec.loader.exec_module(module)
            except (KeyboardInterrupt, Overrun):
                raise
            except BaseException as e:  # the user's code (sys.exit included): report any failure as bad input
                raise ConfigError(f"importing model script {path} failed{_where_in_script(e, p)}: "
                                  f"{type(e).__name__}: {e}; fix the script so that it imports cleanly") from e
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
            sys.path.append(folder)
    # a top level that named Keras objects (a module-level layer the model reuses, named after what
    # this process had named before) has every process's build count on from here, past those names;
    # any other builds from nothing, its layers named as in a fresh process
    named_after = keras_names.counts()
    module.__autosync_name_counts__ = named_after if named_after != named_before else {}
    _pickle_by_value(module)
    for name in sorted(set(sys.modules) - before):
        if _beside(sys.modules[name], p.parent):
            _pickle_by_value(sys.modules[name])
    return module


@functools.lru_cache(maxsize=1)
def _installed_names() -> frozenset:
    """Top-level import names of installed distributions (AutoSync's own packages among them, also
    when installed from a checkout the script sits in): every node imports those by name."""
    return frozenset(importlib.metadata.packages_distributions())


def _beside(module, folder: Path) -> bool:
    """Whether ``module`` is the user's own Python code from the script's folder (or below it),
    which a Ray worker on another node cannot import; never an installed package, even one in a
    virtual environment inside that folder."""
    file = getattr(module, "__file__", None)
    if not file or not file.endswith(".py") or module.__name__.partition(".")[0] in _installed_names():
        return False
    where = Path(file).resolve()
    if any(part in ("site-packages", "dist-packages") for part in where.parts):
        return False
    return where.is_relative_to(folder) and not any(where.is_relative_to(d) for d in library_dirs())


def _pickle_by_value(module) -> None:
    # Ray workers run elsewhere and cannot import the script by its generated module name
    for name in ("cloudpickle", "ray.cloudpickle"):
        try:
            pickler = importlib.import_module(name)
        except ImportError:
            continue
        register = getattr(pickler, "register_pickle_by_value", None)
        if register is not None:
            register(module)


def load_model_def(path: str | Path, function_name: str):
    """The ModelDef returned by ``function_name()`` in the script at ``path``.

    Args:
        path: the Python file.
        function_name: a function defined (or imported) at the script's top level.

    Returns:
        autosync.model_def.ModelDef.

    Raises:
        ConfigError: a missing file, an import error, no such function, the function raising,
            or returning something other than a ModelDef. The message says what to fix.
    """
    from autosync.model_def import ModelDef

    module = import_script(path)
    source = f"{path}:{function_name}"
    fn = getattr(module, function_name, None)
    if fn is None:
        functions = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        listed = ", ".join(functions) if functions else "none"
        raise ConfigError(f"{path} has no function {function_name!r} (functions defined there: {listed}); "
                          f"define def {function_name}() in the script or name another one after the colon; {CONTRACT}")
    if not callable(fn):
        raise ConfigError(f"{source}: {function_name} is not callable (it is a {type(fn).__name__} value); {CONTRACT}")
    with bounded(f"{source}()"):
        try:
            result = fn()
        except (KeyboardInterrupt, Overrun):
            raise
        except BaseException as e:  # the user's code (sys.exit included)
            raise ConfigError(f"{source}() raised {type(e).__name__}{_where_in_script(e, Path(path).resolve())}: {e}; "
                              f"fix the function ({CONTRACT})") from e
    if not isinstance(result, ModelDef):
        raise ConfigError(f"{source}() returned {type(result).__name__}, not a ModelDef; {CONTRACT}")
    if result.name_counts is None:
        result = dataclasses.replace(result, name_counts=getattr(module, "__autosync_name_counts__", None))
    return result
