"""The reaper's watchdog on plain processes (no Ray): a killed driver's descendants are stopped,
a pid reused by an unrelated process is not."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from autosync.runtime import watchdog

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the watchdog reads /proc (Linux)")

# a "driver" that starts a grandchild which ignores SIGTERM (only SIGKILL stops it), prints its pid
DRIVER = r'''
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True)
g.stdout.readline()
print(g.pid, flush=True)
time.sleep(60)
'''


def _wait_gone(pid: int, born: str, limit_s: float) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if watchdog.start_time(pid) != born:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_drivers_descendants_are_stopped_even_if_they_ignore_sigterm():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    dog = None
    try:
        grandchild = int(driver.stdout.readline())
        born = watchdog.start_time(grandchild)
        assert born is not None and grandchild in watchdog.process_tree(driver.pid)
        dog = subprocess.Popen([sys.executable, "-I", "-S", watchdog.__file__, str(driver.pid), "0.1", "0.5"])
        time.sleep(0.5)   # it has recorded the tree
        assert dog.poll() is None and watchdog.start_time(grandchild) == born   # nothing touched while the driver lives
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        assert _wait_gone(grandchild, born, 10.0), "the orphaned grandchild still runs"
        assert dog.wait(10) == 0   # and the watchdog exits
    finally:
        for p in (driver, dog):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def test_the_walk_lists_children_before_theirs_and_skips_a_subtree():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(driver.stdout.readline())
        tree = watchdog.process_tree(os.getpid())
        assert tree.index(driver.pid) < tree.index(grandchild)
        assert driver.pid not in watchdog.process_tree(os.getpid(), skip=driver.pid)
        assert grandchild not in watchdog.process_tree(os.getpid(), skip=driver.pid)
        assert watchdog.start_time(2**22 + 7) is None   # no such pid
    finally:
        if grandchild is not None and grandchild in watchdog.process_tree(driver.pid):
            os.kill(grandchild, signal.SIGKILL)
        driver.kill()
        driver.wait(10)


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_asked_to_sweep_now_it_stops_what_appeared_since_it_started_and_leaves_the_rest():
    """An interrupted start of Ray (``reaper.sweep_started``): the driver lives on, so only what
    appeared under it since the watchdog started is stopped, not what it ran before."""
    from autosync.runtime.reaper import start_reaper, sweep_started

    before = subprocess.Popen(SLEEPER)
    dog = after = None
    try:
        dog = start_reaper(interval_s=0.1, grace_s=0.5)
        end = time.monotonic() + 10   # its first look at the tree: it is running with SIGUSR1 handled
        while time.monotonic() < end and dog.pid not in _sigusr1_handlers():
            time.sleep(0.05)
        after = subprocess.Popen(SLEEPER)
        sweep_started(dog, timeout_s=10)
        assert dog.poll() == 0
        assert after.wait(10) == -signal.SIGTERM
        assert before.poll() is None
    finally:
        for p in (before, after, dog):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def _sigusr1_handlers() -> set:
    """Child pids that catch SIGUSR1 (``SigCgt`` in /proc)."""
    out = set()
    for pid in watchdog.process_tree(os.getpid()):
        try:
            with open(f"/proc/{pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            continue
        if caught & (1 << (signal.SIGUSR1 - 1)):
            out.add(pid)
    return out


def test_a_sweep_stops_what_is_left_of_a_recorded_set_after_a_wait():
    from autosync.runtime.reaper import sweep

    left = subprocess.Popen(SLEEPER)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        gone.wait(10)
        seen = {p.pid: watchdog.start_time(p.pid) for p in (left, gone)}
        seen[gone.pid] = "1"   # exited: its pid, if reused, has another start time
        t0 = time.monotonic()
        assert sweep(seen, wait_s=0.3, grace_s=0.5) == [left.pid]
        assert left.wait(10) == -signal.SIGTERM and time.monotonic() - t0 >= 0.3
        assert sweep({}, wait_s=5) == []   # nothing recorded: no wait
    finally:
        if left.poll() is None:
            left.kill()
            left.wait(10)
