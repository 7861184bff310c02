"""A trial that raises or hangs is reported, leaves nothing running, and the next one runs."""
from __future__ import annotations

import functools
import time

import pytest

from tests import runtime_models as rm


def _pids(trial) -> list[int]:
    placement = trial.meta.get("placement", {})
    return [p["pid"] for p in placement.get("workers", []) + placement.get("ps", [])]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
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

    ray_session.cloudpickle.register_pickle_by_value(rm)
    flag = tmp_path / "misbehave"
    md = rm.model_def("sgd", learning_rate=0.1,
                      dataset=functools.partial(rm.faulty_batches, flag=str(flag), at=2))
    r = RayRunner(md, "local", warmup=1, steps=3, trial_timeout_s=90)
    r.flag = flag
    yield r
    r.close()


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
