"""Stop what a ``local`` run started when its driver is killed (``kill -9`` included).

``ray.init(address="local")`` starts GCS, a raylet and, under the raylet, the dashboard and
runtime-env agents and the worker processes. When the driver dies without ``ray.shutdown()``,
Ray's own reaper stops GCS and the raylet, but the agents only notice their parent is gone much
later (over a minute here), holding memory and ports meanwhile.

The watchdog is a tiny separate Python process (standard library only, no AutoSync or Ray
import): once a second it records the processes descended from the driver; when the driver is
gone it sends SIGTERM, then SIGKILL after a grace period, to every one of them that still runs
(the same pid with the same start time: a reused pid is never touched), and exits. It is only
started for the embedded ``local`` cluster: a cluster that outlives the driver on purpose (the
testbed, one from ``ray start``) is never a descendant of it anyway.
"""
from __future__ import annotations

import os
import subprocess
import sys

_WATCHDOG = r"""
import os, signal, sys, time

driver, interval, grace = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
me = os.getpid()


def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        return None


def descendants():
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = {}, [driver]
    while todo:
        for child in children.get(todo.pop(), []):
            if child != me and child not in out:
                t = start_time(child)
                if t is not None:
                    out[child] = t
                    todo.append(child)
    return out


born = start_time(driver)
seen = {}
while born is not None and start_time(driver) == born:
    seen.update(descendants())
    time.sleep(interval)
for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
    alive = [p for p, t in seen.items() if start_time(p) == t]
    for pid in alive:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    end = time.monotonic() + wait
    while alive and time.monotonic() < end:
        time.sleep(0.1)
        alive = [p for p in alive if start_time(p) == seen[p]]
"""


def start_reaper(interval_s: float = 1.0, grace_s: float = 3.0) -> subprocess.Popen | None:
    """Start the watchdog for this process (Linux only; None elsewhere)."""
    if not os.path.isdir("/proc/self"):
        return None
    return subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid()), str(interval_s), str(grace_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def descendants(root: int) -> list[int]:
    """PIDs of every process descended from ``root`` (not ``root`` itself), read from /proc
    (Linux): what a run started, for tests and memory benchmarks. The watchdog above keeps its own
    copy of this walk, since it runs with the standard library alone."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
