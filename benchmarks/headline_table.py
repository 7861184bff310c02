"""The headline table (time to a target loss) of the README and docs/benchmarks.md, built from the
result files of ``tune_vs_baselines.py --time-to-target``.

    python benchmarks/headline_table.py benchmarks/results/headline_2x200mbit_real_*.json
    python benchmarks/headline_table.py --brief benchmarks/results/headline_2x200mbit_real_*.json   # README

One row per model. Where several files hold the same model, the entry of the newest run is shown
and the others are named under the table (runs are never merged into one row). A file whose
``meta`` names a ``peer_fault`` (a fault of the Ray Train peer found after the run) has its Ray
Train figures marked with a dagger and the fault written under the table. Measured figures
come from ``time_to_target`` (real compute); ``time_to_target_projected`` (steps over the probed
efficiency times the confirmed step time) is shown beside them, and alone for emulated compute.
Where the run also raced the lossy strategy the goodput rule turned down (its probed efficiency
under ``min_efficiency``), the full table shows it: its time to target against the
recommendation's, its probed efficiency and its steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _s(x) -> str:
    return "-" if x is None else f"{x:.3g}" if x < 10 else f"{x:.1f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _steps(runs: list) -> str:
    got = sorted(r["steps_to_target"] for r in runs if r.get("reached"))
    if not got:
        return "not reached"
    return str(got[0]) if got[0] == got[-1] else f"{got[0]}-{got[-1]}"


def _contender(c: dict | None) -> str:
    """``seconds [95 % interval] (steps)`` of one measured contender."""
    if not c:
        return "-"
    if c.get("time_to_target_s") is None:
        return f"not reached ({c.get('reached', '?')})"
    ci = c.get("time_to_target_ci95_s")
    interval = f" [{_s(ci[0])}-{_s(ci[1])}]" if ci else ""
    return f"{_s(c['time_to_target_s'])}{interval} ({_steps(c['runs'])})"


def _tuned_name(r: dict) -> str:
    """The tuned strategy in a few words: ``= <baseline>`` when a baseline won, else its lossy
    parts (asynchrony, staleness, compression) or that it is lossless."""
    t = r["tune"]
    if t["best_origin"] == t["best_baseline"]:
        return f"= {t['best_baseline']}"
    lossy = t.get("lossy_parts")
    return lossy if lossy and lossy != "lossless" else f"{t['best_origin']} (lossless)"


def vs_lower_bound(r: dict) -> float | None:
    """The tuned step (confirmed median) over its analytic lower bound, the overlapped one (compute
    and the busiest NIC at once). Computed here from the recorded parts, not read from
    ``vs_lower_bound``: files before 2026-11-26 20:00 stored the ratio to compute plus NIC time,
    which steps that overlap communication beat."""
    bound = (r.get("lower_bound") or {}).get("overlapped_s")
    step = ((r.get("confirm") or {}).get("tuned") or {}).get("median_s")
    return step / bound if step and bound else None


def _turned_down(m: dict) -> str:
    """``<speed-up> sooner (E <efficiency>, <steps> steps)`` of the raced lossy strategy the goodput
    rule turned down, against the recommendation; ``-`` where none raced."""
    rejected, c = m.get("rejected_lossy"), (m.get("contenders") or {}).get("rejected_lossy")
    if not rejected or not c:
        return "-"
    if c.get("time_to_target_s") is None:
        return f"not reached ({c.get('reached', '?')}), E {rejected['statistical_efficiency']:.2f}"
    return (f"{_x(rejected.get('speedup_vs_tuned'))} sooner (E {rejected['statistical_efficiency']:.2f}, "
            f"{_steps(c['runs'])} steps)")


def rows(results: dict[str, dict]) -> tuple[list[list[str]], list[str]]:
    """``results``: file path -> loaded result. Returns (table rows, notes on superseded entries)."""
    entries: dict[str, list[tuple[str, dict]]] = {}
    for path, res in results.items():
        for name, r in res["models"].items():
            if "time_to_target" in r or "time_to_target_projected" in r:
                entries.setdefault(name, []).append((path, r))
    newest = {name: max(runs, key=lambda run: run[1]["run_started"]) for name, runs in entries.items()}
    # every older entry is named with the one the table shows (not the next newer one)
    notes = [f"{name}: {os.path.basename(path)} (run of {r['run_started']}) superseded by "
             f"{os.path.basename(newest[name][0])}"
             for name, runs in entries.items() for path, r in sorted(runs, key=lambda run: run[1]["run_started"])
             if r is not newest[name][1]]
    out = []
    faults = {}
    for name, (path, r) in newest.items():
        fault = (results[path].get("meta") or {}).get("peer_fault")
        mark = ""
        if fault:
            files = faults.setdefault(fault, [])
            if os.path.basename(path) not in files:
                files.append(os.path.basename(path))
            mark = " " + "†" * (list(faults).index(fault) + 1)
        m = r.get("time_to_target") or {}
        c = m.get("contenders", {})
        proj = r.get("time_to_target_projected") or {}
        same = m.get("tuned_is_best_baseline") or r["tune"]["best_origin"] == r["tune"]["best_baseline"]
        e = r.get("statistical_efficiency")
        base_name = m.get("best_baseline_name") or r["tune"]["best_baseline"]
        overlap = m.get("intervals_overlap")
        vs_base = _x(m.get("speedup_vs_best_baseline"))
        if overlap is not None:
            vs_base += " (overlap)" if overlap else " (apart)"
        out.append([
            r.get("model", name) + (" (emb)" if r.get("embedding_heavy") else ""), _tuned_name(r), base_name,
            _contender(c.get("tuned")) if m else "-",
            "same" if same and m else _contender(c.get("best_baseline")) if m else "-",
            (_contender(c.get("ray_train")) + mark) if m else "-",
            vs_base if m else "-", (_x(m.get("speedup_vs_peer")) + mark) if m else "-",
            _x(proj.get("speedup_vs_best_baseline")), "-" if e is None else f"{e:.2f}",
            _x(r.get("speedup_vs_best_baseline")), _x(vs_lower_bound(r)), _turned_down(m),
            f"{os.path.basename(path)} at {r['commit']}"])
    notes += [f"{'†' * (i + 1)} Ray Train in {', '.join(files)}: {fault}" for i, (fault, files) in enumerate(faults.items())]
    return out, notes


HEADERS = ["model", "tuned", "best baseline", "tuned s [95 %] (steps)", "baseline s [95 %] (steps)",
           "Ray Train s [95 %] (steps)", "vs baseline", "vs Ray Train", "projected vs baseline", "E",
           "step vs baseline", "vs lower bound", "turned down (lossy) vs tuned", "result (commit)"]


BRIEF = ["model", "tuned", "best baseline", "vs baseline", "vs Ray Train", "E", "vs lower bound", "result (commit)"]
# emulated compute measures no time to target (it is projected from step times and E) and has no peer
BRIEF_PROJECTED = ["model", "tuned", "best baseline", "projected vs baseline", "E", "vs lower bound", "result (commit)"]


def brief_columns(results: dict[str, dict]) -> list[str]:
    """The README's columns: measured speed-ups where any entry measured its time to target, else
    the projected one."""
    measured = any("time_to_target" in r for res in results.values() for r in res["models"].values())
    return BRIEF if measured else BRIEF_PROJECTED


def markdown(results: dict[str, dict], columns: list[str] = HEADERS) -> str:
    table, notes = rows(results)
    keep = [HEADERS.index(c) for c in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in table]
    lines += [f"\n{n}" for n in notes]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="result JSONs of tune_vs_baselines.py --time-to-target")
    p.add_argument("--brief", action="store_true", help="the README's columns: speed-ups (projected ones where no time "
                   "to target was measured, as with emulated compute), efficiency, bound, source")
    args = p.parse_args(argv)
    results = {}
    for path in args.files:
        try:
            with open(path) as f:
                results[path] = json.load(f)
        except (OSError, ValueError) as e:
            print(f"cannot read {path}: {e}", file=sys.stderr)
            return 2
        if not isinstance(results[path], dict) or not isinstance(results[path].get("models"), dict):
            print(f"{path} is not a tune_vs_baselines result (no 'models')", file=sys.stderr)
            return 2
    print(markdown(results, brief_columns(results) if args.brief else HEADERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
