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

A driver that stops its embedded Ray itself sweeps after it: a shutdown while the agents are
still starting (Ctrl-C or SIGTERM in the first seconds of a command) left them running for about
90 s once the raylet was gone. ``ray_processes`` records the instance's processes (what descends
from the children that appeared during ``ray.init``) before a ``ray.shutdown()``, ``sweep`` stops
those still running after it. A ``ray.init`` that fails has already stopped the raylet when it
raises, and the orphaned agents are no longer the driver's descendants: ``sweep_started`` has the
watchdog, which recorded them, stop what appeared since it started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


def children() -> dict:
    """pid -> start time of this process's children now."""
    return watchdog.children_of(os.getpid())


def ray_processes(roots: dict) -> dict:
    """pid -> start time of the processes of ``roots`` still running (the children that appeared
    during ``ray.init``: GCS, the raylet, the dashboard, the log monitor) and of everything
    descended from them now (agents, workers): the embedded Ray's processes, none of the
    caller's own."""
    out = {}
    for root, born in roots.items():
        if watchdog.start_time(root) == born:
            out[root] = born
            out.update(watchdog.snapshot(root))
    return out


def sweep(seen: dict, wait_s: float = 2.0, grace_s: float = 1.0) -> list[int]:
    """After ``ray.shutdown()``: give the processes of ``seen`` (``ray_processes``) ``wait_s`` to
    exit, then stop the ones left (``watchdog.stop``); returns the pids that had to be signalled."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end and any(watchdog.start_time(p) == t for p, t in seen.items()):
        time.sleep(0.05)
    return watchdog.stop(seen, grace_s)


def sweep_started(reaper: subprocess.Popen | None, timeout_s: float = 6.0) -> None:
    """Have the watchdog ``reaper`` stop every process that appeared under the driver since it
    started, then exit (SIGUSR1); wait for it at most ``timeout_s``, then kill it."""
    if reaper is None or reaper.poll() is not None:
        return
    reaper.send_signal(signal.SIGUSR1)
    try:
        reaper.wait(timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()
