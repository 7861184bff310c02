"""Every baseline builder's strategy vs Ray Train's TensorflowTrainer, on the emulated testbed.

For each small zoo model, in one run on the same 3-node testbed (1 CPU per node, links shaped
to 1gbit): the median step time of every builder's strategy with AutoSync's RayRunner (one warm
WorkerPool per model; strategies that coincide are measured once and reported under every name),
then of Ray Train's TensorflowTrainer with MultiWorkerMirroredStrategy (``_peer.measure_peer``)
on the same model, per-worker batch and nodes. Prints a table and writes
``baselines_vs_peer.json`` and ``baselines_vs_peer.png`` into ``--out``.

Needs root (the testbed). Either let the script bring the testbed up and tear it down::

    sudo python benchmarks/baselines_vs_peer.py [--models ncf bert] [--steps 6] [--out DIR]

or run only the measuring part inside an existing testbed::

    sudo autosync testbed up --nodes 3 --bandwidth 1gbit
    sudo autosync testbed exec -- python benchmarks/baselines_vs_peer.py --inside
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("ncf", "dlrm", "lm1b", "bert", "vgg16", "resnet50")
PEER = "ray_train_mwms"
JSON_NAME, PNG_NAME = "baselines_vs_peer.json", "baselines_vs_peer.png"
ADAM_LR = 1e-3


def _with_adam(name: str):
    """Zoo model ``name`` (small) with Adam instead of its own optimizer, for both AutoSync and the
    peer; used only when ``check_optimizer_config`` rejects the zoo optimizer (the runtime before
    commit 4137e93 had no Adagrad or AdamW). The optimizer barely changes what is synchronized."""
    from autosync.models import _recsys
    from autosync.sources import load_model_def

    md = load_model_def(f"zoo:{name}")
    return dataclasses.replace(md, name=f"{md.name}+adam",
                               optimizer_fn=functools.partial(_recsys.adam, learning_rate=ADAM_LR))


# script model sources (``benchmarks/baselines_vs_peer.py:dlrm_adam``) for the Ray Train workers too
def dlrm_adam():
    return _with_adam("dlrm")


def lm1b_adam():
    return _with_adam("lm1b")


def bert_adam():
    return _with_adam("bert")


def model_source(name: str) -> tuple[str, str | None]:
    """The source to train ``name`` with, and the reason when its optimizer was substituted."""
    from autosync.runtime.optimizers import check_optimizer_config
    from autosync.sources import load_model_def
    from strategy_space.errors import ConfigError

    opt = load_model_def(f"zoo:{name}").optimizer_fn()
    try:
        check_optimizer_config({**opt.get_config(), "class": type(opt).__name__})
        return f"zoo:{name}", None
    except ConfigError as e:
        if f"{name}_adam" not in globals():
            raise
        return f"{os.path.abspath(__file__)}:{name}_adam", f"{type(opt).__name__} -> Adam(lr={ADAM_LR:g}): {e}"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inside", action="store_true",
                   help="measure only (run inside host0 of an existing testbed, via `autosync testbed exec`)")
    p.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME", help="zoo models (default: all six)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trial (default 2)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per trial (default 6)")
    p.add_argument("--nodes", type=int, default=3, help="testbed nodes, when the script brings it up (default 3)")
    p.add_argument("--bandwidth", default="1gbit", help="testbed link rate, when the script brings it up")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="limit per trial, seconds (default 300)")
    p.add_argument("--builders", nargs="+", metavar="NAME", help="only these builders (default: all)")
    p.add_argument("--ar-backend", default="auto", help="all-reduce backend of the builders that take one "
                   "(auto, gloo, objectstore, graph; default auto)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="output folder")
    p.add_argument("--merge", action="store_true",
                   help="keep the other models of an existing JSON in --out (re-measure only --models)")
    return p.parse_args(argv)


def measure_model(name: str, cluster, warmup: int, steps: int, trial_timeout_s: float, say,
                  builders: list[str] | None = None, ar_backend: str = "auto") -> dict:
    """AutoSync's baselines, then the peer, on one model (the pool is killed before the peer
    runs: every node has one CPU and the peer's workers need it)."""
    import _peer

    from autosync.runtime.binding import ClusterBinding
    from autosync.api import make_runner
    from autosync.runtime.engine import WorkerPool
    from strategy_space.builders import BUILDERS, get_builder

    source, substituted = model_source(name)
    if substituted:
        say(f"  optimizer substituted for AutoSync and the peer alike: {substituted.splitlines()[0][:160]}")
    pool = WorkerPool(ClusterBinding.bind(cluster))
    runner = make_runner(source, cluster, warmup=warmup, steps=steps, trial_timeout_s=trial_timeout_s, pool=pool)
    out: dict = {"source": source, "optimizer_substituted": substituted, "builders": {}}
    try:
        t0 = time.monotonic()
        model = runner.model
        out["worker_start_s"] = round(time.monotonic() - t0, 2)
        out["batch_size_per_worker"] = runner.model_def.batch_size
        out["parameter_bytes"] = sum(v.bytes for v in model.variables)
        out["sparse_bytes"] = sum(v.bytes for v in model.variables if v.sparse)
        measured: list = []  # (strategy, builder that measured it)
        for builder in builders or BUILDERS:
            takes_backend = "backend" in inspect.signature(BUILDERS[builder]).parameters
            strategy = get_builder(builder, **({"backend": ar_backend} if takes_backend else {})).build(model, cluster)
            same = next((b for s, b in measured if s == strategy), None)
            if same is not None:
                out["builders"][builder] = {**out["builders"][same], "same_as": same}
                say(f"  {builder}: same strategy as {same}")
                continue
            trial = runner.run_one(strategy, builder)
            rec = {"status": trial.status, "error": trial.error or None,
                   "median_s": trial.median if trial.ok else None, "p90_s": trial.p90 if trial.ok else None,
                   "step_times_s": [round(t, 5) for t in trial.step_times],
                   "breakdown_s": trial.breakdown or None,
                   "ps_actors": trial.meta.get("ps_actors"),
                   "ray_calls_per_step_per_worker": trial.meta.get("ray_calls_per_step_per_worker"),
                   "bytes_per_step_per_worker": trial.meta.get("bytes_per_step_per_worker"),
                   "full_pull": trial.meta.get("full_pull")}
            out["builders"][builder] = rec
            measured.append((strategy, builder))
            say(f"  {builder}: {trial.status} " + (f"median {trial.median * 1e3:.1f} ms" if trial.ok
                                                    else (trial.error or "")[:200]))
    finally:
        pool.kill_all()
    t0 = time.monotonic()
    peer = _peer.measure_peer(source, cluster, warmup=warmup, steps=steps, timeout_s=trial_timeout_s)
    out["peer"] = {"status": peer["status"], "error": peer.get("error"), "median_s": peer.get("median"),
                   "step_times_s": [round(t, 5) for t in peer.get("step_times", [])],
                   "wall_s": round(time.monotonic() - t0, 1)}
    say(f"  {PEER}: {peer['status']} " + (f"median {peer['median'] * 1e3:.1f} ms" if peer["status"] == "ok"
                                           else peer.get("error", "")[:200]))
    return out


def _ms(seconds) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.0f}"


def render_table(results: dict) -> str:
    from autosync.formatting import table
    from strategy_space.builders import BUILDERS

    cols = list(BUILDERS) + [PEER]
    rows = []
    for name, r in results["models"].items():
        cells = [_ms((r["builders"].get(b) or {}).get("median_s")) for b in BUILDERS]
        cells.append(_ms(r["peer"]["median_s"]))
        ok = {b: v["median_s"] for b, v in r["builders"].items() if v.get("median_s")}
        best = min(ok, key=ok.get) if ok else None
        peer = r["peer"]["median_s"]
        speedup = f"{peer / ok[best]:.2f}x" if best and peer else "-"
        if r.get("optimizer_substituted"):
            name += "*"
        rows.append([name, f"{r['parameter_bytes'] / 2**20:.1f} ({r['sparse_bytes'] / 2**20:.1f})", *cells,
                     best or "-", speedup])
    headers = ["model", "MiB (sparse)", *cols, "best", "peer/best"]
    text = table(headers, rows, right=tuple(range(1, len(headers))))
    if any(r.get("optimizer_substituted") for r in results["models"].values()):
        text += "\n* trained with Adam by both AutoSync and the peer (AutoSync's update rules lack its own optimizer)"
    return text


def render_png(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from strategy_space.builders import BUILDERS

    cols = list(BUILDERS) + [PEER]
    models = list(results["models"])
    width = 0.8 / len(cols)
    fig, ax = plt.subplots(figsize=(12, 5))
    cmap = plt.get_cmap("tab10")
    for j, col in enumerate(cols):
        vals = []
        for m in models:
            r = results["models"][m]
            v = (r["peer"] if col == PEER else r["builders"].get(col) or {}).get("median_s")
            vals.append(v * 1e3 if v else np.nan)
        x = np.arange(len(models)) + (j - (len(cols) - 1) / 2) * width
        ax.bar(x, vals, width, label=col, color="black" if col == PEER else cmap(j),
               hatch="//" if col == PEER else None)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(models)))
    ax.set_xticklabels([m + (" (Adam*)" if results["models"][m].get("optimizer_substituted") else "")
                        for m in models])
    ax.set_ylabel("median step time, ms (log scale; lower is better)")
    meta = results["meta"]
    ax.set_title(f"AutoSync baselines vs Ray Train TensorflowTrainer (MWMS): {meta['nodes']} testbed nodes at "
                 f"{meta['bandwidth']}, 1 CPU each, {meta['steps']} timed steps")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def inside(args) -> int:
    import ray

    import _peer
    from _testbed import git_commit, write_json
    from autosync.sources import load_cluster
    from autosync.testbed import format_rate

    if not os.environ.get("RAY_ADDRESS"):
        print("baselines_vs_peer --inside runs inside the testbed's host0: "
              "`sudo autosync testbed exec -- python benchmarks/baselines_vs_peer.py --inside`", file=sys.stderr)
        return 2
    cluster = load_cluster("testbed")
    os.makedirs(args.out, exist_ok=True)
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    # neither this script's folder nor _peer is importable on the nodes: ship them by value
    ray.cloudpickle.register_pickle_by_value(_peer)
    bandwidth = format_rate(round(cluster.nodes[0].bandwidth_gbps * 1e9))
    commit = git_commit(REPO)  # at the start of the run: the code that measured it
    results = {"meta": {"nodes": len(cluster.nodes), "bandwidth": bandwidth, "cpus_per_node": cluster.nodes[0].cpus,
                        "commit": commit,
                        "warmup": args.warmup, "steps": args.steps, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "ar_backend": args.ar_backend, "builders": args.builders or "all",
                        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                        "ray": ray.__version__},
               "models": {}}
    path = os.path.join(args.out, JSON_NAME)
    if args.merge and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        results["models"] = {m: r for m, r in old["models"].items() if m not in args.models}
    t_all = time.monotonic()
    for name in args.models:
        t0 = time.monotonic()
        print(f"{name}:", flush=True)
        # provenance per entry: a --merge file holds entries of several runs
        results["models"][name] = {"run_started": results["meta"]["started"], "commit": commit}
        results["models"][name].update(measure_model(name, cluster, args.warmup, args.steps, args.trial_timeout,
                                                lambda line: print(line, flush=True), args.builders,
                                                args.ar_backend))
        results["models"][name]["wall_s"] = round(time.monotonic() - t0, 1)
        results["meta"]["wall_s"] = round(time.monotonic() - t_all, 1)
        results["models"] = {m: results["models"][m] for m in MODELS if m in results["models"]}
        write_json(path, results)  # partial results survive an interruption
    ray.shutdown()
    print()
    print(render_table(results))
    png = os.path.join(args.out, PNG_NAME)
    render_png(results, png)
    print(f"\nwrote {path} and {png} ({results['meta']['wall_s']:.0f} s in all)")
    return 0


def outside(args, argv) -> int:
    from _testbed import run_in_testbed

    return run_in_testbed(__file__, argv, nodes=args.nodes, bandwidth=args.bandwidth, name="baselines_vs_peer",
                          outer_flags={"--nodes", "--bandwidth", "--out"}, extra=["--out", os.path.abspath(args.out)])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.steps < 1 or args.warmup < 0:
        print(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}", file=sys.stderr)
        return 2
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        print(f"unknown models {unknown}; valid: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    from strategy_space.builders import BUILDERS
    from strategy_space.strategy import BACKENDS

    bad = [b for b in args.builders or () if b not in BUILDERS]
    if bad or args.ar_backend not in BACKENDS:
        print(f"unknown builders {bad} or backend {args.ar_backend!r}; builders: {', '.join(BUILDERS)}; "
              f"backends: {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    return inside(args) if args.inside else outside(args, argv)


if __name__ == "__main__":
    sys.exit(main())
