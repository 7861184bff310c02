"""A limit on the memory the user's code takes in the driver: reading a model never takes the
machine's last memory.

Reading a model runs the user's code with the user's sizes: a ``batch_size`` typed with three
digits too many made ``autosync inspect --model zoo:lm1b?batch_size=99999999`` take 23.8 GB of
this 24 GB machine in 33 s, until the kernel's OOM killer ended it (signal 9, no word, and any
other process of the machine might have been the one killed). So while a block of the user's code
runs in the driver (``time_limit.bounded``, which stops it), a thread reads this process's resident
memory every ``POLL_S``; once it has grown by more than the block's budget (``budget``: half of
what the machine had available when the block began; ``AUTOSYNC_MODEL_MEMORY`` sets it), the
block is stopped as a block past its time limit is, with a message that says how much it took and
what to lower. Available memory is the kernel's ``MemAvailable``, or what the process's cgroup
(v2 or v1) and its ancestors leave, where that is less (a container's or a job's limit).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

from strategy_space.errors import ConfigError

ENV = "AUTOSYNC_MODEL_MEMORY"
POLL_S = 0.05
SHARE = 0.5   # of what is available when a block begins: the most it may take
_CGROUP = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def _meminfo() -> dict:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


def available() -> tuple[int, int] | None:
    """(bytes available to new allocations, the machine's or the cgroup's total), or None where
    this system does not say (no ``/proc``)."""
    try:
        info = _meminfo()
        free, total = info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return None
    room = _cgroup_room()
    if room is not None:
        free, total = min(free, room[0]), min(total, room[1])
    return free, total


def _cgroup_room() -> tuple[int, int] | None:
    """(bytes left, limit) under the tightest memory limit of this process's cgroup and its
    ancestors, cgroup v2 or v1's memory controller; None: no limit found."""
    try:
        lines = _PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    tightest = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            root, files = _CGROUP, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root, files = _CGROUP / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        here = Path(path.lstrip("/"))
        for folder in (root / p for p in (here, *here.parents)):
            try:
                limit = (folder / files[0]).read_text().strip()
                if limit == "max" or int(limit) >= 1 << 60:   # (v1 writes "no limit" as a huge number)
                    continue
                room = max(0, int(limit) - int((folder / files[1]).read_text()))
            except (OSError, ValueError):
                continue
            if tightest is None or room < tightest[0]:
                tightest = (room, int(limit))
    return tightest


def resident() -> int | None:
    """This process's resident bytes, or None where the system does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def budget() -> float | None:
    """Bytes a block of the user's code may add to this process: ``AUTOSYNC_MODEL_MEMORY`` (bytes,
    or with a unit: ``512m``, ``8g``), else ``SHARE`` of what is available now; None: no limit
    (``inf``, or a system that does not say). Half, not all: a large allocation (one numpy call,
    gigabytes) is seen only once it is made, and a worker on this node builds the same model and
    batch as the driver reads, so a read that takes more than half of the node could not train
    there anyway.

    Raises:
        ConfigError: the variable is not a size.
    """
    raw = os.environ.get(ENV, "").strip().lower()
    if raw:
        return _size(raw)
    now = available()
    if now is None:
        return None
    return SHARE * now[0]


def _size(raw: str) -> float | None:
    if raw == "inf":
        return None
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    scale = units.get(raw[-1:], 1)
    try:
        value = float(raw[:-1] if raw[-1:] in units else raw) * scale
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{ENV} must be a size in bytes > 0, with k, m, g or t for KiB, MiB, GiB or TiB "
                          f"(e.g. 8g), or inf for no limit; got {raw!r}")
    return value


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


class Watch:
    """While open, calls ``over(grown)`` once (from its own thread) when this process's resident
    memory has grown by more than ``limit`` bytes since it opened."""

    def __init__(self, limit: float, over):
        self.limit, self.over = limit, over
        self.start = resident()
        self.grown = 0
        self._done = threading.Event()
        self._thread = None
        if self.start is not None:
            self._thread = threading.Thread(target=self._run, name="autosync-memory-limit", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(POLL_S):
            now = resident()
            if now is None:
                return
            self.grown = max(self.grown, now - self.start)
            if self.grown > self.limit:
                self.over(self.grown)
                return

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
