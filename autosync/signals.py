"""SIGTERM in a command-line run: stopped as Ctrl-C stops it.

A job scheduler stops a job with SIGTERM. In a Ray driver that went badly: ``ray.init`` installs a
Python handler that calls ``sys.exit(15)`` and Ray's C++ runtime one that prints a stack. The
Python handler runs at whatever bytecode the main thread is at; in a weakref callback or a
``__del__`` (a garbage collection) Python ignores the exception and the run goes on, and the
process later died of SIGABRT; elsewhere it ended with status 15 and no word.

The command line (``terminate_as_interrupt``) instead raises ``Terminated``, a
``KeyboardInterrupt``: every clean-up path Ctrl-C takes (actors killed, Ray stopped, the trial
store closed) runs, and the command says what happened and exits 143. While the main thread is in a finalizer, where an
exception would be ignored, the signal is sent again a moment later. ``install`` is called again
after each ``ray.init``, which replaces the handler. The Python API leaves signals to its caller.

``held`` makes Ctrl-C and SIGTERM wait while the embedded Ray starts (``runtime.binding``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

RETRY_S = 0.05   # a SIGTERM that arrived in a finalizer is sent again after this long
_enabled = False
_received = False


class Terminated(KeyboardInterrupt):
    """This process got SIGTERM."""


@contextlib.contextmanager
def terminate_as_interrupt():
    """Inside, SIGTERM stops the main thread as Ctrl-C does (the command line); the process's own
    handler is given back on the way out (a test that calls the command line in its process)."""
    global _enabled, _received
    main = threading.current_thread() is threading.main_thread()
    _received = False
    before = signal.getsignal(signal.SIGTERM) if main else None
    _enabled = True
    install()
    try:
        yield
    finally:
        _enabled = False
        if main and before is not None:
            signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def held(signums=(signal.SIGINT, signal.SIGTERM)):
    """Inside, Ctrl-C and SIGTERM wait: a signal that arrives is recorded, and sent again once the
    block has ended and the handlers from before are back, so the code inside never sees an
    exception it cannot survive (``ray.init`` interrupted while it built its C++ core worker left
    one half made, and the process crashed at exit, SIGSEGV). A handler the code inside sets for
    one of these signals is not set (``ray.init`` sets one for SIGTERM that calls ``sys.exit``):
    the caller's stays. Main thread only; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list = []
    before = {s: signal.getsignal(s) for s in signums}
    record = lambda signum, frame: got.append(signum)  # noqa: E731
    for s in signums:
        signal.signal(s, record)
    real = signal.signal
    signal.signal = lambda signum, handler: record if signum in before else real(signum, handler)
    try:
        yield
    finally:
        signal.signal = real
        for s, handler in before.items():
            # None: a handler set outside Python, which cannot be put back: the default instead
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if got:
            signal.raise_signal(got[0])


def install() -> None:
    """(Re)install the handler inside ``terminate_as_interrupt``: after ``ray.init``, which sets its own."""
    if _enabled and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _handler)


def terminated() -> bool:
    """Whether SIGTERM stopped this process (code that catches a KeyboardInterrupt and raises
    another loses the ``Terminated`` type, not this)."""
    return _received


def _handler(signum, frame) -> None:
    global _received
    if _in_finalizer(frame):
        threading.Timer(RETRY_S, os.kill, (os.getpid(), signum)).start()
        return
    _received = True
    raise Terminated()


def _in_finalizer(frame) -> bool:
    """Whether the interrupted code runs in a weakref callback or a ``__del__``, where Python
    ignores an exception."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            return True
        frame = frame.f_back
    return False
