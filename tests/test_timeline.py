"""``autosync.runtime.timeline``: recording spans, the Chrome trace and the per-step table (no Ray,
no TensorFlow)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from autosync.runtime import timeline


@pytest.fixture(autouse=True)
def _off():
    timeline.toggle(False)
    yield
    timeline.toggle(False)


def test_off_records_nothing_and_costs_a_shared_no_op():
    assert not timeline.recording()
    assert timeline.span("pull", step=0) is timeline.span("compute")
    with timeline.span("pull", step=0):
        pass
    timeline.add("apply", 0.0, 1.0, step=0)
    assert timeline.toggle(False) is None


def test_spans_on_the_wall_clock_with_the_step_of_the_worker():
    before = time.time() * 1e6
    timeline.toggle(True)
    timeline.at_step(4)
    with timeline.span("collective", tag="p", bytes=np.int64(12)):
        time.sleep(0.002)
    with timeline.span("pull", step=5):
        pass
    t = time.perf_counter()
    timeline.add("pushes in", t - 0.5, t, chunk=0)
    stream = timeline.toggle(False)
    after = time.time() * 1e6
    (n1, ts1, dur1, thread, a1), (n2, _, _, _, a2), (n3, ts3, dur3, _, a3) = stream["events"]
    assert (n1, n2, n3) == ("collective", "pull", "pushes in") and stream["dropped"] == 0
    assert a1 == {"tag": "p", "bytes": 12, "step": 4} and a2 == {"step": 5} and a3 == {"chunk": 0, "step": 4}
    assert before <= ts1 <= after and 2e3 <= dur1 < 1e6 and thread == "MainThread"
    assert dur3 == pytest.approx(0.5e6, rel=1e-6) and ts3 + dur3 <= after
    timeline.toggle(True)   # a new recording starts empty, with no step
    timeline.add("x", 0.0, 1.0)
    assert timeline.toggle(False)["events"][0][4] == {}


def test_a_recording_keeps_its_first_events_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(timeline, "MAX_EVENTS", 3)
    timeline.toggle(True)
    for i in range(5):
        timeline.add("compute", 0.0, 1.0, step=i)
    stream = timeline.toggle(False)
    assert [e[4]["step"] for e in stream["events"]] == [0, 1, 2] and stream["dropped"] == 2
    trace = timeline.chrome_trace({"worker 0 (n0)": stream})
    assert trace["otherData"]["dropped_events"] == {"worker 0 (n0)": 2}


def _stream(*events):
    return {"events": [list(e) for e in events], "dropped": 0}


def test_chrome_trace_has_a_process_per_actor_and_a_row_per_thread():
    streams = {"worker 0 (n0)": _stream(("pull", 1000.0, 5.0, "MainThread", {"step": 0}),
                                        ("compute", 1005.0, 10.0, "MainThread", {"step": 0})),
               "ps@n0": _stream(("apply", 1010.0, 2.0, "MainThread", {"step": 0}),
                                ("apply", 1012.0, 2.0, "update-ahead_0", {"step": 0})),
               "worker 1 (n1)": None}
    trace = timeline.chrome_trace(streams, {"model": "m"})
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {1: "worker 0 (n0)", 2: "ps@n0", 3: "worker 1 (n1)"}
    spans = [e for e in events if e["ph"] == "X"]
    assert [(procs[e["pid"]], e["name"], e["ts"], e["dur"]) for e in spans] == [
        ("worker 0 (n0)", "pull", 1000.0, 5.0), ("worker 0 (n0)", "compute", 1005.0, 10.0),
        ("ps@n0", "apply", 1010.0, 2.0), ("ps@n0", "apply", 1012.0, 2.0)]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["MainThread", "MainThread", "update-ahead_0"]
    assert len({(e["pid"], e["tid"]) for e in spans}) == 3 and trace["otherData"] == {"model": "m"}


def test_phase_table_takes_the_median_step_and_spreads_the_rest_over_the_steps():
    worker = _stream(*[("compute", 0.0, 10_000.0 if s else 900_000.0, "t", {"step": s}) for s in range(4)],
                     *[("collective", 0.0, d, "t", {"tag": "p"}) for d in (2000.0, 2000.0, 4000.0, 400_000.0)])
    ps = _stream(("apply", 0.0, 1000.0, "t", {"step": 0}), ("apply", 0.0, 3000.0, "t", {"step": 0}),
                 ("apply", 0.0, 500.0, "t", {"step": 1}))
    rows = {(r["actor"], r["span"]): r for r in timeline.phase_table({"w": worker, "ps": ps, "idle": None})}
    assert rows[("w", "compute")]["ms_per_step"] == pytest.approx(10.0)   # the first step's 900 ms is an outlier
    assert rows[("w", "collective")]["ms_per_step"] == pytest.approx(408.0 / 4)   # no step named: mean
    assert rows[("ps", "apply")]["ms_per_step"] == pytest.approx((4.0 + 0.5) / 2)   # per step, then the median
    assert rows[("ps", "apply")]["count"] == 3 and len(rows) == 3


def test_write_is_atomic_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("old")
    trace = timeline.chrome_trace({"w": _stream(("pull", 1.0, 2.0, "t", {"step": np.int64(3), "x": object()}))})
    timeline.write(path, trace)
    back = json.loads(path.read_text())
    assert back["traceEvents"][-2]["args"]["step"] == 3 and isinstance(back["traceEvents"][-2]["args"]["x"], str)
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    with pytest.raises(OSError):
        timeline.write(tmp_path / "missing" / "t.json", trace)


def test_a_path_nothing_can_be_written_to_is_refused(tmp_path):
    from strategy_space.errors import ConfigError

    timeline.check_path(tmp_path / "t.json", "timeline")
    with pytest.raises(ConfigError, match="--timeline '.*no.*': its folder does not exist or cannot be written"):
        timeline.check_path(tmp_path / "no" / "t.json", "--timeline")
    with pytest.raises(ConfigError, match="timeline .* is a folder"):
        timeline.check_path(tmp_path, "timeline")
