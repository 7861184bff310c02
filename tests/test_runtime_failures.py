"""A trial that raises or hangs is reported, leaves nothing running, and the next one runs."""
from __future__ import annotations

import functools
import re
import time

import numpy as np
import pytest

from autosync.runtime.data_check import DivergedWarning
from autosync.runtime.reaper import descendants
from tests import runtime_models as rm


def _pids(trial) -> list[int]:
    placement = trial.meta.get("placement", {})
    return [p["pid"] for p in placement.get("workers", []) + placement.get("ps", [])]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:   # gone before the open (ENOENT) or between the open and the read (ESRCH)
        return False


def _all_dead(pids, timeout=30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture()
def runner(ray_session, tmp_path):
    from autosync.runtime.runner import RayRunner
    from autosync.sources import local_cluster

    ray_session.cloudpickle.register_pickle_by_value(rm)
    flag = tmp_path / "misbehave"
    md = rm.model_def("sgd", learning_rate=0.1,
                      dataset=functools.partial(rm.faulty_batches, flag=str(flag), at=2))
    r = RayRunner(md, local_cluster(), warmup=1, steps=3, trial_timeout_s=90)
    r.flag = flag
    yield r
    r.close()


@pytest.mark.integration
def test_failed_and_timed_out_trials_are_contained(runner):
    from strategy_space.builders import get_builder

    from strategy_space import AllReduce, PS, Strategy, VarConfig

    strategy = get_builder("ps").build(runner.model, runner.cluster)

    names = runner.model.names
    missing = Strategy(tuple(VarConfig(n, (PS("node0"),)) for n in names[1:]))
    # nccl passes validation only on GPU clusters: here it is rejected before anything starts
    nccl = Strategy(tuple(VarConfig(n, (AllReduce(backend="nccl"),)) for n in names))
    bad, no_gpu = runner.run([missing, nccl], origins=["hand", "hand"])
    assert bad.status == "failed" and "have no synchronizer" in bad.error and names[0] in bad.error
    assert no_gpu.status == "failed" and "backend nccl needs GPUs" in no_gpu.error
    assert no_gpu.origin == "hand"

    runner.flag.write_text("raise")
    failed = runner.run([strategy])[0]
    assert failed.status == "failed", failed
    assert "injected failure in worker 1" in failed.error and "node0:1" in failed.error, failed.error
    pids = _pids(failed)
    assert len(pids) == 3, failed.meta  # two workers and one PS started before the failure
    assert _all_dead(pids), "a failed trial left actors running"

    # a batch whose ids lie outside the table fails saying so (Keras on a CPU refuses them; a PS
    # cannot serve them, and -1 would wrap in a narrow id dtype)
    runner.flag.write_text("badid")
    for s in (strategy, get_builder("all_reduce").build(runner.model, runner.cluster)):
        outside = runner.run([s])[0]
        assert outside.status == "failed", outside
        assert re.search(rf"batch 3 looks up rows \[-1, {rm.VOCAB}\] of emb/embeddings, a table of "
                         rf"{rm.VOCAB} rows \(ids must be in \[0, {rm.VOCAB}\)", outside.error), outside.error

    # a nan in the data: the trial is measured, and the divergence of a lossless strategy is said
    runner.flag.write_text("nan")
    with pytest.warns(DivergedWarning, match=r"its loss became nan in a trial of a lossless, synchronous strategy"):
        diverged = runner.run([strategy])[0]
    assert diverged.status == "ok" and not np.isfinite(diverged.meta["loss"][-1]), diverged

    runner.flag.unlink()
    ok = runner.run([strategy])[0]
    assert ok.status == "ok", ok.error
    assert len(ok.step_times) == 3 and ok.median > 0
    assert ok.meta["ray_calls_per_step_per_worker"] == 2, ok.meta  # one push + one pull to the single PS

    runner.flag.write_text("hang")
    runner.trial_timeout_s = 8.0
    hung = runner.run([strategy])[0]
    assert hung.status == "timeout" and "8 s" in hung.error, (hung.status, hung.error)
    assert _all_dead(_pids(hung)), "a timed-out trial left actors running"

    runner.flag.unlink()
    runner.trial_timeout_s = 90.0
    again = runner.run([strategy])[0]
    assert again.status == "ok", again.error
    assert set(_pids(again)).isdisjoint(_pids(hung))  # fresh actors replaced the killed ones

    runner.close()
    assert _all_dead(_pids(again)), "close() left actors running"


def _ps_processes() -> list[int]:
    """PIDs of parameter-server actors of this test session's Ray (never another process's)."""
    import os

    out = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if f.read().startswith("ray::ParameterServerShard"):
                    out.append(pid)
        except OSError:
            continue
    return out


@pytest.mark.integration
def test_a_killed_parameter_server_is_named_as_the_actor_that_died(runner):
    """Issue 17, item 6: a parameter server killed mid-trial is reported as that parameter
    server's death, not as a failure of the worker that was waiting on it."""
    import os
    import signal
    import threading

    from strategy_space.builders import get_builder

    strategy = get_builder("ps").build(runner.model, runner.cluster)
    runner.flag.write_text("hang")   # worker 1 stalls at step 2, so the trial is still running
    out = {}
    th = threading.Thread(target=lambda: out.update(trial=runner.run([strategy])[0]), daemon=True)
    th.start()
    end = time.monotonic() + 60
    while not _ps_processes() and time.monotonic() < end:
        time.sleep(0.2)
    pids = _ps_processes()
    assert pids, "no parameter-server actor appeared"
    time.sleep(2.0)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    th.join(timeout=80)
    runner.flag.unlink()
    trial = out["trial"]
    assert trial.status == "failed", (trial.status, trial.error)
    assert trial.error.startswith("parameter server ps@node0 died"), trial.error
    assert "Traceback" not in trial.error and "\n" not in trial.error


@pytest.mark.integration
def test_a_killed_driver_leaves_nothing_of_its_local_ray_running(tmp_path):
    """Issue 17, item 6: after ``kill -9`` of a driver that started the embedded ``local`` Ray,
    its processes (GCS, raylet, dashboard and runtime-env agents, workers) are gone within
    seconds, not after Ray's own minute-long parent check."""
    import os
    import signal
    import subprocess
    import sys

    code = (f"import sys, time; sys.path.insert(0, {os.getcwd()!r})\n"
            "from autosync.sources import local_cluster\n"
            "from autosync.runtime.binding import ClusterBinding\n"
            "ClusterBinding.bind(local_cluster()); print('ready', flush=True); time.sleep(600)\n")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout.readline().strip() == "ready"
        time.sleep(2.0)   # the watchdog has seen the agents
        started = descendants(driver.pid)
        names = []
        for pid in started:
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    names.append(f.read())
            except OSError:
                pass
        assert any("DashboardAgent" in n or "dashboard" in n for n in names), names
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert _all_dead(started, timeout=20.0), "processes of the killed driver's Ray are still running"
