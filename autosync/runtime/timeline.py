"""A timeline of a trial: what every worker and parameter server did, step by step, as a Chrome
trace (the role Horovod's timeline plays for its collectives), so that where a step's time goes
can be seen instead of guessed.

Each actor records spans while recording is on (``start``/``stop``, turned on and off by the
driver through the actors' ``timeline`` method): a worker its ``pull`` (waiting for and assigning
the values of its step), ``compute`` and each channel's hand-over (``ps push``, ``allreduce``,
``graph``) with the collectives inside (``collective``); a parameter server each ``push`` it
receives, the time a step's pushes took to arrive (``pushes in``: from the first to the last, per
chunk), each ``apply`` and each pull it serves (``serve pull``: from its values being ready to its
reply). Off, a span costs a function call. Times are the actor's wall clock (``time.time``):
spans of actors on different machines line up only as well as their clocks agree.

``chrome_trace`` turns the actors' events into the JSON object ``chrome://tracing`` and Perfetto
(ui.perfetto.dev) open; ``phase_table`` sums them per actor and span name per step.
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

MAX_EVENTS = 200_000   # per actor and recording: a long run keeps its first steps, and says it dropped some

_events: list | None = None   # (name, start perf_counter, end perf_counter, thread name, args) while recording
_dropped = 0
_offset = 0.0   # time.time() - time.perf_counter(), taken when recording starts
_step = None   # the step a worker is in (``at_step``): spans that name none are of it


class _Span:
    __slots__ = ("name", "args", "t0")

    def __init__(self, name: str, args: dict):
        self.name, self.args = name, args

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        add(self.name, self.t0, time.perf_counter(), **self.args)
        return False


class _Off:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_OFF = _Off()


def recording() -> bool:
    """Whether spans are being recorded in this process."""
    return _events is not None


def span(name: str, **args):
    """A context manager recording ``name`` over its block (with ``args`` shown beside it), while
    recording is on; otherwise a shared no-op."""
    return _OFF if _events is None else _Span(name, args)


def at_step(step: int) -> None:
    """Say which step this process (a worker) is in: spans recorded without a ``step`` argument
    (a channel's collectives) are given it."""
    global _step
    _step = step


def add(name: str, t0: float, t1: float, **args) -> None:
    """Record a span from ``t0`` to ``t1`` (``time.perf_counter`` values) if recording is on."""
    global _dropped
    events = _events
    if events is None:
        return
    if len(events) >= MAX_EVENTS:
        _dropped += 1
        return
    if "step" not in args and _step is not None:
        args["step"] = _step
    events.append((name, t0, t1, threading.current_thread().name, args))


def toggle(record: bool) -> dict | None:
    """Start recording (``record``; drops what an earlier recording left), or stop it and return
    ``{"events": [...], "dropped": n}`` with each event as ``[name, start_us, duration_us, thread,
    args]`` on the wall clock (None if nothing was recording)."""
    global _events, _dropped, _offset, _step
    if record:
        _offset = time.time() - time.perf_counter()
        _events, _dropped, _step = [], 0, None
        return None
    events, _events = _events, None
    if events is None:
        return None
    out = [[name, (t0 + _offset) * 1e6, max(0.0, t1 - t0) * 1e6, thread, args]
           for name, t0, t1, thread, args in events]
    return {"events": out, "dropped": _dropped}


def chrome_trace(streams: dict, meta: dict | None = None) -> dict:
    """The Chrome trace (JSON object format) of ``streams``: actor label -> ``toggle(False)``'s
    result (None: the actor recorded nothing). One process per actor, one row per thread."""
    trace, tids = [], {}
    for pid, (label, stream) in enumerate(streams.items(), start=1):
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for name, ts, dur, thread, args in (stream or {}).get("events", ()):
            tid = tids.setdefault((pid, thread), len(tids) + 1)
            trace.append({"ph": "X", "name": name, "cat": label.split()[0], "pid": pid, "tid": tid,
                          "ts": round(ts, 1), "dur": round(dur, 1), "args": args})
    for (pid, thread), tid in tids.items():
        trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
    dropped = {label: s["dropped"] for label, s in streams.items() if s and s.get("dropped")}
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {**(meta or {}), **({"dropped_events": dropped} if dropped else {})}}


def phase_table(streams: dict) -> list[dict]:
    """Per actor and span name (in first-seen order): how many spans, and milliseconds per step:
    the median over the steps of each step's total where the spans name their ``step`` (the
    warm-up's first steps, tracing included, do not skew it), else their total over the most
    ``compute`` spans any worker recorded. Nested spans count in their parent too."""
    steps = max([sum(e[0] == "compute" for e in (s or {}).get("events", ())) for s in streams.values()] + [1])
    rows = []
    for label, stream in streams.items():
        per: dict = {}
        for name, _, dur, _, args in (stream or {}).get("events", ()):
            per.setdefault(name, []).append((args.get("step"), dur))
        for name, spans in per.items():
            if all(step is not None for step, _ in spans):
                by_step: dict = {}
                for step, dur in spans:
                    by_step[step] = by_step.get(step, 0.0) + dur
                ms = float(np.median(list(by_step.values()))) / 1e3
            else:
                ms = sum(dur for _, dur in spans) / 1e3 / steps
            rows.append({"actor": label, "span": name, "count": len(spans), "ms_per_step": ms})
    return rows


def _plain(value):
    """A span argument JSON cannot hold as it is: a numpy scalar's value, else its text."""
    return value.item() if hasattr(value, "item") else str(value)


def check_path(path: str | os.PathLike, what: str) -> None:
    """Refuse, before anything runs, a timeline path whose folder does not exist or cannot be
    written, or that is a folder.

    Raises:
        ConfigError: saying which, and naming ``what`` (the flag or argument).
    """
    from strategy_space.errors import ConfigError

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        problem = "is a folder" if os.path.isdir(path) else "its folder does not exist or cannot be written"
        raise ConfigError(f"{what} {path!r}: {problem}; give a file path in a writable folder, e.g. timeline.json")


def save(path: str | os.PathLike, streams: dict, meta: dict | None = None) -> list[dict]:
    """Write ``streams`` to ``path`` as a Chrome trace (``write``); returns their ``phase_table``."""
    write(path, chrome_trace(streams, meta))
    return phase_table(streams)


def write(path: str | os.PathLike, trace: dict) -> None:
    """Write ``trace`` as JSON to ``path`` atomically (a temporary file beside it, then renamed).

    Raises:
        OSError: the folder cannot be written.
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(trace, f, separators=(",", ":"), default=_plain)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
