"""A limit on the user's code that the driver runs: reading a model never hangs a command.

The driver runs a user's code to read a model: the script's top level, the function that returns
the ModelDef, ``model_fn``, the first batch of ``dataset_fn``, ``optimizer_fn``, and a traced
step to time it. A download that never ends, a data source that never answers or a stray
``while True`` there hung ``autosync tune`` with no word (the workers' calls are bounded by the
trial limit). Each such block runs under ``bounded``: past ``limit_s()`` seconds
(``AUTOSYNC_MODEL_TIMEOUT``, default 300) the main thread gets an exception at the Python line it
is on (SIGALRM, again every few seconds should the code catch it), which becomes a ConfigError
that says what ran, where it was stopped and how to give it longer.

Code stuck where Python never runs a signal handler (inside a C call that never returns) cannot be
stopped that way. The command line (``exit_when_stuck``) then prints the same message and ends
the process with exit code 2 once the limit and as long again (at most 30 s) have passed; the
Python API leaves its caller's process alone.

Its memory is bounded too (``memory_limit``: a block that takes more than half of what the machine
had available when it began is stopped the same way, and the command line ends one that does not
give control back within ``MEMORY_GRACE_S``), in the driver only: Ray watches its workers' memory.

Only the main thread is bounded (signals reach only it), of the driver, or of a Ray worker where
it asks (``in_worker``: a training worker's load and its steps' data draws, within what is left of
the trial's limit, so that the trial says where its code hung: ``TrainingWorker.load_within`` and
``run_within``); only where no one else handles SIGALRM, and not where there is none (Windows).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import sysconfig
import threading
import traceback
from pathlib import Path

from autosync import memory_limit
from strategy_space.errors import ConfigError

ENV = "AUTOSYNC_MODEL_TIMEOUT"
DEFAULT_S = 300.0
AGAIN_S = 5.0    # the exception is raised again this often while the code goes on (it caught it)
GRACE_S = 30.0   # the command line ends a process stuck this long past the limit (or the limit, if shorter)
MEMORY_GRACE_S = 2.0   # ... or this long past its memory budget
_OWN = Path(__file__).resolve().parent
# hard: the command that ends stuck code; allowed: its limit per trial, which reading the model may take too
_state = {"active": False, "hard": None, "allowed": 0.0}


class CodeTimeout(ConfigError):
    """What ``bounded`` raises for a block that ran past its limit: bad input, and a time-out (a
    trial that fails with it is not run again: ``runtime.waiting.wait_all``)."""


class MemoryOverrun(ConfigError):
    """What ``bounded`` raises for a block that took more memory than it may (``memory_limit``)."""


class Overrun(BaseException):
    """Raised in the main thread when a bounded block runs past its limit; a BaseException, so
    that a user's ``except Exception`` does not swallow it."""


def limit_s() -> float:
    """Seconds a block of the user's code may run in the driver: ``AUTOSYNC_MODEL_TIMEOUT``, else
    the default or the command's longer limit per trial (``allowing``).

    Raises:
        ConfigError: the variable is set to something that is not a number of seconds > 0.
    """
    text = os.environ.get(ENV, "").strip()
    if not text:
        return max(DEFAULT_S, _state["allowed"])
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ConfigError(f"{ENV}={text!r} is not a number of seconds > 0; set it to the seconds that reading "
                          f"a model may take (e.g. {ENV}=900) or unset it (default {DEFAULT_S:g})")
    return value


@contextlib.contextmanager
def exit_when_stuck(command: str):
    """Inside (the command line's ``command``), a bounded block that Python cannot stop ends the
    process, after printing the message a ConfigError would have given."""
    before = _state["hard"]
    _state["hard"] = command
    try:
        yield
    finally:
        _state["hard"] = before


@contextlib.contextmanager
def allowing(seconds: float | None):
    """Inside, the default limit is at least ``seconds`` (a command's ``--timeout`` per trial: a
    model whose trials may run that long may take as long to read); None changes nothing."""
    before = _state["allowed"]
    if isinstance(seconds, (int, float)) and 0 < seconds < math.inf:
        _state["allowed"] = float(seconds)
    try:
        yield
    finally:
        _state["allowed"] = before


def _boundable(in_worker: bool) -> bool:
    if _state["active"] or threading.current_thread() is not threading.main_thread():
        return False
    if not hasattr(signal, "setitimer"):   # Windows: no SIGALRM
        return False
    if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN):
        return False   # someone else's alarm: leave it be
    ray_worker = sys.modules.get("ray._private.worker")   # a Ray process's: is it a worker's?
    mode = getattr(getattr(ray_worker, "global_worker", None), "mode", None)
    return in_worker or ray_worker is None or mode != getattr(ray_worker, "WORKER_MODE", -1)


@functools.lru_cache(maxsize=1)
def library_dirs() -> frozenset:
    """Where this Python's standard library and installed packages live (the environment's and the
    base interpreter's): modules there are every node's own, and not the user's code. Not the whole
    ``sys.prefix``: a project under ``/usr/local/src`` with a system Python at ``/usr`` is the user's."""
    bases = [None, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                    "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}]
    return frozenset(Path(paths[key]).resolve() for v in bases for paths in [sysconfig.get_paths(vars=v)]
                     for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths)


def _library(filename: str) -> bool:
    where = Path(filename).resolve()
    if where.is_relative_to(_OWN) or any(part in ("site-packages", "dist-packages") for part in where.parts):
        return True
    return any(where.is_relative_to(d) for d in library_dirs())


def where_stopped(frame) -> str:
    """``file:line in function`` of the deepest frame of the user's own code under ``frame``
    (not the standard library's, an installed package's or AutoSync's), else of ``frame``."""
    frames = traceback.extract_stack(frame) if frame is not None else []
    own = [f for f in frames if not f.filename.startswith("<") and not _library(f.filename)]
    chosen = (own or frames or [None])[-1]
    return f"{chosen.filename}:{chosen.lineno} in {chosen.name}" if chosen else "an unknown place"


def _message(what: str, limit: float, where: str, longer: str | None) -> str:
    secs = f"{limit:.1f}".rstrip("0").rstrip(".")
    longer = longer or f"set {ENV} to more seconds (now {secs})"
    return (f"{what} did not finish within {secs} s and was stopped at {where} (a wait on something that never "
            f"answers, or a loop?); fix it, or, if it needs longer, {longer}")


@contextlib.contextmanager
def bounded(what: str, *, seconds: float | None = None, longer: str | None = None, in_worker: bool = False,
            gate=None, where=None):
    """Inside, the user's code is stopped once it has run ``limit_s()`` seconds.

    Args:
        what: what the block does, the message's subject ("ModelDef ncf: building the model").
        seconds: the limit instead of ``limit_s()``; ``longer`` then says how to give it more.
        in_worker: bound a Ray worker's main thread too (its load, within what is left of the
            trial's limit: the trial fails saying where the code hung, before the driver's wait
            ends with only "time limit reached").
        gate: a function saying whether the main thread now runs the user's code; past the limit
            the block is stopped only while it does (a training worker's steps: its data draws,
            not its waits on other workers, whose hang is not its own), asked again every
            ``AGAIN_S``.
        where: ``frame -> "file:line in function"``, where the code was stopped (the main
            thread's ``frame`` when the alarm came), instead of ``where_stopped``: where the user's
            code runs on another thread the main thread waits for (a prefetching thread).

    Raises:
        CodeTimeout: the block ran past the limit (what, where it was stopped, and how to give it
            longer).
        MemoryOverrun: in the driver, the block took more memory than ``memory_limit.budget()``.
        ConfigError: ``AUTOSYNC_MODEL_TIMEOUT`` is not a number of seconds, or
            ``AUTOSYNC_MODEL_MEMORY`` not a size.
    """
    limit = limit_s() if seconds is None else float(seconds)
    if not _boundable(in_worker) or not limit > 0:
        yield
        return
    memory = None if in_worker else memory_limit.budget()   # (a worker's: Ray's memory monitor)
    stopped: list[str] = []
    over: list[int] = []   # the bytes the block had taken when it went past its memory budget

    def alarm(signum, frame):
        if done.is_set() or gate is not None and not gate() and not over:
            return
        if not stopped:
            stopped.append((where or where_stopped)(frame))
        raise Overrun(stopped[0])

    done, guard = threading.Event(), threading.Lock()   # (no signal is sent once the block is done)

    def too_much(grown: int):
        with guard:
            if done.is_set():
                return
            over.append(grown)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)
        if not done.wait(MEMORY_GRACE_S) and _state["hard"]:   # in a call Python cannot interrupt: end it
            said = _memory_message(what, grown, memory, stopped[0] if stopped else "a call Python cannot interrupt")
            print(f"autosync {_state['hard']}: error: {said} (the process was ended before the machine ran out)",
                  file=sys.stderr, flush=True)
            os._exit(2)

    def stuck():
        if not done.wait(limit + min(GRACE_S, limit)) and _state["hard"]:
            where = stopped[0] if stopped else "a call Python cannot interrupt"
            print(f"autosync {_state['hard']}: error: {_message(what, limit, where, longer)} (the process was "
                  f"ended: the code did not give control back)", file=sys.stderr, flush=True)
            os._exit(2)

    before = signal.signal(signal.SIGALRM, alarm)
    _state["active"] = True
    if _state["hard"]:
        threading.Thread(target=stuck, name="autosync-time-limit", daemon=True).start()
    watch = memory_limit.Watch(memory, too_much) if memory is not None else None
    try:
        signal.setitimer(signal.ITIMER_REAL, limit, AGAIN_S)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            with guard:
                done.set()
            if watch is not None:
                watch.close()
    except Overrun:
        where = stopped[0] if stopped else "an unknown place"
        if over:
            raise MemoryOverrun(_memory_message(what, over[0], memory, where)) from None
        raise CodeTimeout(_message(what, limit, where, longer)) from None
    finally:
        done.set()
        signal.signal(signal.SIGALRM, before)
        _state["active"] = False


def _memory_message(what: str, grown: int, budget: float, where: str) -> str:
    set_to = os.environ.get(memory_limit.ENV, "").strip()
    given = f"{memory_limit.ENV}={set_to}" if set_to else "half of what this machine had available"
    return (f"{what} took more than the {memory_limit.gib(budget)} of memory it may take ({given}): "
            f"{memory_limit.gib(grown)} when it was stopped at {where}; is a size in it (batch_size, the data, a "
            f"layer) larger than meant? Lower it, or run where there is more memory ({memory_limit.ENV} sets the "
            f"limit: e.g. 16g, or inf)")
