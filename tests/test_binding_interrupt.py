"""Ctrl-C while the embedded Ray starts (``runtime.binding``, ``signals.held``): the interrupt
waits for ``ray.init`` to finish, then Ray is stopped whole and nothing it started is left.
Interrupted inside ``ray.init`` (its C++ core worker half made), the process crashed at exit
(SIGSEGV) or left Ray's agents running for about 90 s."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = r'''
import json, os, signal, threading, time
import ray
from autosync.runtime import binding, reaper, watchdog
from autosync.sources import local_cluster

signal.signal(signal.SIGINT, signal.default_int_handler)   # whatever the test runner left us
finished, swept = [], []
real_init, real_sweep = ray.init, reaper.sweep

def init(*args, **kwargs):
    # Ctrl-C arrives while ray.init runs (before it has even started anything)
    threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
    time.sleep(1.0)
    out = real_init(*args, **kwargs)
    finished.append(True)
    return out

def sweep(seen, *args, **kwargs):
    swept.append(dict(seen))
    return real_sweep(seen, *args, **kwargs)

ray.init, reaper.sweep = init, sweep
outcome = "bound"
try:
    binding.ClusterBinding.bind(local_cluster(workers=1))
except KeyboardInterrupt:
    outcome = "interrupted"
recorded = swept[0] if swept else {}
print(json.dumps({"outcome": outcome, "init_finished": bool(finished), "initialized": ray.is_initialized(),
                  "recorded": len(recorded),
                  "left": [p for p, t in recorded.items() if watchdog.start_time(int(p)) == t],
                  "handler_back": signal.getsignal(signal.SIGINT) is signal.default_int_handler}))
'''


def test_ctrl_c_during_the_start_waits_for_it_then_stops_ray_whole():
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["outcome"] == "interrupted" and facts["init_finished"] and not facts["initialized"], facts
    # Ray's processes were recorded before the shutdown (GCS, raylet, ...) and none is left
    assert facts["recorded"] >= 2 and facts["left"] == [] and facts["handler_back"], facts
