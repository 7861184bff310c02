"""One readable line for an exception raised by a user's model code.

TensorFlow and Keras wrap what went wrong in several lines: a traced function's error starts with
"in user code:" and the frames of the trace, Keras adds "Exception encountered when calling
Dense.call()" and an "Arguments received by ..." list, and the cause itself is bolded with ANSI
escapes. The first line alone ("ValueError: in user code:") says nothing; the whole text is a
screen. ``what_failed`` keeps the sentences that say what is wrong and drops the rest;
``error_reason`` finds the user's exception inside Ray's wrapping first.
"""
from __future__ import annotations

import os
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
    memory = out_of_memory(str(e))
    if memory:
        return f"OutOfMemoryError: {memory}"
    if isinstance(e, ray.exceptions.RayError):
        # Ray's text ends with the original exception line, after its traceback
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        return lines[-1] if lines else type(e).__name__
    return what_failed(e)


def out_of_memory(text: str) -> str | None:
    """A sentence for Ray's memory monitor killing a process (its ``OutOfMemoryError`` text is a
    page: object store statistics, the ten largest processes, advice on Ray's own settings): the
    node's use and limit, what the process killed held, and what to change; None for any other
    error's ``text``."""
    if "running low on memory" not in text:
        return None
    node = re.search(r"Memory on the node \(IP: ([^,)]+)[^)]*\) was ([\d.]+\s*GB used / [\d.]+\s*GB limit)", text)
    used = re.search(r"Selected to kill:.*?actual memory used=([\d.]+\s*GB)", text, re.S)
    where = f"the node at {node.group(1)} had {node.group(2)}" if node else "its node ran low on memory"
    what = f", {used.group(1)} of it in the process killed" if used else ""
    return (f"Ray killed it for memory: {where}{what}. What the strategy keeps on that node (its workers' "
            f"model copies, parameter-server shards with their optimizer slots) does not fit there: spread the "
            f"shards over more nodes, run fewer workers there, or use a node with more memory")


# what a failed actor's death says of its node: Ray's "The actor died because its node has died"
NODE_DIED = "its node left the Ray cluster"


def token_mismatch(text: str) -> str:
    """A fix for actors that never ran while this process sends a token (``RAY_AUTH_MODE=token``):
    a Ray cluster started without token authentication lets such a driver connect and then cancels
    every actor it starts ("The actor never ran - it was cancelled before it started running");
    "" for any other ``text`` or setting."""
    if "actor never ran" not in text or os.environ.get("RAY_AUTH_MODE", "").strip().lower() != "token":
        return ""
    return ("; RAY_AUTH_MODE=token is set here, and a Ray cluster started without token authentication cancels "
            "every actor such a process starts: unset RAY_AUTH_MODE unless the cluster uses tokens")


def node_died(text: str) -> str | None:
    """``NODE_DIED`` where Ray says an actor died with its node (a node that crashed, was
    preempted or was removed), None for any other error's ``text``."""
    return NODE_DIED if "because its node has died" in text else None


def first_reason(error: str | None) -> str:
    """The first line of a trial's error that says something: a ConfigError of several problems
    starts with "N problems:", and its first problem is on the next line (at most 400 characters)."""
    lines = [ln.strip(" -*") for ln in (error or "").splitlines() if ln.strip(" -*")] or ["no error recorded"]
    line = " ".join(lines[:2]) if lines[0].endswith(" problems:") else lines[0]
    return line if len(line) <= 400 else line[:399] + "…"


def python_branch(text: str) -> str:
    """A fix for an error ``text`` of TensorFlow's ``OperatorNotAllowedInGraphError``: the model's
    code branches or loops in Python on a tensor's value, which a traced step cannot do (AutoSync
    traces it as ``keras.Model.fit`` does, without AutoGraph: ``fast_call``); "" for any other."""
    if "OperatorNotAllowedInGraphError" not in text:
        return ""
    return ("; the model's code (a layer's call, the loss) uses a tensor's value in a Python if, while or for, which "
            "a traced training step cannot: keras.Model.fit traces its step without AutoGraph, and so do AutoSync's "
            "workers; write it with keras.ops.cond or keras.ops.where (a loop: keras.ops.while_loop, "
            "keras.ops.fori_loop; or tf.cond, tf.while_loop)")
