"""One readable line for an exception raised by a user's model code.

TensorFlow and Keras wrap what went wrong in several lines: a traced function's error starts with
"in user code:" and the frames of the trace, Keras adds "Exception encountered when calling
Dense.call()" and an "Arguments received by ..." list, and the cause itself is bolded with ANSI
escapes. The first line alone ("ValueError: in user code:") says nothing; the whole text is a
screen. ``what_failed`` keeps the sentences that say what is wrong and drops the rest;
``error_reason`` finds the user's exception inside Ray's wrapping first.
"""
from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DROP = ("in user code:", "Arguments received by", "•")


def what_failed(e: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, without TensorFlow's trace frames, Keras' argument list or
    terminal escapes, cut at ``limit`` characters (with `` ...``)."""
    lines, after_frame = [], False
    for line in _ANSI.sub("", str(e)).splitlines():
        text = line.strip()
        if after_frame:   # a frame's source line follows it
            after_frame = False
            continue
        if text.startswith('File "'):
            after_frame = True
            continue
        if text and not text.startswith(_DROP):
            lines.append(text)
    message = " ".join(lines)
    name = type(e).__name__
    out = message if message.startswith(f"{name}: ") else f"{name}: {message}" if message else name
    return out if len(out) <= limit else out[:limit].rstrip() + " ..."


def error_reason(e: BaseException) -> str:
    """One line that says what failed, without Ray's wrapping tracebacks."""
    import ray

    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    if cause is not None and not isinstance(cause, ray.exceptions.RayError):
        return what_failed(cause)
    if isinstance(e, ray.exceptions.RayError):
        # Ray's text ends with the original exception line, after its traceback
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        return lines[-1] if lines else type(e).__name__
    return what_failed(e)
