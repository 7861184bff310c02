"""The tuning report: an HTML page with the tuning curve, predicted vs measured step times, the best
strategy against every baseline, loss against wall-clock time (from the run's statistical-efficiency
probes), and the best strategy's table; the plots are also PNG files.

It reads everything from a TrialStore, so it can be made for any run, at any time.
"""
from __future__ import annotations

import html
import os
from pathlib import Path

from strategy_space.errors import ConfigError
from tuner.records.goodput import is_lossless, lossy_parts, probe_model_key
from tuner.records.outcome import TuneOutcome, not_recommended_reason
from tuner.records.store import TrialStore, open_existing_store


def _run_trials(store: TrialStore, run_id: str | None):
    trials = [t for t in store.trials() if t.run_id]
    if not trials:
        raise ConfigError(f"{store.path if hasattr(store, 'path') else 'the store'} holds no tuning run; "
                          f"run `autosync tune --store FILE` first")
    if run_id is None:
        run_id = max(trials, key=lambda t: t.finished_at).run_id
    chosen = sorted((t for t in trials if t.run_id == run_id), key=lambda t: t.finished_at)
    if not chosen:
        runs = sorted({t.run_id for t in trials})
        raise ConfigError(f"no run {run_id!r} in the store; runs: {', '.join(runs)}")
    return run_id, chosen


def run_probes(probes: list, trials: list) -> list:
    """The stored probes of a model that speak for one run (``trials``): those of the training
    digest (``autosync.models.training_key``) its trials carry (``Prober.training_known``), else
    of the probes it measured itself, started between its first trial's start and its last
    trial's end; all of them where it names none, several digests, or probes stored before
    digests were."""
    start, end = min(t.started_at for t in trials), max(t.finished_at for t in trials)
    own = ({t.meta["training"] for t in trials if t.meta.get("training")}
           or {p.meta.get("training") for p in probes if start <= p.started_at <= end})
    if len(own) != 1 or None in own:
        return probes
    return [p for p in probes if p.meta.get("training") in own]


def _efficiencies(outcome: TuneOutcome, probes: list) -> dict:
    """Lossy-parts key -> the latest probe of it (of this model); fills ``outcome.efficiency`` for
    the run's lossy strategies that have one."""
    latest = {}
    for p in probes:   # oldest first: the latest wins
        latest[p.lossy_key] = p
    for t in outcome.ok:
        if not is_lossless(t.strategy):
            found = latest.get(lossy_parts(t.strategy).key)
            if found is not None:
                outcome.efficiency[t.strategy.fingerprint] = found.efficiency
    return latest


def _loss_plot(outcome: TuneOutcome, probes: dict, out: Path, plt) -> str | None:
    """Loss against wall-clock time: the recommendation and the best baseline (the probes' curves
    at each strategy's measured step time; a lossless strategy trains as the lossless curve), and
    the run's other probed strategies. None when no probe measured a curve."""
    best, base = outcome.best, outcome.best_baseline
    if best is None or not probes:
        return None
    lossless = next(iter(probes.values())).twin_loss   # every probe's twin trains as one process
    fig, ax = plt.subplots(figsize=(7, 4))

    def draw(trial, label, **style):
        p = probes.get(lossy_parts(trial.strategy).key)
        loss = lossless if is_lossless(trial.strategy) else (p.candidate_loss if p else None)
        if loss:
            ax.plot([(i + 1) * trial.median for i in range(len(loss))], loss, label=label, **style)

    for t in outcome.measured().values():
        if t is not best and not is_lossless(t.strategy) and lossy_parts(t.strategy).key in probes:
            draw(t, None, color="tab:gray", alpha=0.35, linewidth=0.8)
    if base is not None:
        draw(base, f"best baseline ({base.origin})", color="tab:gray", linewidth=1.6)
    draw(best, f"recommendation ({best.origin})", color="tab:green", linewidth=1.6)
    ax.set_xlabel("wall-clock time (s): steps x measured step time")
    ax.set_ylabel("training loss (probe)")
    ax.set_title("Loss against wall-clock time (grey: other probed strategies)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_vs_time.png", dpi=110)
    plt.close(fig)
    return "loss_vs_time.png"


def _plots(outcome: TuneOutcome, out: Path, probes: dict | None = None) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = outcome.trials
    files = {}
    ok = [(i, t) for i, t in enumerate(trials, 1) if t.ok]
    # tuning curve
    fig, ax = plt.subplots(figsize=(7, 4))
    best, curve = float("inf"), []
    for i, t in enumerate(trials, 1):
        if t.ok:
            best = min(best, t.median)
        curve.append(best * 1e3)
    ax.step(range(1, len(trials) + 1), curve, where="post", label="best single measurement so far")
    for role, color in (("baseline", "tab:gray"), ("search", "tab:blue"), ("confirm", "tab:orange")):
        pts = [(i, t.median * 1e3) for i, t in ok if t.role == role]
        if pts:
            ax.scatter(*zip(*pts), s=14, color=color, label=f"{role} trials")
    ax.set_xlabel("trial")
    ax.set_ylabel("median step time (ms)")
    ax.set_title("Tuning curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tuning_curve.png", dpi=110)
    plt.close(fig)
    files["tuning curve"] = "tuning_curve.png"
    # predicted vs measured
    pts = [(t.predicted_s * 1e3, t.median * 1e3) for _, t in ok if t.predicted_s]
    if pts:
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(*zip(*pts), s=16)
        lo, hi = min(min(p) for p in pts) * 0.9, max(max(p) for p in pts) * 1.1
        ax.plot([lo, hi], [lo, hi], color="gray", linestyle="--", label="exact")
        ax.set_xlabel("predicted step time (ms)")
        ax.set_ylabel("measured step time (ms)")
        ax.set_title("Predicted vs measured (search trials)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "predicted_vs_measured.png", dpi=110)
        plt.close(fig)
        files["predicted vs measured"] = "predicted_vs_measured.png"
    # best vs baselines
    base = [t for t in outcome.baselines.values() if t.ok]
    best_t = outcome.best
    if best_t is not None and base:
        bars = [(f"best ({best_t.origin})", best_t.median * 1e3)] + sorted(
            {(t.origin, t.median * 1e3) for t in base}, key=lambda x: x[1])
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(bars) + 1.2))
        ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1],
                color=["tab:gray"] * (len(bars) - 1) + ["tab:green"])
        ax.set_xlabel("median step time (ms)")
        ax.set_title("Best strategy vs baselines")
        fig.tight_layout()
        fig.savefig(out / "best_vs_baselines.png", dpi=110)
        plt.close(fig)
        files["best vs baselines"] = "best_vs_baselines.png"
    loss = _loss_plot(outcome, probes or {}, out, plt)
    if loss:
        files["loss against wall-clock time"] = loss
    return files


def _html_table(headers, rows) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(store_path: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 run_id: str | None = None) -> Path:
    """Write ``index.html`` and PNG plots of a tuning run into ``out_dir``; return the folder.

    Args:
        store_path: the trial store the run wrote.
        out_dir: the folder; None: ``report/`` in the run's folder beside the store
            (``autosync.api.run_dir``), where ``autosync tune`` writes it.
        run_id: the run; None: the latest run in the store.

    Raises:
        ConfigError: missing store, or no such run in it.
    """
    from autosync.formatting import describe_strategy, headline

    with open_existing_store(store_path) as store:
        run_id, trials = _run_trials(store, run_id)
        model = store.model(trials[0].model_fingerprint)
        cluster = store.cluster(trials[0].cluster_fingerprint)
        stored_probes = run_probes(store.probes(probe_model_key(model)), trials) if model is not None else []
    if out_dir is None:
        from autosync.api import run_dir

        out_dir = run_dir(store_path, model.name if model else "model", cluster.name if cluster else "cluster",
                          run_id) / "report"
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    # re-measurements pooled per strategy, ranked as the run ranked them (runs before goodput: step)
    quality = trials[0].meta.get("quality", "step")
    outcome = TuneOutcome(run_id, list(trials), quality=quality,
                          **({"min_efficiency": trials[0].meta["min_efficiency"]} if "min_efficiency" in trials[0].meta else {}))
    probes = _efficiencies(outcome, stored_probes)
    files = _plots(outcome, out, probes)
    best = outcome.best
    rows = [(i, t.role, t.origin, t.status, f"{t.median * 1e3:.1f}" if t.ok else "-",
             f"{t.predicted_s * 1e3:.1f}" if t.predicted_s else "-",
             headline(t.error)[:80]) for i, t in enumerate(trials, 1)]
    parts = [f"<h1>AutoSync tuning report</h1><p>model <b>{html.escape(model.name if model else '?')}</b> on cluster "
             f"<b>{html.escape(cluster.name if cluster else '?')}</b>{_compute_note(cluster)}, run {html.escape(run_id)}, "
             f"{len(trials)} trials.</p>"]
    if best is not None:
        bb = outcome.best_baseline
        f = outcome.figure
        by = "in step time only" if quality == "step" else "in goodput (step time / statistical efficiency)"
        parts.append(f"<p>Best: <b>{html.escape(best.origin)}</b>, median {best.median * 1e3:.1f} ms per step"
                     + (f", {f(bb) / f(best):.2f}x the best baseline ({html.escape(bb.origin)}, "
                        f"{bb.median * 1e3:.1f} ms) {by}" if bb else "") + ".</p>")
        parts.append(f"<p>{_efficiency_note(outcome, best)}</p>")
        fastest = outcome.fastest
        if fastest.strategy.fingerprint != best.strategy.fingerprint:
            parts.append(f"<p>The fastest strategy measured ({html.escape(fastest.origin)}, "
                         f"{fastest.median * 1e3:.1f} ms) is not recommended: "
                         f"{html.escape(not_recommended_reason(outcome.not_recommended(fastest)))}.</p>")
    for title, name in files.items():
        parts.append(f"<h2>{html.escape(title.capitalize())}</h2><img src='{name}' alt='{html.escape(title)}'>")
    if best is not None and model is not None:
        srows, _, _ = describe_strategy(best.strategy, model)
        parts.append("<h2>Best strategy</h2>" + _html_table(
            ["variable", "size", "grad", "sync", "shards", "destination/group", "compressor", "ps options"], srows))
    parts.append("<h2>All trials</h2>" + _html_table(
        ["#", "role", "origin", "status", "median ms", "predicted ms", "error"], rows))
    style = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-collapse:collapse;"
             "font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}img{max-width:100%}")
    (out / "index.html").write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>AutoSync report"
                                    f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>")
    return out


def _efficiency_note(outcome: TuneOutcome, best) -> str:
    """The recommendation's statistical efficiency and what it rests on, as a sentence."""
    parts = lossy_parts(best.strategy)
    if outcome.quality == "step":
        return (f"Ranked by step time only (quality step): what the recommendation's lossy parts "
                f"({html.escape(parts.describe())}) cost in convergence was not measured.")
    e = outcome.efficiency_of(best.strategy)
    if parts.lossless:
        return "The recommendation is lossless: statistical efficiency 1 (it trains as one process; not probed)."
    if e is None:
        return f"The recommendation has lossy parts ({html.escape(parts.describe())}) whose probe is not in the store."
    return (f"The recommendation has lossy parts ({html.escape(parts.describe())}): statistical efficiency "
            f"{e.value:.2f} (95 % interval {e.low:.2f} to {e.high:.2f}), probed over {e.steps} steps."
            + (f" {html.escape(e.note)}" if e.note else ""))


def _compute_note(cluster) -> str:
    """How the workers computed: emulated compute (and its dilation) is said, real is the default."""
    if cluster is None or getattr(cluster, "compute", "real") == "real":
        return ""
    dilation = f", {cluster.compute_dilation:g}x dilated" if cluster.compute_dilation != 1 else ""
    return f" (emulated compute{dilation})"
