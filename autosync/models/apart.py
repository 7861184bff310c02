"""Reading a large model in a process of its own, so that the driver does not keep its memory.

To describe a model (its ModelSpec, for a builder's strategy or ``tune``'s compute profile), its
probe key or its optimizer's pins, the driver builds the model and takes a gradient. TensorFlow's
CPU allocator keeps the peak of what that took for the rest of the process, whatever is freed: a
model with a 512 MB embedding left the driver holding 1.5 GB more after one read, 2.6 GB after
three (by hand), on the node whose parameter servers and workers need the memory, for the whole run.

So a model whose weights come to ``LARGE_BYTES`` (``AUTOSYNC_APART_BYTES`` where set) or more is
read in a child process (this interpreter, ``python -m autosync.models.apart``), which gives
everything back when it exits. Its size is found as it is built here (``read``): each Keras
variable is counted before its value is made, and the one that brings the count to the limit stops
the build (``TooLarge``), before its memory is taken; the child then reads it from the start. A
model under the limit is read here as before, with ``model_fn`` called once (a model's factory may
be slow, or count its calls). A variable made by TensorFlow directly (not Keras) is not counted.

The child gets the function and its arguments pickled with Ray's cloudpickle (a script's functions
by value, ``models.script``, their file names kept for its messages) and this process's
``sys.path``; it runs the same bounded user code (``time_limit``: the limit is this process's,
passed on), writes back the result, or the
ConfigError, and the warnings it gave, which are given again here (another exception there, a
fault of ours, is raised here as a RuntimeError with its traceback). Its output goes where this
process's goes. Code that no signal stops is killed past three limits and a grace (the blocks of
one read); the child is killed too when this process stops waiting for any other reason (Ctrl-C).
A model whose functions do not pickle is read here, with a warning. The cost: the child's imports
(TensorFlow, Keras: 8-10 s a read on this 2-core machine), paid only for a large model; a read
that knows what will be asked of the same model later takes it along (``read_and``: ``tune``'s
profile brings the probe key), so that one child serves both.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from strategy_space.errors import ConfigError

LARGE_BYTES = 256 * 2**20   # weights from this size on are read in a child process
ENV = "AUTOSYNC_APART_BYTES"
BLOCKS = 3   # bounded blocks of the user's code in one read at most (its build, a gradient, timed steps)
# as ``models.script`` registers a script's module; Ray's first: it keeps a function's file name,
# which the child's messages name (``time_limit.where_stopped``), where cloudpickle 3.1.3 writes "<dynamic-code>"
_PICKLERS = ("ray.cloudpickle", "cloudpickle")


class TooLarge(Exception):
    """Raised inside a build (``watching``) by the variable that brings the model to the limit."""


class Watch:
    """The bytes of the Keras variables made so far (``watching``), and whether they reached
    ``limit``."""

    def __init__(self, limit: float):
        self.limit = limit
        self.bytes = 0
        self.crossed = False

    def add(self, variable) -> None:
        """Count ``variable`` (its shape and dtype are known, its value not yet made).

        Raises:
            TooLarge: the count reached the limit, with it or before it.
        """
        from strategy_space.model_spec import DTYPE_BYTES

        try:
            size = math.prod(int(d) for d in variable.shape)
        except (TypeError, ValueError):   # a dimension not known: not counted
            size = 0
        self.bytes += size * DTYPE_BYTES.get(str(getattr(variable, "dtype", "")), 4)
        self.crossed = self.crossed or self.bytes >= self.limit
        if self.crossed:
            raise TooLarge(f"the model's weights reach {self.bytes} bytes, at least {self.limit:g}")


_MAKES_VALUE = "_initialize_with_initializer"   # Keras 3: a variable's value made from its initializer
_ONE_AT_A_TIME = threading.RLock()   # threads reading models at once build one after the other


@contextlib.contextmanager
def watching(limit: float):
    """Inside, every Keras variable this thread makes from an initializer is counted by the
    yielded ``Watch`` before its value is made (and refused past the limit). Where Keras has no
    such step (another major version), nothing is counted."""
    watch = Watch(limit)
    try:
        from keras.src import backend
    except ImportError:
        yield watch
        return
    cls = getattr(backend, "BackendVariable", None)
    if getattr(cls, _MAKES_VALUE, None) is None:
        yield watch
        return
    thread = threading.get_ident()

    def counted(variable, initializer):
        if threading.get_ident() == thread:
            watch.add(variable)
        return original(variable, initializer)

    with _ONE_AT_A_TIME:   # the patch and its undoing in one order (a nested watch in this thread: inside)
        original = getattr(cls, _MAKES_VALUE)
        own = cls.__dict__.get(_MAKES_VALUE)
        setattr(cls, _MAKES_VALUE, counted)
        try:
            yield watch
        finally:
            if own is None:
                delattr(cls, _MAKES_VALUE)
            else:
                setattr(cls, _MAKES_VALUE, own)


def large_bytes() -> float:
    """The weights' bytes from which a model is read in a child process: ``AUTOSYNC_APART_BYTES``
    (0: every model; ``inf``: none), else ``LARGE_BYTES``.

    Raises:
        ConfigError: the variable is not a number of bytes >= 0.
    """
    text = os.environ.get(ENV, "").strip()
    if not text:
        return float(LARGE_BYTES)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise ConfigError(f"{ENV}={text!r} is not a number of bytes >= 0; set it to the size of weights from which "
                          f"a model is read in a process of its own (0: every model, inf: none) or unset it "
                          f"(default {LARGE_BYTES})")
    return value


def read(fn: Callable, model_def, *args: Any) -> Any:
    """``fn(model_def, *args)``, which builds ``model_def``'s model: here, unless the model's
    weights reach ``large_bytes()`` as it is built (the build is stopped, ``watching``), then in a
    child process (``call``).

    Raises:
        ConfigError: what ``fn`` raises, here or there (see ``call``).
    """
    return read_and(fn, model_def, args, None)[0]


def read_and(fn: Callable, model_def, args: tuple, aside: tuple | None) -> tuple:
    """``read(fn, model_def, *args)`` and, where the model is read in a child process, ``aside``
    (a function and its arguments) called there too on ``model_def``, after ``fn``: what a later
    read of the same model would ask, for a build there instead of another child's start (its
    TensorFlow import: seconds). Returns (fn's result, aside's result, or None: the model was read
    here, or aside raised there, which the later read will say itself).

    Raises:
        ConfigError: as ``read``.
    """
    limit = large_bytes()
    if limit == math.inf:
        return fn(model_def, *args), None
    if limit > 0:
        with watching(limit) as watch:
            try:
                result = fn(model_def, *args)
            except Exception:   # noqa: BLE001 - the stopped build, whatever the user's code made of it
                if not watch.crossed:
                    raise
        if not watch.crossed:
            return result, None
    try:
        if aside is None:
            return call(fn, model_def, *args), None
        return call(_aside, model_def, fn, args, *aside, blocks=2 * BLOCKS)
    except Unpicklable as e:
        warnings.warn(f"{e}; it is read in this process, which keeps about 3x its weights' bytes for good",
                      stacklevel=2)
        return fn(model_def, *args), None


def _aside(model_def, fn: Callable, args: tuple, aside_fn: Callable, aside_args: tuple) -> tuple:
    """In the child: ``fn``'s result and ``aside_fn``'s (None where it raises)."""
    result = fn(model_def, *args)
    try:
        return result, aside_fn(model_def, *aside_args)
    except Exception:   # noqa: BLE001 - said by the read that asks for it later
        return result, None


class Taken:
    """What reads of a model took along for later reads of it (``read_and``'s aside, or a result
    that answers two questions), per ModelDef object and key; the object is kept with its entry so
    that its id is not reused by another; the latest ``size`` entries."""

    def __init__(self, size: int = 8):
        self._entries: dict = {}
        self._size = size

    def get(self, model_def, key: Any = None) -> Any:
        """What was kept for ``model_def`` (this object) and ``key``, or None."""
        entry = self._entries.get((id(model_def), key))
        return entry[0] if entry is not None and entry[1] is model_def else None

    def put(self, model_def, value: Any, key: Any = None) -> None:
        self._entries[(id(model_def), key)] = (value, model_def)
        while len(self._entries) > self._size:   # insertion order: the oldest first
            del self._entries[next(iter(self._entries))]


class Unpicklable(ConfigError):
    """``call``'s function or arguments do not pickle (a user's object cloudpickle cannot carry)."""


def call(fn: Callable, *args: Any, blocks: int = BLOCKS) -> Any:
    """``fn(*args)`` in a child process (module doc): its result, its ConfigError raised here,
    its warnings given again here.

    Raises:
        ConfigError: what ``fn`` raised as one; the child did not finish within ``blocks`` limits
            on the user's code (``time_limit.limit_s``) and a grace (a ``CodeTimeout``), or it
            died (its exit code or signal); ``Unpicklable``: ``fn`` or ``args`` do not pickle.
        RuntimeError: another exception there (its traceback).
    """
    from autosync.time_limit import GRACE_S, CodeTimeout, limit_s

    limit = limit_s()
    pickler = _pickler()
    with tempfile.TemporaryDirectory(prefix="autosync-apart-") as folder:
        given, back = Path(folder, "call.pkl"), Path(folder, "result.pkl")
        with open(given, "wb") as f:
            pickle.dump((list(sys.path), pickler.__name__), f)
            try:
                pickler.dump((fn, args), f)
            except Exception as e:   # noqa: BLE001 - whatever the user's objects raise
                raise Unpicklable(f"model {_name(args)} does not pickle ({type(e).__name__}: {str(e)[:200]}), so it "
                                  f"cannot be read in a process of its own") from None
        env = dict(os.environ, AUTOSYNC_MODEL_TIMEOUT=repr(limit))
        child = subprocess.Popen([sys.executable, "-m", __name__, str(given), str(back)], env=env,
                                 stdin=subprocess.DEVNULL)
        # each block of the user's code there stops itself at the limit (``bounded``); this is for
        # code that no signal stops, past the blocks of one read (build, gradient, timed steps)
        backstop = blocks * limit + min(GRACE_S, limit)
        try:
            code = child.wait(timeout=backstop)
        except subprocess.TimeoutExpired:
            raise CodeTimeout(f"reading model {_name(args)} in a process of its own did not finish within "
                              f"{backstop:g} s and was stopped; fix its model_fn or dataset_fn, or set "
                              f"AUTOSYNC_MODEL_TIMEOUT to more seconds (now {limit:g})") from None
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if not back.exists():
            how = f"was killed by signal {-code} (out of memory?)" if code < 0 else f"ended with exit code {code}"
            raise ConfigError(f"reading model {_name(args)} in a process of its own failed: the process {how} "
                              f"before it gave a result; see its output above")
        with open(back, "rb") as f:
            outcome, value, said = pickle.load(f)
    for message, category in said:
        warnings.warn(message, category, stacklevel=2)
    if outcome == "error":
        raise value
    if outcome == "failed":
        raise RuntimeError(f"reading model {_name(args)} in a process of its own failed there:\n{value}")
    return value


def _name(args) -> str:
    return getattr(args[0], "name", "?") if args else "?"


def _pickler():
    for name in _PICKLERS:
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise ConfigError("reading a large model in a process of its own needs cloudpickle; pip install cloudpickle")


def _said(caught) -> list:
    """The warnings caught, each as (text, category): a category that does not pickle becomes a
    UserWarning."""
    out = []
    for w in caught:
        category = w.category
        try:
            pickle.loads(pickle.dumps(category))
        except Exception:   # noqa: BLE001 - a class of the user's the driver cannot load
            category = UserWarning
        out.append((str(w.message), category))
    return out


def _outcome(load: Callable) -> tuple:
    """``fn(*args)`` of what ``load()`` gives, as the child writes it back: ("ok", result),
    ("error", a ConfigError) or ("failed", another exception's traceback)."""
    try:
        fn, args = load()
    except Exception as e:   # noqa: BLE001 - a function this process cannot load
        return "error", ConfigError(f"the model's functions could not be loaded in a process of their own "
                                    f"({type(e).__name__}: {str(e)[:300]}); set {ENV}=inf to read it in the "
                                    f"driver's process")
    try:
        return "ok", fn(*args)
    except ConfigError as e:
        try:
            pickle.dumps(e)
            return "error", e
        except Exception:   # noqa: BLE001 - a subclass that does not pickle: its text
            return "error", ConfigError(str(e))
    except Exception:   # noqa: BLE001 - a fault of ours: its traceback, for the driver to raise
        return "failed", traceback.format_exc()


def _main(given: str, back: str) -> None:
    from autosync.runtime.lean_import import skip_keras_extras
    from autosync.tflog import driver_startup

    driver_startup()
    skip_keras_extras()   # as a worker: Keras' scikit-learn, matplotlib and pandas integrations
    with open(given, "rb") as f:
        path, pickler_name = pickle.load(f)
        sys.path[:] = path
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            outcome, value = _outcome(lambda: importlib.import_module(pickler_name).load(f))
    written = Path(back + ".part")
    with open(written, "wb") as f:
        pickle.dump((outcome, value, _said(caught)), f)
    os.replace(written, back)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
