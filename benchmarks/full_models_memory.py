"""Peak memory of the full-size embedding models training with a PS/Parallax strategy, real compute.

For each model (default ``ncf`` and ``dlrm`` at ``size=full``), on the ``local`` cluster (one node,
2 workers): a few steps of the given builder's strategy, while a sampler thread sums the memory
of this driver and every process it started (Ray's GCS, raylet, workers, PS actors) every 0.2 s:
RSS (counts the shared object-store pages once per process that maps them) and PSS (shares them
out: the machine's real use). The run stops early, killing those processes, when PSS passes
``--limit-gib``, and says so. Writes ``full_models_memory.json`` with the commit and start time.

    python benchmarks/full_models_memory.py --models ncf dlrm --builder parallax --steps 3

With ``--rows-fraction F [F ...]`` it trains instead the full-size architecture of dlrm with every
embedding table cut to a fraction F of its rows (at least 1), once per F, and fits peak PSS
against the table bytes: the slope is the memory held per byte of table (how many copies of the
tables exist at the peak), the intercept what Ray and TensorFlow take anyway; it extrapolates
both to the full size (written to ``full_models_memory_scaled.json``). That measures the
full-size model's memory on a machine that cannot hold it.

    python benchmarks/full_models_memory.py --rows-fraction 0.02 0.04 0.08

With ``--spec YAML [YAML ...]`` it trains model-spec YAMLs (``configs/models/dlrm.yaml``, ...) with
emulated compute instead (workers wait ``--step-time`` and send synthetic gradients; the parameter
servers, their optimizer (``--optimizer``) and the transfers are the real ones), whole
(``full_models_memory_full.json``) or, with ``--rows-fraction``, with every sparse variable cut to
those fractions of its rows, fitted and extrapolated per spec as above
(``full_models_memory_scaled_emulated.json``). Both files keep the entries of earlier runs of
other specs and optimizers (each entry records its own commit and start time).

    python benchmarks/full_models_memory.py --spec configs/models/dlrm.yaml --rows-fraction 0.05 0.1 0.2
    python benchmarks/full_models_memory.py --spec configs/models/dlrm.yaml --optimizer sgd adam

Besides ``--limit-gib`` (PSS), the sampler stops the run when the machine's available memory
(``MemAvailable``) falls under ``--min-available-gib`` (default 2): the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
GIB = 1 << 30


def _memory(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) bytes summed over ``pids`` (from /proc/PID/smaps_rollup)."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def _available() -> int:
    """The machine's available memory (``MemAvailable``), bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    """Peak RSS/PSS of this process tree; kills the tree's other processes past ``limit`` bytes of
    PSS or once the machine's available memory falls under ``floor`` bytes."""

    def __init__(self, limit: int, floor: int = 0):
        super().__init__(daemon=True)
        self.limit, self.floor, self.peak_rss, self.peak_pss, self.over = limit, floor, 0, 0, False
        self.low_available = False
        self.min_available = _available()
        self.processes = 0
        self._halt = threading.Event()

    def run(self):
        from autosync.runtime.reaper import descendants

        me = os.getpid()
        while not self._halt.wait(0.2):
            pids = [me] + descendants(me)
            rss, pss = _memory(pids)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.processes = max(self.processes, len(pids))
            available = _available()
            self.min_available = min(self.min_available, available)
            if (pss > self.limit or available < self.floor) and not self.over:
                self.over = True
                self.low_available = available < self.floor
                for pid in pids:
                    if pid != me:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass

    def stop(self):
        self._halt.set()
        self.join()


def scaled_dlrm(fraction: float):
    """The full-size DLRM (zoo ``dlrm?size=full``: Criteo Kaggle tables x 16, its MLPs, Adagrad,
    batch 128) with every table cut to ``fraction`` of its rows."""
    import functools

    from autosync.model_def import ModelDef
    from autosync.models import _data, _recsys

    tables = tuple(max(1, int(n * fraction)) for n in _data.CRITEO_KAGGLE_TABLES)
    return ModelDef(name=f"dlrm-rows{fraction:g}",
                    model_fn=functools.partial(_recsys.dlrm, table_sizes=tables, dim=16, bottom=(512, 256, 64),
                                               top=(512, 256)),
                    loss_fn=_recsys.click_loss, optimizer_fn=_recsys.adagrad,
                    dataset_fn=functools.partial(_data.click_log_batches, dense_features=_data.CRITEO_DENSE_FEATURES,
                                                 table_sizes=tables, batch_size=128),
                    batch_size=128)


def scaled_spec(spec, fraction: float):
    """``spec`` with every sparse variable cut to ``fraction`` of its rows (at least 1; rows per
    step at most the rows left)."""
    import dataclasses

    def cut(v):
        if not v.sparse:
            return v
        rows = max(1, int(v.shape[0] * fraction))
        return dataclasses.replace(v, shape=(rows,) + tuple(v.shape[1:]),
                                   rows_per_step=min(v.rows_per_step, rows) if v.rows_per_step else None)

    return dataclasses.replace(spec, name=f"{spec.name}-rows{fraction:g}", variables=tuple(cut(v) for v in spec.variables))


def _copies(ps_stats) -> int | None:
    """Variables the PS actors copied before an update (None: their stats do not count them)."""
    counted = [s["copies"] for s in (ps_stats or {}).values() if "copies" in s]
    return sum(counted) if counted else None


def measure(name: str, builder: str, steps: int, limit: int, model_def=None, floor: int = 0, **runner_kw) -> dict:
    import ray

    from autosync.api import make_runner
    from strategy_space.builders import get_builder

    sampler = Sampler(limit, floor)
    sampler.start()
    t0 = time.monotonic()
    rec = {"source": f"zoo:{name}?size=full" if model_def is None else model_def.name, "builder": builder,
           **{k: v for k, v in runner_kw.items() if k in ("compute", "optimizer", "step_time_s")}}
    try:
        runner = make_runner(model_def or rec["source"], "local", warmup=1, steps=steps, trial_timeout_s=900,
                             **runner_kw)
        model = runner.model
        rec["parameter_bytes"] = sum(v.bytes for v in model.variables)
        rec["sparse_bytes"] = sum(v.bytes for v in model.variables if v.sparse)
        trial = runner.run_one(get_builder(builder).build(model, runner.cluster), builder)
        rec.update(status=trial.status, error=trial.error or None, median_s=trial.median if trial.ok else None,
                   full_pull=trial.meta.get("full_pull"),
                   ps_copies_on_write=_copies(trial.meta.get("ps_stats")),
                   bytes_per_step_per_worker=trial.meta.get("bytes_per_step_per_worker"))
    except Exception as e:  # noqa: BLE001 - recorded: an out-of-memory stop is a result
        rec.update(status="error", error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
    finally:
        try:
            runner.pool.kill_all()
        except Exception:  # noqa: BLE001
            pass
        ray.shutdown()
        sampler.stop()
    rec.update(peak_rss_gib=round(sampler.peak_rss / GIB, 2), peak_pss_gib=round(sampler.peak_pss / GIB, 2),
               processes=sampler.processes, stopped_over_limit=sampler.over,
               stopped_low_available=sampler.low_available, min_available_gib=round(sampler.min_available / GIB, 2),
               wall_s=round(time.monotonic() - t0, 1))
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["ncf", "dlrm"], choices=["ncf", "dlrm", "lm1b"])
    p.add_argument("--builder", default="parallax", help="strategy builder (default parallax)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3, after 1 warm-up)")
    p.add_argument("--limit-gib", type=float, default=16.0, help="stop a run whose PSS passes this (default 16)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    p.add_argument("--rows-fraction", type=float, nargs="+", metavar="F",
                   help="measure dlrm's full architecture (or each --spec) with its tables cut to these fractions "
                        "of their rows (e.g. 0.02 0.04 0.08) and extrapolate to the full size, instead of --models")
    p.add_argument("--spec", nargs="+", metavar="YAML",
                   help="model-spec YAMLs to run with emulated compute instead of the zoo models")
    p.add_argument("--optimizer", nargs="+", default=["sgd"],
                   help="with --spec: emulated compute's optimizers, one run each (sgd, momentum, adam, adagrad)")
    p.add_argument("--step-time", type=float, default=0.05,
                   help="with --spec: seconds of emulated compute per step (default 0.05)")
    p.add_argument("--min-available-gib", type=float, default=2.0,
                   help="stop a run when the machine's available memory falls under this (default 2)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.limit_gib <= 0:
        print("full_models_memory: --steps must be >= 1 and --limit-gib > 0", file=sys.stderr)
        return 2
    if args.rows_fraction and (len(args.rows_fraction) < 2 or not all(0 < f <= 1 for f in args.rows_fraction)):
        print("full_models_memory: --rows-fraction takes two or more fractions in (0, 1], e.g. 0.02 0.04 0.08",
              file=sys.stderr)
        return 2
    from _testbed import git_commit, write_json

    started, commit = time.strftime("%Y-%m-%d %H:%M:%S"), git_commit(REPO)
    if args.spec:
        from autosync.runtime.emulated import OPTIMIZERS

        bad = [o for o in args.optimizer if o not in OPTIMIZERS] + [s for s in args.spec if not os.path.isfile(s)]
        if bad or args.step_time < 0:
            print(f"full_models_memory: --optimizer takes {', '.join(OPTIMIZERS)}, --spec existing model-spec YAML "
                  f"files and --step-time a number >= 0; got {bad or args.step_time}", file=sys.stderr)
            return 2
        return specs(args, started, commit, write_json)
    if args.rows_fraction:
        return scaled(args, started, commit, write_json)
    results = {"meta": {"commit": commit, "started": started, "cluster": "local (1 node, 2 workers)",
                        "steps": args.steps, "limit_gib": args.limit_gib}, "models": {}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "full_models_memory.json")
    for name in args.models:
        rec = measure(name, args.builder, args.steps, int(args.limit_gib * GIB))
        results["models"][name] = {"run_started": started, "commit": commit, **rec}
        print(json.dumps({name: rec}), flush=True)
        write_json(path, results)
    print(f"wrote {path}")
    return 0


def scaled(args, started: str, commit: str, write_json) -> int:
    """``--rows-fraction``: dlrm at each fraction, then the fit and its extrapolation."""
    import numpy as np

    from autosync.models import _data

    full_table_bytes = sum(_data.CRITEO_KAGGLE_TABLES) * 16 * 4
    results = {"meta": {"commit": commit, "started": started, "cluster": "local (1 node, 2 workers)",
                        "model": "dlrm full architecture, tables cut to a fraction of their rows",
                        "builder": args.builder, "steps": args.steps, "full_table_bytes": full_table_bytes},
               "entries": {}}
    path = os.path.join(args.out, "full_models_memory_scaled.json")
    for fraction in args.rows_fraction:
        md = scaled_dlrm(fraction)
        rec = measure("dlrm", args.builder, args.steps, int(args.limit_gib * GIB), md)
        rec["table_bytes"] = sum(max(1, int(n * fraction)) for n in _data.CRITEO_KAGGLE_TABLES) * 16 * 4
        results["entries"][f"rows_fraction={fraction:g}"] = {"run_started": started, "commit": commit,
                                                             "rows_fraction": fraction, **rec}
        print(json.dumps({fraction: rec}), flush=True)
        write_json(path, results)
    ok = [e for e in results["entries"].values() if e["status"] == "ok"]
    if len(ok) >= 2:
        x = np.array([e["table_bytes"] for e in ok], float)
        for kind in ("pss", "rss"):
            y = np.array([e[f"peak_{kind}_gib"] * GIB for e in ok], float)
            slope, intercept = np.polyfit(x, y, 1)
            results["meta"][f"{kind}_per_table_byte"] = round(float(slope), 2)
            results["meta"][f"{kind}_intercept_gib"] = round(float(intercept / GIB), 2)
            results["meta"][f"{kind}_full_size_gib"] = round(float((slope * full_table_bytes + intercept) / GIB), 1)
        print(f"peak PSS = {results['meta']['pss_per_table_byte']} x table bytes + "
              f"{results['meta']['pss_intercept_gib']} GiB; full size ({full_table_bytes / GIB:.2f} GiB of tables): "
              f"{results['meta']['pss_full_size_gib']} GiB PSS, {results['meta']['rss_full_size_gib']} GiB RSS "
              f"(against 24 GiB)")
        write_json(path, results)
    print(f"wrote {path}")
    return 0


def _say_mixed_runs(results: dict) -> None:
    """``meta.mixed_runs`` where the file's entries come from several runs (kept from earlier ones)."""
    runs = sorted({e["run_started"] for e in results["entries"].values()})
    if len(runs) > 1:
        results["meta"]["mixed_runs"] = (f"this file holds entries of {len(runs)} runs of full_models_memory.py "
                                         f"(started {', '.join(runs)}); each entry and fit records its own "
                                         f"run_started and commit")


def specs(args, started: str, commit: str, write_json) -> int:
    """``--spec``: each model-spec YAML with emulated compute, per optimizer; whole, or at each
    ``--rows-fraction`` with the fit and its extrapolation per (spec, optimizer)."""
    import numpy as np

    from strategy_space.yaml_io import load

    limit, floor = int(args.limit_gib * GIB), int(args.min_available_gib * GIB)
    name = "full_models_memory_scaled_emulated.json" if args.rows_fraction else "full_models_memory_full.json"
    path = os.path.join(args.out, name)
    results = {"meta": {"commit": commit, "started": started, "cluster": "local (1 node, 2 workers)",
                        "compute": "emulated", "step_time_s": args.step_time, "builder": args.builder,
                        "steps": args.steps, "limit_gib": args.limit_gib,
                        "min_available_gib": args.min_available_gib},
               "entries": {}, "fits": {}}
    if os.path.isfile(path):
        # runs of other specs or optimizers stay, each entry and fit with its own commit and start
        with open(path) as f:
            old = json.load(f)
        results["entries"].update(old.get("entries", {}))
        results["fits"].update(old.get("fits", {}))
    for spec_path in args.spec:
        spec = load(spec_path, "model")
        full_tables = sum(v.bytes for v in spec.variables if v.sparse)
        for optimizer in args.optimizer:
            entries = []
            for fraction in args.rows_fraction or [None]:
                run = spec if fraction is None else scaled_spec(spec, fraction)
                rec = measure(run.name, args.builder, args.steps, limit, run, floor, compute="emulated",
                              optimizer=optimizer, step_time_s=args.step_time)
                rec["table_bytes"] = sum(v.bytes for v in run.variables if v.sparse)
                key = f"{spec.name}/{args.builder}/{optimizer}" + ("" if fraction is None else f"/rows={fraction:g}")
                rec = {"run_started": started, "commit": commit, "spec": spec_path, "rows_fraction": fraction,
                       "steps": args.steps, **rec}
                results["entries"][key] = rec
                entries.append(rec)
                print(json.dumps({key: rec}), flush=True)
                _say_mixed_runs(results)
                write_json(path, results)
            ok = [e for e in entries if e["status"] == "ok"]
            if args.rows_fraction and len(ok) >= 2:
                x = np.array([e["table_bytes"] for e in ok], float)
                fit = {"run_started": started, "commit": commit, "full_table_bytes": full_tables,
                       "parameter_bytes": sum(v.bytes for v in spec.variables)}
                for kind in ("pss", "rss"):
                    y = np.array([e[f"peak_{kind}_gib"] * GIB for e in ok], float)
                    slope, intercept = np.polyfit(x, y, 1)
                    fit[f"{kind}_per_table_byte"] = round(float(slope), 2)
                    fit[f"{kind}_intercept_gib"] = round(float(intercept / GIB), 2)
                    fit[f"{kind}_full_size_gib"] = round(float((slope * full_tables + intercept) / GIB), 1)
                results["fits"][f"{spec.name}/{args.builder}/{optimizer}"] = fit
                print(f"{spec.name} {optimizer}: peak PSS = {fit['pss_per_table_byte']} x table bytes + "
                      f"{fit['pss_intercept_gib']} GiB; full size ({full_tables / GIB:.2f} GiB of tables): "
                      f"{fit['pss_full_size_gib']} GiB PSS, {fit['rss_full_size_gib']} GiB RSS", flush=True)
                _say_mixed_runs(results)
                write_json(path, results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
