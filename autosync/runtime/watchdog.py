"""The watchdog process behind ``autosync.runtime.reaper``: standard library only.

Run as ``python -I -S path/to/watchdog.py DRIVER_PID INTERVAL_S GRACE_S`` (by path, isolated and
without ``site``: it starts in milliseconds, imports neither AutoSync nor Ray, and no module beside
it can shadow the standard library's). Once every
``INTERVAL_S`` it records the processes descended from the driver, each with its start time; when
the driver is gone it sends SIGTERM to every recorded process still running, SIGKILL to those left
after ``GRACE_S``, and exits. A process is only signalled if its pid still has the start time it
was recorded with: a reused pid is never touched.

``process_tree`` is also what the reaper's ``descendants`` (tests, memory benchmarks) reads.
"""
from __future__ import annotations

import os
import signal
import sys
import time


def start_time(pid: int) -> str | None:
    """The start time (clock ticks since boot) of a live process, None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        return None


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    return children


def process_tree(root: int, skip: int | None = None) -> list[int]:
    """PIDs descended from ``root`` (not ``root``; not ``skip`` nor what descends from it), parents
    before their children, read from /proc (Linux)."""
    children = _children()
    out, todo, seen = [], [root], {root}
    while todo:
        for child in children.get(todo.pop(), []):
            if child != skip and child not in seen:
                seen.add(child)
                out.append(child)
                todo.append(child)
    return out


class _SweepNow(Exception):
    """SIGUSR1: the driver asks for the sweep now (``reaper.sweep_started``)."""


def _sweep_now(signum, frame):
    raise _SweepNow


def snapshot(root: int, skip: int | None = None) -> dict[int, str]:
    """pid -> start time of the live processes descended from ``root`` (``process_tree``)."""
    out = {}
    for pid in process_tree(root, skip):
        t = start_time(pid)
        if t is not None:
            out[pid] = t
    return out


def children_of(pid: int) -> dict[int, str]:
    """pid -> start time of ``pid``'s live children."""
    out = {}
    for child in _children().get(pid, []):
        t = start_time(child)
        if t is not None:
            out[child] = t
    return out


def watch(driver: int, interval_s: float, grace_s: float) -> None:
    """Record the driver's descendants until it is gone; then stop the ones still running. On
    SIGUSR1 (the driver's start of Ray was interrupted) stop at once the ones that appeared since
    the watchdog started, and exit: the driver goes on, and what it ran before is its own."""
    me = os.getpid()
    born = start_time(driver)
    before = snapshot(driver, me) if born is not None else {}
    seen: dict[int, str] = {}
    signal.signal(signal.SIGUSR1, _sweep_now)
    try:
        while born is not None and start_time(driver) == born:
            seen.update(snapshot(driver, me))   # a pid reused since is recorded with its new start time
            time.sleep(interval_s)
    except _SweepNow:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        seen.update(snapshot(driver, me))
        seen = {p: t for p, t in seen.items() if before.get(p) != t}
    stop(seen, grace_s)


def stop(seen: dict, grace_s: float) -> list[int]:
    """SIGTERM to each process of ``seen`` (pid -> start time) that still runs with that start
    time, SIGKILL to those left after ``grace_s``; returns the pids signalled."""
    signalled = []
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        alive = [p for p, t in seen.items() if start_time(p) == t]
        for pid in alive:
            try:
                os.kill(pid, sig)
                signalled.append(pid)
            except OSError:
                pass
        end = time.monotonic() + wait
        while alive and time.monotonic() < end:
            time.sleep(0.1)
            alive = [p for p in alive if start_time(p) == seen[p]]
    return sorted(set(signalled))


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
