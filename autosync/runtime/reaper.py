"""Stop what a ``local`` run started when its driver is killed (``kill -9`` included).

``ray.init(address="local")`` starts GCS, a raylet and, under the raylet, the dashboard and
runtime-env agents and the worker processes. When the driver dies without ``ray.shutdown()``,
Ray's own reaper stops GCS and the raylet, but the agents only notice their parent is gone much
later (over a minute here), holding memory and ports meanwhile.

The watchdog (``autosync.runtime.watchdog``) is a tiny separate Python process run by path with
the standard library alone (no AutoSync or Ray import): once a second it records the processes
descended from the driver; when the driver is gone it sends SIGTERM, then SIGKILL after a grace
period, to every one of them that still runs (the same pid with the same start time: a reused pid
is never touched), and exits. It is only
started for the embedded ``local`` cluster: a cluster that outlives the driver on purpose (the
testbed, one from ``ray start``) is never a descendant of it anyway.
"""
from __future__ import annotations

import os
import subprocess
import sys

from autosync.runtime import watchdog


def start_reaper(interval_s: float = 1.0, grace_s: float = 3.0) -> subprocess.Popen | None:
    """Start the watchdog for this process (Linux only; None elsewhere)."""
    if not os.path.isdir("/proc/self"):
        return None
    return subprocess.Popen([sys.executable, "-I", "-S", watchdog.__file__, str(os.getpid()), str(interval_s), str(grace_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def descendants(root: int) -> list[int]:
    """PIDs of every process descended from ``root`` (not ``root`` itself), read from /proc
    (Linux): what a run started, for tests and memory benchmarks (the watchdog's own walk)."""
    return watchdog.process_tree(root)
