"""``autosync tune`` (the main job) and ``autosync report``."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from autosync.formatting import headline, table
from autosync.cli.paths import check_output_dir, check_output_file
from autosync.cli.raylog import ray_output_to_log
from autosync.cli.runtime import add_compute_flags, add_precision_flags, compute_settings, precision_settings
from autosync.sources import CLUSTER_FORMS, TRAINABLE_FORMS
from strategy_space import dumps
from strategy_space.errors import ConfigError
from tuner.records.goodput import DEFAULT_MIN_EFFICIENCY, DEFAULT_PROBE_STEPS, DEFAULT_QUALITY, QUALITIES, counted
from tuner.records.outcome import not_recommended_reason

DEFAULT_MODEL = "zoo:ncf"
DEFAULT_TRIALS = 12


PROBE_NOTE_CHARS = 400   # a failed probe's reason: the first line, which says what died and why


class Progress:
    """One updating line on a terminal, one line per trial otherwise (both on stderr)."""

    def __init__(self, total_hint: int, stream=None):
        self.total_hint = total_hint
        self.stream = stream or sys.stderr   # looked up now, not at import (it may be replaced since)
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()

    def __call__(self, trial, outcome) -> None:
        n = len(outcome.trials)
        search = len(outcome.search_trials)
        best = outcome.best
        best_txt = f"best {best.median * 1e3:.1f} ms ({best.origin})" if best else "best -"
        last = f"{trial.origin} {trial.median * 1e3:.1f} ms" if trial.ok else f"{trial.origin} {trial.status}"
        if trial.role == "search" and "search_round" in trial.meta:   # where the search looked (trust region)
            radius = trial.meta.get("trust_radius")
            last += (f" (round {trial.meta['search_round']}, "
                     + (f"within {radius} changes of the best)" if radius is not None else "whole space)"))
        width = 20
        filled = int(width * min(1.0, search / max(1, self.total_hint)))
        bar = "#" * filled + "-" * (width - filled)
        line = (f"[{bar}] search {search}/{self.total_hint}, {n} trials, {time.monotonic() - self.t0:.0f} s  "
                f"{best_txt}  last: {last}")
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def probed(self, trial, efficiency) -> None:
        """One line per statistical-efficiency probe."""
        text = (f"probe: {trial.origin} efficiency {efficiency.value:.2f} [{efficiency.low:.2f}, {efficiency.high:.2f}]"
                if efficiency.source != "failed" else f"probe: {trial.origin} failed: {_first_line(efficiency.note)}")
        self.stream.write(("\r" + text.ljust(150) + "\n") if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _first_line(text: str, limit: int = PROBE_NOTE_CHARS) -> str:
    """The first line of ``text``, cut past ``limit`` characters (a probe's failure says why in it)."""
    line = (text or "").strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit - 4] + " ..."


def _efficiency_cell(result, t) -> str:
    e = result.outcome.efficiency_of(t.strategy)
    if e is None:
        return "not measured"
    return "1 (lossless)" if not e.probed else f"{e.value:.2f} [{e.low:.2f}, {e.high:.2f}]"


def result_table(result) -> str:
    """The recommendation and every baseline: step times, statistical efficiency and, unless the
    quality is ``step``, seconds per step of lossless progress (what the ratio compares)."""
    best, figure = result.best_trial, result.outcome.figure
    goodput = result.quality != "step"
    head = ["strategy", "status", "median step", "p90 step", "efficiency"] + (["per lossless step"] if goodput else [])
    head.append("best is faster by" + (" (goodput)" if goodput else " (step time only)"))

    def row(name, t):
        if not t.ok:
            return (name, t.status, "-", "-", "-") + (("-",) if goodput else ()) + (headline(t.error)[:60],)
        cells = (name, "ok", f"{t.median * 1e3:.1f} ms", f"{t.p90 * 1e3:.1f} ms", _efficiency_cell(result, t))
        if goodput:
            cells += (f"{figure(t) * 1e3:.1f} ms",)
        return cells + (f"{figure(t) / figure(best):.2f}x",)

    rows = [row("best: " + best.origin, best)]
    rows += [row(name, t) for name, t in sorted(result.baselines.items(),
                                                   key=lambda kv: figure(kv[1]) if kv[1].ok else float("inf"))]
    return table(head, rows, right=tuple(range(2, len(head))))


def cmd_tune(args) -> int:
    from autosync.api import default_store_path, run_dir, tune
    from tuner.search.baseline_tuner import PINNED_SUFFIX

    if args.trials < 0:
        raise ConfigError(f"--trials must be >= 0, got {args.trials}")
    if args.confirm < 0:
        raise ConfigError(f"--confirm must be >= 0, got {args.confirm}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise ConfigError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if not 0 < args.timeout < float("inf"):
        raise ConfigError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    measure = precision_settings(args)
    if args.no_report and args.report:
        raise ConfigError("--no-report and --report DIR contradict each other; give one")
    # where the results go is checked before the work, not after a tuning run
    check_output_file(args.out, "--out")
    check_output_dir(args.report, "--report")
    check_output_file(args.store, "--store")
    store = args.store or default_store_path()
    if args.out is None or (args.report is None and not args.no_report):
        check_output_dir(Path(os.path.abspath(store)).parent / "runs", "the run's folder beside --store")
    with ray_output_to_log("tune") as log:
        progress = Progress(args.trials, stream=log.terminal)
        try:
            result = tune(args.model, args.cluster, trials=args.trials, time_budget_s=args.time_budget,
                          store=args.store, constraints=args.constraints, resume=args.resume, steps=args.steps,
                          warmup=args.warmup, warm_start=args.warm_start, confirm=args.confirm, on_trial=progress,
                          quality=args.quality, probe_steps=args.probe_steps, on_probe=progress.probed,
                          min_efficiency=args.min_efficiency, probe_model=args.probe_model,
                          trial_timeout_s=args.timeout, **measure, **compute_settings(args))
        finally:
            progress.close()
    folder = run_dir(result.store_path, result.model.name, result.cluster.name, result.outcome.run_id)
    out = args.out or str(folder / "best_strategy.yaml")
    report_dir = _write_results(result, out, None if args.no_report else args.report or folder / "report")
    summary = result.summary() | {"out": out, "report": str(report_dir) if report_dir else None}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"\n{result.model.name} on {result.cluster.name}: {summary['total_trials']} trials "
          f"({summary['baseline_trials']} baselines, {summary['trials']} search, {summary['confirm_trials']} "
          f"re-measurements, {summary['failed_trials']} failed), "
          f"stopped: {summary['stop_reason']}")
    if summary["stop_note"]:
        print(f"stopped early: {summary['stop_note']}")
    print(result_table(result))
    print(quality_line(summary))
    if any(name.endswith(PINNED_SUFFIX) for name in result.baselines):
        print(f"(NAME{PINNED_SUFFIX}: that builder's strategy changed to keep --constraints; the change was measured)")
    speed = summary["speedup_over_best_baseline"]
    if speed is not None:
        measure_word = "in step time only" if summary["quality"] == "step" else "in goodput"
        n = summary["trials_to_within_5pct"]
        print(f"\nbest strategy ({result.best_trial.origin}) is {speed:.2f}x the best baseline "
              f"({summary['best_baseline']}) {measure_word}; within 5 % of it after {counted(n, 'trial')}")
    if summary["fastest_not_significant"]:
        print(not_recommended_line(summary))
    print(f"best strategy written to {out}")
    if report_dir:
        print(f"report written to {report_dir / 'index.html'}")
    print(f"trials stored in {result.store_path} (run {result.outcome.run_id}; --resume continues it)")
    return 0


def _write_results(result, out: str, report: Path | str | None) -> Path | None:
    """Write the best strategy to ``out`` and the run's report into ``report`` (None: none).

    Raises:
        ConfigError: a write the file system refuses (a full disk, a read-only folder); the best
            strategy is then printed to stderr, so that a run of hours does not end with nothing.
    """
    run = result.outcome.run_id
    try:
        result.save(out)
    except OSError as e:
        print(f"# the best strategy of run {run}, which could not be written to {out}:\n{dumps(result.best_strategy)}",
              file=sys.stderr)
        raise ConfigError(f"cannot write the best strategy to {out} ({e.strerror or e}); it is printed above. The "
                          f"run's trials are in the store {result.store_path}: once there is room, `autosync report "
                          f"--store {result.store_path} --run {run}` writes its report") from None
    if report is None:
        return None
    from autosync.report import write_report

    try:
        return write_report(result.store_path, report, run_id=run)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {report} ({e.strerror or e}); the best strategy was written "
                          f"to {out}. Once there is room, `autosync report --store {result.store_path} --run {run} "
                          f"--out {report}` writes it") from None


def quality_line(summary: dict) -> str:
    """What the ranking rests on: goodput and the recommendation's efficiency, or step time only."""
    if summary["quality"] == "step":
        return ("ranked by step time only (--quality step): what the lossy parts of a strategy "
                f"({summary['lossy_parts']}) cost in convergence was not measured")
    e, (low, high) = summary["statistical_efficiency"], summary["statistical_efficiency_interval"]
    how = (f"probed, {low:.2f} to {high:.2f}" if summary["efficiency_probed"] else "lossless, not probed")
    line = (f"ranked by goodput (step time / statistical efficiency, --quality {summary['quality']}); the "
            f"recommendation's efficiency is {e:.2f} ({how}); {counted(summary['probes'], 'probe')} took "
            f"{summary['probe_seconds']:.0f} s")
    notes = [n for n in (summary["lossy_note"], summary.get("search_note"), summary.get("efficiency_note")) if n]
    notes += [f"assumed by the cost model that chose the candidates: {a}" for a in summary.get("assumed", [])]
    return line + "".join(f"\n{n}" for n in notes)


def not_recommended_line(summary: dict) -> str:
    """Why the fastest strategy measured is not the recommendation (``fastest_not_significant``)."""
    f = summary["fastest_not_significant"]
    return (f"the fastest strategy measured ({f['origin']}, {f['step_time_s'] * 1e3:.1f} ms) is not recommended: "
            + not_recommended_reason(f))


def cmd_report(args) -> int:
    from autosync.api import default_store_path
    from autosync.report import write_report

    check_output_dir(args.out, "--out")
    if args.store is not None and not args.store.strip():   # (not read as "not given": the default store)
        raise ConfigError("--store '': give the path of a trial store file, or leave --store out for the default")
    out = write_report(args.store or default_store_path(), args.out, run_id=args.run)
    print(f"report written to {out / 'index.html'}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("tune", help="find the fastest strategy by measurement (the main job)")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="M",
                   help=f"trainable model: {TRAINABLE_FORMS} (default {DEFAULT_MODEL}); a model-spec YAML holds no "
                        f"code to train, so it is tuned only with --compute emulated (synthetic gradients)")
    p.add_argument("--cluster", default="local", metavar="C", help=f"cluster: {CLUSTER_FORMS} (default local)")
    p.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help=f"search trials, on top of one per baseline builder (default {DEFAULT_TRIALS})")
    p.add_argument("--time-budget", type=float, metavar="S", help="stop proposing S seconds after the run started (start-up counted; "
                        "the baselines always run)")
    p.add_argument("--out", help="where to write the best strategy (YAML; default: best_strategy.yaml in the run's "
                                 "folder beside the store, runs/MODEL-CLUSTER-RUN/; the path is printed)")
    p.add_argument("--store", help="trial store (SQLite; default: ~/.cache/autosync/trials.db, or under "
                                   "$XDG_CACHE_HOME); reused and grown")
    p.add_argument("--warm-start", default="builtin", metavar="W",
                   help="trials the predictor starts from besides --store: builtin (measured by AutoSync on its "
                        "testbed; default), none, or a trial store file")
    p.add_argument("--constraints", metavar="FILE", help="YAML of pinned decisions the search must keep")
    p.add_argument("--report", metavar="DIR", help="where to write the HTML report with plots (default: report/ in "
                                                   "the run's folder)")
    p.add_argument("--no-report", action="store_true", help="write no report (`autosync report` makes one later)")
    p.add_argument("--resume", action="store_true", help="continue the latest run of this model and cluster")
    p.add_argument("--confirm", type=int, default=2, metavar="N",
                   help="re-measure the best strategy and the best baseline until each has 1+N measurements (default 2)")
    p.add_argument("--quality", choices=QUALITIES, default=DEFAULT_QUALITY,
                   help="what the tuning ranks by: goodput (default): step time / statistical efficiency, where a "
                        "strategy with a lossy part (a compressor) is kept only with a measured efficiency (a probe "
                        "trains it and its lossless twin); exact: no lossy part is proposed; step: step time alone "
                        "(lossy parts unmeasured)")
    p.add_argument("--min-efficiency", type=float, default=DEFAULT_MIN_EFFICIENCY, metavar="E",
                   help=f"under goodput, the least measured statistical efficiency a lossy strategy needs to be "
                        f"recommended (default {DEFAULT_MIN_EFFICIENCY}; a probe sees only the first steps)")
    p.add_argument("--probe-steps", type=int, default=DEFAULT_PROBE_STEPS, metavar="K",
                   help=f"steps each efficiency probe trains (default {DEFAULT_PROBE_STEPS})")
    p.add_argument("--probe-model", metavar="MODEL",
                   help="with --compute emulated: a trainable model with the tuned model's variable names (zoo:NAME "
                        "or script.py:function) whose efficiencies stand in for its own, e.g. zoo:lm1b for "
                        "a full-size lm1b spec YAML, which has no code to train")
    p.add_argument("--steps", type=int, default=10, help="timed steps per trial (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per trial (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="limit per trial in seconds (default 300); a trial past it is recorded as timed out and "
                        "tuning goes on; reading the model in this process may take as long (or "
                        "AUTOSYNC_MODEL_TIMEOUT seconds, where set)")
    add_precision_flags(p)
    add_compute_flags(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the table")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("report", help="HTML report (tuning curve, predicted vs measured, baselines) of a store")
    p.add_argument("--store", help="trial store (SQLite; default: the one `autosync tune` uses, "
                                   "~/.cache/autosync/trials.db)")
    p.add_argument("--out", help="output folder (default: report/ in the run's folder beside the store, where "
                                 "`autosync tune` writes it)")
    p.add_argument("--run", help="run id (default: the latest run in the store)")
    p.set_defaults(func=cmd_report)
