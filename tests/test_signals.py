"""SIGTERM in a command-line run stops it as Ctrl-C does (``autosync.signals``); the process's own
handler comes back afterwards, and a signal landing in a finalizer, where Python ignores an
exception, is sent again rather than lost."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from autosync import signals


def test_sigterm_inside_raises_terminated_a_keyboard_interrupt_and_the_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as stopped:
        with signals.terminate_as_interrupt():
            assert not signals.terminated()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)   # the handler raises at the next bytecode; never reached
    assert isinstance(stopped.value, signals.Terminated) and signals.terminated()
    assert signal.getsignal(signal.SIGTERM) is before
    signals.install()   # outside: does nothing
    assert signal.getsignal(signal.SIGTERM) is before


class _Finalized:
    frames: list = []

    def __del__(self):
        _Finalized.frames.append(sys._getframe())


def test_a_signal_in_a_finalizer_is_told_apart():
    _Finalized()   # collected at once: its __del__ records its frame
    assert signals._in_finalizer(_Finalized.frames.pop())
    assert not signals._in_finalizer(sys._getframe())


def _interrupted(args):
    raise KeyboardInterrupt


def _terminated(args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)   # the handler raises at the next bytecode; never reached
    return 0


@pytest.mark.parametrize("stop,code,said", [(_interrupted, 130, "interrupted"),
                                            (_terminated, 143, "terminated (SIGTERM)")])
def test_the_command_line_says_how_it_was_stopped_and_tune_how_to_go_on(monkeypatch, capsys, stop, code, said):
    from autosync.cli import main, runtime, tune

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(tune, "cmd_tune", stop)
    monkeypatch.setattr(runtime, "cmd_run", stop)
    assert main(["tune"]) == code
    assert capsys.readouterr().err.strip() == (f"autosync tune: {said}; the trials measured so far are in its store: "
                                               f"the same command with --resume continues the run")
    assert main(["run", "--model", "zoo:ncf", "--strategy", "ps"]) == code
    assert capsys.readouterr().err.strip() == f"autosync run: {said}"
    assert signal.getsignal(signal.SIGTERM) is before


def test_held_signals_wait_for_the_block_then_reach_the_handlers_from_before():
    got = []
    before_term = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    # Python's own Ctrl-C handler (a test runner's worker may have set SIGINT ignored)
    outer_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    before_int = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals.held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)   # delivered here, and held: the block runs to its end
                got.append("end of block")
        assert got == ["end of block"] and signal.getsignal(signal.SIGINT) is before_int
        with signals.held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            got.append("end of block")
        assert got == ["end of block", "end of block", signal.SIGTERM]
        with signals.held():   # nothing arrives: nothing is sent
            pass
        assert len(got) == 3
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # ignored before: ignored after, not raised
        with signals.held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before_term)
        signal.signal(signal.SIGINT, outer_int)
