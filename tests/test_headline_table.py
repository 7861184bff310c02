"""The README's headline table is built from result files (``benchmarks/headline_table.py``): the
newest run of a model wins, superseded entries are named, measured and projected figures are
shown as the files hold them."""
from __future__ import annotations

import glob
import importlib
import json
import os
import sys

from tests.conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
H = importlib.import_module("headline_table")


def _entry(started, *, measured=True, origin="search", lossy="asynchronous PS on 4 shards"):
    runs = [{"reached": True, "steps_to_target": s, "time_to_target_s": t} for s, t in ((120, 5.0), (126, 5.5))]
    entry = {"model": "toy-small", "embedding_heavy": True, "commit": "abc1234", "run_started": started,
             "tune": {"best_origin": origin, "best_baseline": "ps", "lossy_parts": lossy},
             "statistical_efficiency": 0.9, "speedup_vs_best_baseline": 1.4, "vs_lower_bound": 2.0,
             "lower_bound": {"compute_s": 0.02, "busiest_nic_s": 0.03, "serial_s": 0.05, "overlapped_s": 0.03},
             "confirm": {"tuned": {"median_s": 0.045}},
             "time_to_target_projected": {"speedup_vs_best_baseline": 1.26}}
    if measured:
        entry["time_to_target"] = {
            "best_baseline_name": "ps", "tuned_is_best_baseline": False, "intervals_overlap": False,
            "speedup_vs_best_baseline": 1.3, "speedup_vs_peer": None,
            "contenders": {"tuned": {"runs": runs, "time_to_target_s": 5.2, "time_to_target_ci95_s": [4.9, 5.6],
                                     "reached": "2/2"},
                           "best_baseline": {"runs": runs, "time_to_target_s": 6.8, "time_to_target_ci95_s": None,
                                             "reached": "2/2"},
                           "ray_train": {"runs": [{"reached": False}], "time_to_target_s": None,
                                         "time_to_target_ci95_s": None, "reached": "0/1"}}}
    return entry


def test_the_newest_run_of_a_model_is_shown_and_the_other_named(tmp_path):
    old = {"models": {"toy": _entry("2026-11-01 10:00:00", lossy="lossless", origin="ps")}}
    new = {"models": {"toy": _entry("2026-11-02 10:00:00")}}
    table, notes = H.rows({"old.json": old, "new.json": new})
    assert len(table) == 1
    row = dict(zip(H.HEADERS, table[0]))
    assert row["model"] == "toy-small (emb)" and row["tuned"] == "asynchronous PS on 4 shards"
    assert row["tuned s [95 %] (steps)"] == "5.2 [4.9-5.6] (120-126)"
    assert row["baseline s [95 %] (steps)"] == "6.8 (120-126)"
    assert row["Ray Train s [95 %] (steps)"] == "not reached (0/1)"
    assert row["vs baseline"] == "1.30x (apart)" and row["projected vs baseline"] == "1.26x"
    assert row["result (commit)"] == "new.json at abc1234"
    # the bound is the overlapped one (max of compute and NIC), recomputed from the parts: 45 / 30 ms,
    # not the stored ratio (older files stored the one to compute plus NIC)
    assert row["vs lower bound"] == "1.50x"
    assert notes == ["toy: old.json (run of 2026-11-01 10:00:00) superseded by new.json"]


def test_a_baseline_that_won_and_a_projection_alone(tmp_path):
    emulated = {"models": {"toy": _entry("2026-11-03 10:00:00", measured=False, origin="ps", lossy="lossless")}}
    row = dict(zip(H.HEADERS, H.rows({"emulated.json": emulated})[0][0]))
    assert row["tuned"] == "= ps" and row["tuned s [95 %] (steps)"] == "-" and row["vs baseline"] == "-"
    assert row["projected vs baseline"] == "1.26x"


def test_the_command_prints_markdown_and_refuses_what_is_not_a_result(tmp_path, capsys):
    good, bad = tmp_path / "r.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"models": {"toy": _entry("2026-11-02 10:00:00")}}))
    bad.write_text(json.dumps([1, 2]))
    assert H.main([str(good)]) == 0
    assert capsys.readouterr().out.startswith("| model | tuned |")
    assert H.main([str(good), str(bad)]) == 2
    assert "not a tune_vs_baselines result" in capsys.readouterr().err


def test_brief_keeps_the_readme_columns(tmp_path, capsys):
    good = tmp_path / "r.json"
    good.write_text(json.dumps({"models": {"toy": _entry("2026-11-02 10:00:00")}}))
    assert H.main(["--brief", str(good)]) == 0
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert header == "| " + " | ".join(H.BRIEF) + " |"
    assert row.split(" | ")[3] == "1.30x (apart)"


def test_brief_shows_the_projected_speed_up_where_no_time_to_target_was_measured(tmp_path, capsys):
    emulated = tmp_path / "e.json"
    emulated.write_text(json.dumps({"models": {"toy": _entry("2026-11-02 10:00:00", measured=False)}}))
    assert H.main(["--brief", str(emulated)]) == 0
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert header == "| " + " | ".join(H.BRIEF_PROJECTED) + " |" and row.split(" | ")[3] == "1.26x"


def test_ray_train_figures_of_a_run_with_a_faulty_peer_are_marked_and_the_fault_named():
    faulty = {"meta": {"peer_fault": "half the global batch"}, "models": {"toy": _entry("2026-11-02 10:00:00")}}
    fine = {"models": {"other": dict(_entry("2026-11-03 10:00:00"), model="other-small")}}
    table, notes = H.rows({"faulty.json": faulty, "fine.json": fine})
    rows = {r[0]: dict(zip(H.HEADERS, r)) for r in table}
    assert rows["toy-small (emb)"]["vs Ray Train"] == "- †"
    assert rows["toy-small (emb)"]["Ray Train s [95 %] (steps)"] == "not reached (0/1) †"
    assert rows["other-small (emb)"]["vs Ray Train"] == "-"
    assert notes == ["† Ray Train in faulty.json: half the global batch"]


def test_every_older_run_names_the_run_the_table_shows():
    runs = {f"{d}.json": {"models": {"toy": _entry(f"2026-11-0{d} 10:00:00")}} for d in (1, 2, 3)}
    table, notes = H.rows(runs)
    assert dict(zip(H.HEADERS, table[0]))["result (commit)"] == "3.json at abc1234"
    assert notes == ["toy: 1.json (run of 2026-11-01 10:00:00) superseded by 3.json",
                     "toy: 2.json (run of 2026-11-02 10:00:00) superseded by 3.json"]


def test_the_lossy_strategy_turned_down_is_shown_against_the_recommendation():
    entry = _entry("2026-11-02 10:00:00")
    runs = [{"reached": True, "steps_to_target": s, "time_to_target_s": 2.0} for s in (160, 166)]
    entry["time_to_target"]["rejected_lossy"] = {"statistical_efficiency": 0.9157, "speedup_vs_tuned": 2.6}
    entry["time_to_target"]["contenders"]["rejected_lossy"] = {"runs": runs, "time_to_target_s": 2.0, "reached": "2/2"}
    never = _entry("2026-11-02 10:00:00")
    never["time_to_target"]["rejected_lossy"] = {"statistical_efficiency": 0.4, "speedup_vs_tuned": None}
    never["time_to_target"]["contenders"]["rejected_lossy"] = {"runs": [{"reached": False}], "time_to_target_s": None,
                                                             "reached": "0/1"}
    col = H.HEADERS.index("turned down (lossy) vs tuned")
    shown = [H.rows({f"{i}.json": {"models": {f"m{i}": e}}})[0][0][col] for i, e in enumerate((entry, never, _entry("x")))]
    assert shown == ["2.60x sooner (E 0.92, 160-166 steps)", "not reached (0/1), E 0.40", "-"]
    assert "turned down (lossy) vs tuned" not in H.BRIEF


def _committed(pattern: str) -> dict[str, dict]:
    results = {}
    for path in sorted(glob.glob(os.path.join(REPO, "benchmarks", "results", pattern))):
        with open(path) as f:
            results[path] = json.load(f)
    return results


def test_the_readme_and_benchmarks_page_tables_are_the_ones_the_committed_results_build():
    """A re-measured model, a new result file or a change to how the table is built must reach the
    pages: each row (and each note on a superseded run) the committed files build is on the page."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(REPO, "docs", "benchmarks.md")) as f:
        page = f.read()
    for pattern in ("headline_2x200mbit_real_*.json", "headline_3x100mbit_emulated*.json"):
        results = _committed(pattern)
        assert results, f"no committed {pattern}"
        brief = H.markdown(results, H.brief_columns(results)).split("\n\n")[0].splitlines()[2:]
        full = H.markdown(results).splitlines()
        assert brief and all(row in readme for row in brief), \
            f"the README's table is not what `headline_table.py --brief {pattern}` prints"
        missing = [line for line in full if line and line not in page]
        assert not missing, f"docs/benchmarks.md lacks, from `headline_table.py {pattern}`: {missing[:2]}"
