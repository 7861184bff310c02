"""Ray's own output goes to a log file while a command runs Ray, never to the command's stdout.

Ray's driver prints what its cluster reports (a raylet's "A worker died ..." line) to **stdout**,
and an error nobody fetched (an actor call to a parameter server that died) as an "Unhandled error"
traceback to stderr; the C++ core worker writes to file descriptor 2 directly. Any of these on
stdout makes ``--json`` output invalid, and a traceback on stderr reads as a crash. So while a
command runs Ray, file descriptors 1 and 2 point to a log file; the command's own messages go to
``RayLog.terminal`` (the real stderr), its results are printed after the block, and the log is
named when something was written to it (and removed when nothing was, or only TensorFlow's
start-up notices).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import IO

from strategy_space.errors import ConfigError


@dataclass
class RayLog:
    """Where Ray's output went (``path``; None once removed because empty) and the stream the
    command's own progress messages are written to while the block runs (``terminal``)."""

    path: str | None
    terminal: IO[str]

    def note(self) -> str:
        return f"Ray's own messages are in {self.path}" if self.path else ""


# what TensorFlow's C++ runtime prints as it loads in this process (absl's start-up notice and
# glog-style lines such as "I0000 00:00:17955 123 cudart_stub.cc:31] Could not find cuda drivers"):
# start-up noise, not Ray's output; a log holding nothing else is removed, not named
_TF_CHATTER = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
                         r"STDERR|[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\] .*|To enable the following instructions:.*"
                         r"|\s*)$")


# the real stderr of each block running (innermost last): where a command's own messages go
_TERMINALS: list = []


def terminal() -> IO[str]:
    """Where a command's own messages go now: the real stderr while a block sends Ray's output to
    a log, ``sys.stderr`` otherwise."""
    return _TERMINALS[-1] if _TERMINALS else sys.stderr


def _worth_naming(path: str) -> bool:
    with open(path, errors="replace") as f:
        return any(not _TF_CHATTER.match(line.rstrip("\n")) for line in f)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _disconnect_ray() -> None:
    """Leave a Ray cluster the block connected to (RAY_ADDRESS) before stdout is restored: its
    driver threads would print what the cluster reports until the process exits."""
    with contextlib.suppress(Exception):
        sys.modules["ray"].shutdown()


@contextlib.contextmanager
def ray_output_to_log(command: str):
    """Send everything written to stdout and stderr (file descriptors 1 and 2) during the block to
    a new log file. Yields a RayLog.

    A ConfigError raised in the block names the log when Ray wrote to it; after a block that
    ends otherwise, such a log is named on stderr.
    """
    ray_was_up = _ray_is_up()   # a Ray session this process had before is left to its owner
    # (the process id in the name tells a killed command's log, which nobody removes, by its pid)
    fd, path = tempfile.mkstemp(prefix=f"autosync-{command}-{os.getpid()}-", suffix=".log")
    _flush()
    saved = (os.dup(1), os.dup(2))
    terminal = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    log = RayLog(path, terminal)
    _TERMINALS.append(terminal)
    failed = other = None
    try:
        yield log
    except ConfigError as e:
        failed = e
    except BaseException as e:   # noqa: BLE001 - re-raised below, once the log is named
        other = e
    finally:
        _TERMINALS.remove(terminal)
        if not ray_was_up and _ray_is_up():
            _disconnect_ray()
        _flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)
        terminal.close()
        if not _worth_naming(path):
            os.remove(path)
            log.path = None
    if other is not None:   # an interrupt or a bug: its traceback follows; what Ray said may explain it
        if log.path:
            print(f"autosync {command}: {log.note()}", file=sys.stderr)
        raise other
    if failed is not None:
        if log.path:
            raise ConfigError(failed.problems[:-1] + [f"{failed.problems[-1]} ({log.note()})"],
                              source=failed.source) from None
        raise failed
    if log.path:
        print(f"autosync {command}: {log.note()}", file=sys.stderr)
