"""A call in a process of its own (``autosync.models.apart.call``): its result, its warnings and
its ConfigError come back, a child that dies or runs past the limit is a clear ConfigError and is
gone, and the child imports what this process can. Plain functions: no TensorFlow here (the models
read that way: ``test_apart_models.py``)."""
from __future__ import annotations

import math
import os
import signal
import sys
import time
import warnings

import pytest

from autosync.models import apart
from autosync.time_limit import CodeTimeout
from strategy_space.errors import ConfigError


class _Def:
    name = "toy"


@pytest.fixture(autouse=True)
def _without_ray(monkeypatch):
    """The fast suite imports no Ray: calls pickled with cloudpickle alone (Ray's own copy, which
    ``call`` takes first: ``test_apart_models.py``)."""
    monkeypatch.setattr(apart, "_PICKLERS", ("cloudpickle",))


def _pid_and_path(model_def, extra):
    warnings.warn(f"said in the child of {model_def.name}", UserWarning)
    return {"pid": os.getpid(), "extra": extra, "path": list(sys.path)}


def _refuse(model_def):
    raise ConfigError(f"ModelDef {model_def.name}: dataset_fn(0, 1) yielded no batch; fix dataset_fn")


def _die(model_def, how):
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def _hang(model_def, pid_file):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def test_the_result_and_the_warnings_come_back_from_another_process():
    with pytest.warns(UserWarning, match="said in the child of toy"):
        got = apart.call(_pid_and_path, _Def(), [1, 2.5, "three"])
    assert got["pid"] != os.getpid()
    assert got["extra"] == [1, 2.5, "three"]
    assert got["path"] == list(sys.path)   # it imports what this process imports


def test_the_childs_config_error_is_raised_here_as_it_was():
    with pytest.raises(ConfigError, match=r"^ModelDef toy: dataset_fn\(0, 1\) yielded no batch; fix dataset_fn$"):
        apart.call(_refuse, _Def())


@pytest.mark.parametrize("how, said", [("exit", "ended with exit code 3"), ("kill", "was killed by signal 9")])
def test_a_child_that_dies_is_a_config_error_that_says_how(how, said):
    with pytest.raises(ConfigError, match=f"reading model toy in a process of its own failed: the process {said}"):
        apart.call(_die, _Def(), how)


def test_a_child_past_the_limit_is_stopped_and_gone(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSYNC_MODEL_TIMEOUT", "1")
    pid_file = tmp_path / "pid"
    start = time.monotonic()
    said = r"reading model toy in a process of its own did not finish within 4 s and was stopped; .* \(now 1\)$"
    with pytest.raises(CodeTimeout, match=said):
        apart.call(_hang, _Def(), str(pid_file))
    assert time.monotonic() - start < 60   # 3 blocks' limit and a grace (4 s) and the child's start, not its 120 s
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_what_does_not_pickle_is_said_before_any_process_starts():
    import threading

    with pytest.raises(apart.Unpicklable,
                       match=r"^model toy does not pickle \(TypeError: .*lock.*\), so it cannot be "):
        apart.call(_pid_and_path, _Def(), threading.Lock())


def _ours_fails(model_def):
    raise ValueError("a fault of ours")


def test_another_exception_there_is_raised_here_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)^reading model toy in a process of its own failed there:\nTraceback.*"
                                           r"in _ours_fails.*ValueError: a fault of ours"):
        apart.call(_ours_fails, _Def())


def test_a_function_the_child_cannot_load_is_a_config_error(monkeypatch):
    import types

    ghost = types.ModuleType("apart_ghost_module")
    ghost.__file__ = "/nonexistent/apart_ghost_module.py"   # pickled by reference, and nowhere to import from
    exec("def f(model_def):\n    return 1\n", ghost.__dict__)
    monkeypatch.setitem(sys.modules, "apart_ghost_module", ghost)
    with pytest.raises(ConfigError, match=r"^the model's functions could not be loaded in a process of their own "
                                          r"\(ModuleNotFoundError: .*apart_ghost_module.*\); "
                                          r"set AUTOSYNC_APART_BYTES=inf"):
        apart.call(ghost.f, _Def())


def test_a_function_of_a_module_only_this_process_can_find_runs_there(tmp_path, monkeypatch):
    (tmp_path / "apart_only_here.py").write_text("def twice(model_def, x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import apart_only_here

    assert apart.call(apart_only_here.twice, _Def(), 21) == 42


@pytest.mark.parametrize("text, limit", [("", apart.LARGE_BYTES), ("0", 0), ("1e9", 1e9), ("inf", math.inf),
                                         (" 4096 ", 4096)])
def test_the_size_from_which_a_model_is_read_apart(monkeypatch, text, limit):
    monkeypatch.setenv(apart.ENV, text)
    assert apart.large_bytes() == limit


@pytest.mark.parametrize("text", ["-1", "lots", "nan"])
def test_a_bad_size_says_what_to_set(monkeypatch, text):
    monkeypatch.setenv(apart.ENV, text)
    with pytest.raises(ConfigError, match=f"AUTOSYNC_APART_BYTES='{text}' is not a number of bytes >= 0; set it"):
        apart.large_bytes()


def _pid(model_def, *extra):
    return os.getpid()


def test_at_0_every_model_is_read_apart_and_at_inf_none(monkeypatch):
    import threading

    monkeypatch.setenv(apart.ENV, "0")
    assert apart.read(_pid, _Def()) != os.getpid()
    with pytest.warns(UserWarning, match="^model toy does not pickle .*; it is read in this process"):
        assert apart.read(_pid, _Def(), threading.Lock()) == os.getpid()   # (0 asks for no watched build)
    monkeypatch.setenv(apart.ENV, "inf")
    assert apart.read(_pid, _Def()) == os.getpid()


def _aside_pid(model_def, tag):
    return tag, os.getpid()


def _aside_fails(model_def):
    raise ValueError("not now")


def test_a_read_apart_takes_what_is_asked_aside_along_in_the_same_process(monkeypatch):
    """``read_and``: the aside's result comes from the child that read the model; none where the
    aside fails there (the read that asks for it later says why) or where the model is read here."""
    monkeypatch.setenv(apart.ENV, "0")
    pid, aside = apart.read_and(_pid, _Def(), (), (_aside_pid, ("key",)))
    assert pid != os.getpid() and aside == ("key", pid)
    pid, aside = apart.read_and(_pid, _Def(), (), (_aside_fails, ()))
    assert pid != os.getpid() and aside is None
    monkeypatch.setenv(apart.ENV, "inf")
    assert apart.read_and(_pid, _Def(), (), (_aside_pid, ("key",))) == (os.getpid(), None)


def test_what_was_taken_along_is_kept_per_object_and_key_the_latest_only():
    class Def:   # a ModelDef stand-in: only its identity counts
        pass

    taken = apart.Taken(size=2)
    a, b, c = Def(), Def(), Def()
    taken.put(a, "digest a", 2)
    assert taken.get(a, 2) == "digest a"
    assert taken.get(a, 3) is None and taken.get(a) is None   # another key
    assert taken.get(b, 2) is None                           # another object
    taken.put(b, "digest b", 2)
    taken.put(c, "digest c", 2)                              # past its size: a's goes
    assert (taken.get(a, 2), taken.get(b, 2), taken.get(c, 2)) == (None, "digest b", "digest c")
