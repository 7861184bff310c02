"""TrialStore: round trip, concurrent reader, crash safety, merge without duplicates."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading

import pytest

from strategy_space import ClusterSpec, ModelSpec, NodeSpec, VariableSpec
from strategy_space.builders import build_all
from tuner.records.store import TrialStore
from tuner.synthetic.runner import SyntheticRunner

MODEL = ModelSpec("m", (VariableSpec("a", (64, 32)), VariableSpec("b", (32,))))
CLUSTER = ClusterSpec("c", (NodeSpec("n0", workers=2), NodeSpec("n1", workers=2)))


def _trials(seed=0):
    return SyntheticRunner(MODEL, CLUSTER, seed=seed).run(list(build_all(MODEL, CLUSTER).values()))


def test_round_trip_and_resume_helpers(tmp_path):
    trials = _trials()
    with TrialStore(tmp_path / "t.db") as st:
        assert st.add_many(trials, MODEL, CLUSTER) == len(trials)
        back = st.trials_for(MODEL.fingerprint, CLUSTER.fingerprint)
        assert [t.strategy for t in back] == [t.strategy for t in trials]
        assert [t.step_times for t in back] == [t.step_times for t in trials]
        assert [t.origin for t in back] == [t.origin for t in trials]
        assert st.has_trial(MODEL.fingerprint, CLUSTER.fingerprint, trials[0].strategy.fingerprint)
        assert not st.has_trial(MODEL.fingerprint, "other", trials[0].strategy.fingerprint)
        assert st.model(MODEL.fingerprint) == MODEL and st.cluster(CLUSTER.fingerprint) == CLUSTER
        assert not st.add(trials[0])                      # the same measurement twice: ignored
        df = st.to_dataframe()
        assert len(df) == len(trials) and set(df["model"]) == {"m"}
        st.export_parquet(tmp_path / "t.parquet")
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "t.parquet")) == len(trials)


def test_reader_sees_only_whole_trials_while_writing(tmp_path):
    path = tmp_path / "t.db"
    TrialStore(path).close()
    trials = [t for s in range(6) for t in _trials(seed=s)]
    seen, errors = [], []

    def read():
        with TrialStore(path) as r:
            while len(seen) < 200 and (not seen or seen[-1] < len(trials)):
                try:
                    got = r.trials()
                    assert all(t.ok and t.step_times for t in got)
                    seen.append(len(got))
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

    th = threading.Thread(target=read)
    th.start()
    with TrialStore(path) as w:
        w.add_many(trials, MODEL, CLUSTER)
    th.join(timeout=60)
    assert not errors
    assert seen == sorted(seen)                            # counts only grow


def test_sigkill_mid_write_keeps_committed_trials(tmp_path):
    path = tmp_path / "t.db"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.test_tuner_store import MODEL, CLUSTER, _trials
        from tuner.records.store import TrialStore
        st = TrialStore({str(path)!r})
        i = 0
        while True:
            for t in _trials(seed=i):
                st.add(t, MODEL, CLUSTER)
                print(len(st), flush=True)
            i += 1
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    committed = 0
    for line in p.stdout:
        committed = int(line)
        if committed >= 40:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    with TrialStore(path) as st:
        got = st.trials()
        assert len(got) >= committed
        assert all(t.ok and len(t.step_times) == 5 for t in got)


def test_import_merges_without_duplicates(tmp_path):
    a, b = TrialStore(tmp_path / "a.db"), TrialStore(tmp_path / "b.db")
    ta, tb = _trials(0), _trials(1)
    a.add_many(ta, MODEL, CLUSTER)
    b.add_many(ta[:3] + tb, MODEL, CLUSTER)
    assert a.import_store(b) == len(tb)
    assert a.import_store(tmp_path / "b.db") == 0
    assert len(a) == len(ta) + len(tb)
    assert a.model(MODEL.fingerprint) == MODEL
    a.close()
    b.close()


def _damaged_files(tmp_path):
    """A good store's first page only, its first half, random bytes, a text file, a foreign SQLite DB."""
    good = tmp_path / "good.db"
    with TrialStore(good) as st:
        st.add_many(_trials(), MODEL, CLUSTER)
    with TrialStore(good) as st:   # a checkpointed file: a clean close leaves no write-ahead log
        pass
    data = good.read_bytes()
    files = {"first_page": data[:4096], "half": data[: len(data) // 2], "random": os.urandom(5000),
             "text": b"trials: 3\nthis is not a database\n"}
    out = {}
    for name, content in files.items():
        out[name] = tmp_path / f"{name}.db"
        out[name].write_bytes(content)
    other = tmp_path / "foreign.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE songs (title TEXT)")
    con.commit()
    con.close()
    out["foreign"] = other
    return out


def test_a_damaged_or_foreign_store_is_one_clear_error_and_stays_untouched(tmp_path):
    """Issue 17, item 2: a truncated store, random bytes, a text file or another program's
    SQLite file raise one StoreError (a ConfigError: exit 2) naming the file; the file's bytes
    are unchanged and no journal or write-ahead-log file appears beside it."""
    from strategy_space import ConfigError
    from tuner.records.store import StoreError, check_store_file, open_existing_store

    for name, path in _damaged_files(tmp_path).items():
        before = path.read_bytes()
        siblings = sorted(os.listdir(tmp_path))
        for open_ in (check_store_file, TrialStore, open_existing_store):
            try:
                open_(path)
            except StoreError as e:
                assert isinstance(e, ConfigError)
                msg = str(e)
                assert str(path) in msg and "not a readable AutoSync trial store" in msg and "\n" not in msg, msg
            else:
                raise AssertionError(f"{name}: {open_.__name__} accepted a damaged store")
        assert path.read_bytes() == before, name
        assert sorted(os.listdir(tmp_path)) == siblings, name


def test_a_store_killed_before_its_checkpoint_still_opens(tmp_path):
    """The check must not refuse a good store whose trials still sit in the write-ahead log."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.test_tuner_store import MODEL, CLUSTER, _trials
        from tuner.records.store import TrialStore
        st = TrialStore({str(tmp_path / 'k.db')!r})
        st.add_many(_trials(), MODEL, CLUSTER)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert os.path.getsize(tmp_path / "k.db-wal") > 0
    from tuner.records.store import open_existing_store

    with open_existing_store(tmp_path / "k.db") as st:
        assert len(st) == len(_trials())


def test_a_spec_is_written_once_per_store_and_only_once_committed(tmp_path, monkeypatch):
    """Specs are immutable: a store dumps each one to YAML once, not with every trial; a spec whose
    transaction rolled back is written again with the next trial."""
    import tuner.records.store as store_module
    from tuner.records.trial import Trial

    dumped = []
    real = store_module.dumps

    def counting(obj):   # specs dumped (strategies are dumped too, once per trial)
        if isinstance(obj, (ModelSpec, ClusterSpec)):
            dumped.append(obj.name)
        return real(obj)

    monkeypatch.setattr(store_module, "dumps", counting)
    trials = _trials()
    with TrialStore(tmp_path / "s.db") as st:
        st.add_model(MODEL)
        st.add_many(trials[:4], MODEL, CLUSTER)
        assert sorted(dumped) == sorted([MODEL.name, CLUSTER.name])
    fresh = ClusterSpec("fresh", (NodeSpec("x", workers=2),))
    moved = Trial(trials[4].strategy, MODEL.fingerprint, fresh.fingerprint, "ok", step_times=(0.1,))
    with TrialStore(tmp_path / "s.db") as st:
        monkeypatch.setattr(st, "_insert", lambda *a: (_ for _ in ()).throw(RuntimeError("disk full")))
        with pytest.raises(RuntimeError, match="disk full"):
            st.add(moved, MODEL, fresh)
        monkeypatch.undo()
        dumped.clear()
        monkeypatch.setattr(store_module, "dumps", counting)
        assert st.add(moved, MODEL, fresh)
        assert sorted(dumped) == sorted([MODEL.name, "fresh"]) and st.cluster(fresh.fingerprint) == fresh


def test_typed_fields_round_trip_and_old_meta_keys_load_onto_them(tmp_path):
    """Trial.role/run_id/predicted_s/aliases/compute/measurements are stored in the meta column, as trials
    stored before they were fields hold them; such trials (the shipped dataset) load onto the fields."""
    import dataclasses

    from tuner.records.trial import META_FIELDS
    from tuner.records.warmstart import load_warm_start

    model, cluster = MODEL, CLUSTER
    t = _trials()[0]
    t = dataclasses.replace(t, role="baseline", run_id="r1", predicted_s=0.25, aliases=("ps_lb",), compute="real",
                            measurements=3)
    with TrialStore(tmp_path / "s.db") as store:
        store.add(t, model, cluster)
        [back] = store.trials()
    assert (back.role, back.run_id, back.predicted_s, back.aliases, back.compute, back.measurements) == (
        "baseline", "r1", 0.25, ("ps_lb",), "real", 3)
    assert not set(back.meta) & set(META_FIELDS) and back.meta == t.meta
    assert "measurements" not in dataclasses.replace(t, measurements=1).stored_meta()   # the default is not stored
    old = dataclasses.replace(t, role="", measurements=1,   # an old record
                              meta={**t.meta, "role": "search", "aliases": ["x"], "measurements": 2})
    assert (old.role, old.aliases, old.measurements, "role" in old.meta, "measurements" in old.meta) == (
        "search", ("x",), 2, False, False)
    with pytest.raises(ValueError, match="measurements must be an integer >= 1, got 0"):
        dataclasses.replace(t, measurements=0)
    trials = [x for _, _, ts in load_warm_start("builtin") for x in ts]
    assert {x.role for x in trials} >= {"baseline", "search"} and all(x.run_id for x in trials)
    assert {x.compute for x in trials} <= {"", "real", "emulated"}   # the shipped dataset predates the key
    assert not any(set(x.meta) & set(META_FIELDS) for x in trials)


def test_a_write_the_disk_refuses_is_a_store_error_and_keeps_what_was_stored(tmp_path):
    """A full disk (here: SQLite's page limit, which fails a write as a full disk does) mid-run:
    the write is rolled back and said as a StoreError naming the store and the fix, not a
    traceback; every trial committed before is kept and the store takes writes again once there
    is room."""
    from tuner.records.store import StoreError

    trials = [t for s in range(8) for t in _trials(seed=s)]
    path = tmp_path / "t.db"
    with TrialStore(path) as st:
        st.add_many(trials[:2], MODEL, CLUSTER)
        pages = st._db.execute("PRAGMA page_count").fetchone()[0]
        st._db.execute(f"PRAGMA max_page_count={pages}")
        with pytest.raises(StoreError, match=rf"cannot write to the trial store {path} \(database or disk is "
                                             rf"full\); what it held before is kept.*free space on its disk"):
            st.add_many(trials[2:], MODEL, CLUSTER)
        assert not st._db.in_transaction
        kept = len(st.trials())
        assert 2 <= kept < len(trials)
        st._db.execute(f"PRAGMA max_page_count={pages * 100}")
        assert st.add_many(trials, MODEL, CLUSTER) == len(trials) - kept
    with TrialStore(path) as st:
        assert len(st.trials()) == len(trials)


def test_a_store_locked_past_its_timeout_is_a_store_error(tmp_path):
    from tuner.records.store import StoreError

    path = tmp_path / "t.db"
    with TrialStore(path, timeout_s=0.2) as st:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")   # another process's write in progress
        try:
            with pytest.raises(StoreError, match=r"\(database is locked\).*another process holds its lock"):
                st.add_many(_trials(), MODEL, CLUSTER)
            with pytest.raises(StoreError, match="another process holds its lock"):
                TrialStore(path, timeout_s=0.2)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert st.add_many(_trials(), MODEL, CLUSTER) == len(_trials())


def test_a_trial_prints_as_one_line_however_many_steps_it_holds():
    from strategy_space import Strategy
    from tuner.records.trial import Trial

    ok = Trial(Strategy(()), "m", "c", "ok", step_times=(0.0022,) * 400 + (0.0031,), origin="ps", role="baseline",
               run_id="ed561cdcf86f", meta={"loss": [0.5] * 400})
    assert repr(ok) == "Trial(ps: ok, median 2.2 ms of 401 steps, baseline of run ed561cdcf86f)"
    failed = Trial(Strategy(()), "m", "c", "failed", error="worker node0:1 failed: " + "x" * 300)
    assert repr(failed).startswith("Trial(strategy: failed: worker node0:1 failed: xxx") and len(repr(failed)) < 130
    assert repr(Trial(Strategy(()), "m", "c", "timeout", error="ran past 8 s", origin="search", run_id="r1",
                      role="search")) == "Trial(search: timeout: ran past 8 s, search of run r1)"
