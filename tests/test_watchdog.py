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
