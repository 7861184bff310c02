"""The driver's limit on a user's code: a block that runs past AUTOSYNC_MODEL_TIMEOUT is stopped with
a ConfigError saying what ran and where it stopped; code Python cannot stop ends a command-line process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from autosync import time_limit
from autosync.models import script
from strategy_space.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pytest-timeout's default method owns SIGALRM, which the limit leaves to its owner: a thread instead
pytestmark = pytest.mark.timeout(300, method="thread")


@pytest.fixture
def short(monkeypatch):
    monkeypatch.setenv(time_limit.ENV, "0.3")
    monkeypatch.setattr(time_limit, "AGAIN_S", 0.2)


def _sleeper():
    time.sleep(60)


def test_a_block_past_the_limit_is_stopped_where_it_was(short):
    with pytest.raises(ConfigError) as e:
        with time_limit.bounded("ModelDef m: building the model"):
            _sleeper()
    text = str(e.value)
    assert text.startswith("ModelDef m: building the model did not finish within 0.3 s and was stopped at ")
    assert f"{__file__}:{_sleeper.__code__.co_firstlineno + 1} in _sleeper" in text
    assert f"set {time_limit.ENV} to more seconds (now 0.3)" in text
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_gated_block_is_stopped_only_while_the_users_code_runs(short):
    """A training worker's steps: past the limit, a wait outside the user's code goes on (another
    worker's data hung); the user's code is stopped once it runs, where ``where`` says it was."""
    state = {"user": False, "waited": 0.0}
    seen = []

    def where(frame):
        seen.append(frame.f_code.co_name)
        return "data.py:7 in source"

    with pytest.raises(ConfigError) as e:
        with time_limit.bounded("ModelDef m: worker 1 running 4 training steps", gate=lambda: state["user"],
                                where=where):
            t0 = time.monotonic()
            time.sleep(1.0)   # past the limit (0.3 s) and two repeats (0.2 s), outside the user's code
            state["waited"] = time.monotonic() - t0
            state["user"] = True
            _sleeper()
    assert state["waited"] >= 0.99   # not cut short
    assert str(e.value).startswith("ModelDef m: worker 1 running 4 training steps did not finish within 0.3 s and "
                                   "was stopped at data.py:7 in source (")
    assert seen == ["_sleeper"]
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_code_that_catches_exceptions_is_stopped_too(short):
    caught = []

    def broad():
        try:
            time.sleep(60)
        except Exception as e:   # noqa: BLE001 - the user's own broad handler does not swallow it
            caught.append(e)

    def broader():
        try:
            time.sleep(60)
        except BaseException:
            caught.append("base")
        time.sleep(60)   # the alarm comes again

    for user_code in (broad, broader):
        with pytest.raises(ConfigError, match="did not finish within 0.3 s"):
            with time_limit.bounded("x"):
                user_code()
    assert caught == ["base"]


def test_a_block_within_the_limit_runs_and_disarms(short):
    with time_limit.bounded("x"):
        value = sum(range(10))
    time.sleep(0.5)   # no alarm left behind
    assert value == 45 and signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_someone_elses_alarm_handler_is_left_alone(short):
    rang = []
    previous = signal.signal(signal.SIGALRM, lambda s, f: rang.append(s))
    try:
        with time_limit.bounded("x"):
            time.sleep(0.6)   # past the limit, not stopped: the caller owns SIGALRM
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL and rang == []
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_where_there_is_no_alarm_nothing_is_bounded(short, monkeypatch):
    monkeypatch.delattr(signal, "setitimer")   # as on Windows
    with time_limit.bounded("x"):
        time.sleep(0.6)


def test_only_the_main_thread_is_bounded_and_nested_blocks_keep_the_outer_one(short):
    out = []

    def in_thread():
        with time_limit.bounded("x"):
            time.sleep(0.5)
        out.append("done")

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(10)
    assert out == ["done"]
    with pytest.raises(ConfigError, match="^outer did not finish"):
        with time_limit.bounded("outer"):
            with time_limit.bounded("inner"):
                time.sleep(60)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "ten", "5s"])
def test_a_bad_limit_is_refused(monkeypatch, value):
    monkeypatch.setenv(time_limit.ENV, value)
    with pytest.raises(ConfigError, match=rf"{time_limit.ENV}='{value}' is not a number of seconds > 0; set it"):
        with time_limit.bounded("x"):
            pass


def test_the_default_limit_a_longer_trial_limit_and_the_variable(monkeypatch):
    monkeypatch.delenv(time_limit.ENV, raising=False)
    assert time_limit.limit_s() == time_limit.DEFAULT_S
    with time_limit.allowing(900.0):   # tune --timeout 900: its model may take as long to read
        assert time_limit.limit_s() == 900.0
        with time_limit.allowing(None):
            assert time_limit.limit_s() == 900.0
    with time_limit.allowing(10.0):    # a shorter trial limit does not shorten the default
        assert time_limit.limit_s() == time_limit.DEFAULT_S
    assert time_limit.limit_s() == time_limit.DEFAULT_S
    monkeypatch.setenv(time_limit.ENV, " 60 ")
    with time_limit.allowing(900.0):   # the variable, where set, is the limit
        assert time_limit.limit_s() == 60.0


def test_a_script_that_hangs_at_import_or_in_its_function(tmp_path, short):
    (tmp_path / "top.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    with pytest.raises(ConfigError, match=r"^importing model script .*top\.py did not finish within 0\.3 s and was "
                                          r"stopped at .*top\.py:3 in <module>"):
        script.load_model_def(str(tmp_path / "top.py"), "build")
    assert not [m for m in sys.modules if m.startswith("autosync_user_top_")]   # a second try imports again
    (tmp_path / "fn.py").write_text(textwrap.dedent("""
        import threading

        def build():
            threading.Event().wait()
    """))
    with pytest.raises(ConfigError, match=r"fn\.py:build\(\) did not finish within 0\.3 s and was stopped at "
                                          r".*fn\.py:5 in build"):
        script.load_model_def(str(tmp_path / "fn.py"), "build")


def test_the_command_line_ends_code_that_never_gives_control_back(tmp_path):
    code = textwrap.dedent("""
        import time
        from autosync import time_limit

        with time_limit.exit_when_stuck("inspect"), time_limit.bounded("ModelDef m: building the model"):
            while True:
                try:
                    time.sleep(60)
                except BaseException:
                    pass
    """)
    env = dict(os.environ, **{time_limit.ENV: "0.5"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("autosync inspect: error: ModelDef m: building the model did not finish within "
                                 "0.5 s and was stopped at <string>:")
    assert out.stderr.rstrip().endswith("(the process was ended: the code did not give control back)")


@pytest.mark.parametrize("call, limit", [
    (lambda api: api.make_runner("zoo:ncf", "local", trial_timeout_s=900.0), 900.0),
    (lambda api: api.make_runner("zoo:ncf", "local", trial_timeout_s=60.0), time_limit.DEFAULT_S),
    (lambda api: api.make_trainer("zoo:ncf", "ps", "local", timeout_s=1200.0), 1200.0),
])
def test_the_apis_longer_trial_limit_is_reading_the_models_too(monkeypatch, call, limit):
    import autosync.api as api
    import autosync.sources as sources

    class Read(Exception):
        pass

    def reading(model):
        raise Read(time_limit.limit_s())

    monkeypatch.delenv(time_limit.ENV, raising=False)
    monkeypatch.setattr(sources, "load_model_def", reading)
    with pytest.raises(Read) as e:
        call(api)
    assert e.value.args == (limit,) and time_limit.limit_s() == time_limit.DEFAULT_S
