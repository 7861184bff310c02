"""How much the PS runtime adds to a training step, how many Ray calls it makes, how fast a trial
starts.

For small models on this machine it measures, in one run:
  - the single-process step time (one process, all cores, Keras optimizer, the global batch),
  - the PS runtime's step time for the same global batch split over the workers (RayRunner),
    their ratio (overhead), and the compute / sync breakdown,
  - Ray calls per step per worker (target: 2 x the PS actors it talks to, whatever the number of
    variables),
  - trial start-up with warm workers (pooled PS actors, reset workers: from "run this strategy" to
    the first step) next to the cost of importing TensorFlow in a fresh process,
  - for each sparse zoo model, the bytes a worker moves per step for its sparse variables on
    parameter servers (measured by the channels: array payload) against the analytic minimum,
    rows touched x row width, in each direction (target: <= 1.2x). Rows touched are the unique
    row indices of the worker's gradient on each timed batch, computed here in one process.
    Sent is also given against the exact minimum: for an optimizer that squares each gradient
    slice before repeated rows add up (Adam, AdamW, Adagrad: Keras squares the IndexedSlices
    values), the parameter server needs each repeated row's sum of squared slices as well as its
    sum, a second row of values that the sum alone cannot replace; so the exact minimum sent is
    (rows touched + rows repeated within the worker's batch) x width.

  - with --apply: a parameter server's optimizer apply time per step, in one process, on the
    shapes of ncf, dlrm and lm1b (all variables on one PS; sparse ones get the rows of one global
    batch): the update and the reads of the pull that follows (dense values whole, the batch's
    rows of sparse ones, distinct, as workers that sum repeated rows push them; --tables: one big
    table instead, where a row-local rule's whole-table update is timed too), for SGD, Adam and
    Adagrad: the numpy rules against the Keras optimizer object (``keras_optimizer.KerasOptimizer``,
    what every other configuration runs) compiled by XLA as it runs, and traced without XLA as it
    ran before (``keras_traced``); each path's first update (tracing, compiling) and the start-up
    cost of each in a fresh process (import and first build).

  - with --pool-startup: trial start-up (RayRunner's ``startup_s``: from "run this strategy" to
    the first step) of --trials consecutive trials of strategy 'ps' (2 workers on one node), for
    ncf, dlrm and lm1b: SGD(0.1) on the numpy rules against SGD with a cosine-decay schedule,
    which runs the Keras optimizer in the PS actor; each on a fresh pool, as a tuning run starts,
    --rounds times with the order of the two alternating. Before the first trial the workers
    start and load the model (``load``, the same on both paths); the PS actors start beside that
    load and, on the Keras path, import Keras there (``PSPool.expect``; before it they started, and
    imported Keras, on the first trial's path). The later trials are what a tuner's trials cost.
    Printed: the load and each trial's start-up, and the Keras path minus the numpy rules: first
    trial, load + first trial (from nothing to the first step), later trials (issue #26's "trial
    start-up no more than 1 s slower").

  - with --checkpoint: ``Trainer.save`` time per GiB of state (weights + optimizer slots) on ncf,
    dlrm and lm1b ('ps' strategy, 2 workers as 2 nodes, after one training step so the slots
    exist): median of --repeat saves into one directory (each replaces the last, fsynced), split
    into waiting for the actors' state (read a bounded batch at a time) and writing the files; then
    one restore (a trainer started from the checkpoint: its ``_restore``, loading the started
    actors); and the driver's peak resident memory; then one restore of the same checkpoint under
    'partitioned_ps' (its optimizer state re-cut for the other strategy's shards: ``reshard``), its
    time and the driver's peak private memory while it ran.

Usage: python benchmarks/runtime_overhead.py [--steps N] [--warmup N] [--bytes-only] [--apply]
                                            [--pool-startup [--trials N] [--rounds N]]
                                            [--checkpoint [--repeat N]] [--models M ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

VOCAB, DIM, IDS, BATCH, WORKERS = 2000, 16, 4, 64, 2
MODELS = {"emb+2dense": 2, "emb+8dense": 8, "emb+24dense": 24}   # name -> dense layers


def build_model(layers: int):
    import keras

    ids = keras.Input((IDS,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(ids))
    for i in range(layers):
        x = keras.layers.Dense(32, activation="relu", name=f"d{i}")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def mse():
    import keras

    return keras.losses.MeanSquaredError()


def adam():
    import keras

    return keras.optimizers.Adam(1e-3)


def batches(worker: int, num_workers: int, batch: int = BATCH):
    rng = np.random.RandomState(worker)
    for _ in range(16):
        x = rng.randint(0, VOCAB, size=(batch, IDS)).astype("int32")
        yield x, np.sin(x.sum(axis=1, keepdims=True) / 500.0).astype("float32")


def model_def(name: str, batch: int = BATCH):
    from autosync.model_def import ModelDef

    return ModelDef(name=name, model_fn=functools.partial(build_model, MODELS[name]), loss_fn=mse,
                    optimizer_fn=adam, dataset_fn=functools.partial(batches, batch=batch), batch_size=batch)


def single_process(steps: int, warmup: int) -> None:
    """Child mode: print 'name median_s' for each model, one process with every core."""
    import keras

    from autosync.models.profile import train_step

    for name in MODELS:
        md = model_def(name, batch=BATCH * WORKERS)   # the global batch in one process
        keras.utils.set_random_seed(md.seed)
        model = md.model_fn()
        step = train_step(model, md.loss(), md.optimizer_fn())

        data = md.batches(0, 1)
        times = []
        for i in range(warmup + steps):
            x, y = next(data)
            t0 = time.perf_counter()
            float(step(x, y))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        print(name, len(model.trainable_variables), statistics.median(times), flush=True)


def fresh_import_s(module: str, repeat: int = 3) -> float:
    """Median wall time of ``python -c 'import module'`` minus that of ``python -c pass``."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}

    def wall(code):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        return time.perf_counter() - t0

    base = statistics.median(wall("pass") for _ in range(repeat))
    return statistics.median(wall(f"import {module}") for _ in range(repeat)) - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--apply", action="store_true", help="only the PS apply time and start-up, numpy vs Keras")
    ap.add_argument("--bytes-only", action="store_true", help="only the sparse bytes-per-step table")
    ap.add_argument("--checkpoint", action="store_true", help="only Trainer.save seconds per GiB of state")
    ap.add_argument("--repeat", type=int, default=3, help="saves per model with --checkpoint")
    ap.add_argument("--pool-startup", action="store_true",
                    help="only trial start-up of consecutive trials on a fresh pool, numpy rules vs Keras path")
    ap.add_argument("--tables", nargs="+", type=int, default=None, metavar="ROWS",
                    help=f"with --apply: instead of the zoo (unless --models is given too), one embedding table of "
                         f"ROWS x {TABLE_DIM} and a dense layer, {TABLE_DRAWS} rows drawn a step; adds the Keras "
                         f"rule on the whole table (keras_whole_table)")
    ap.add_argument("--trials", type=int, default=3, help="consecutive trials per model and path with --pool-startup")
    ap.add_argument("--rounds", type=int, default=2, help="fresh pools per model and path with --pool-startup "
                                                          "(the paths' order alternates)")
    ap.add_argument("--models", nargs="+", default=None, metavar="M",
                    help=f"zoo models ({', '.join(SPARSE_ZOO)}) of the bytes-per-step table (default: all) or of "
                         f"--checkpoint (default: ncf dlrm lm1b; there also NAME?size=full)")
    ap.add_argument("--out", help="also write the sparse bytes-per-step table (or with --checkpoint, --apply, "
                                  "--pool-startup their figures) as JSON to FILE "
                                  "(e.g. benchmarks/results/runtime_overhead_sparse_bytes.json)")
    args = ap.parse_args()
    bad = [m for m in args.models or () if m.split("?")[0] not in SPARSE_ZOO
           or ("?" in m and not args.checkpoint)]
    if bad:
        ap.error(f"--models: {bad} are not among {list(SPARSE_ZOO)} (NAME?size=full only with --checkpoint)")
    if args.tables and (not args.apply or min(args.tables) < 1):
        ap.error(f"--tables {args.tables}: row counts of at least 1, and only with --apply")
    if args.single:
        single_process(args.steps, args.warmup)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.checkpoint:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        result = checkpoint_cost(args.repeat, args.models or list(CHECKPOINT_ZOO))
        if args.out:
            _write_run(args.out, started, {"repeat": args.repeat, "strategy": "ps", "recut_strategy": "partitioned_ps",
                                           "workers": WORKERS},
                       {"checkpoint": result})
        return
    if args.apply:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        result = apply_cost(args.steps, args.warmup, [] if args.tables and not args.models else
                            args.models or list(APPLY_ZOO), args.tables or ())
        if args.out:
            _write_run(args.out, started, {"steps": args.steps, "warmup": args.warmup}, result)
        return
    args.models = args.models or list(SPARSE_ZOO)
    if args.bytes_only:
        sparse_bytes(args.steps, args.warmup, args.out, args.models)
        return
    if args.pool_startup:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        result = pool_startup(args.trials, args.models, args.rounds)
        if args.out:
            _write_run(args.out, started, {"trials": args.trials, "rounds": args.rounds, "strategy": "ps",
                                           "workers": WORKERS}, result)
        return

    tf_import = fresh_import_s("tensorflow")
    ray_np_import = fresh_import_s("ray, numpy")
    child = subprocess.run([sys.executable, __file__, "--single", "--steps", str(args.steps), "--warmup",
                            str(args.warmup)], check=True, capture_output=True, text=True)
    single = {ln.split()[0]: float(ln.split()[2]) for ln in child.stdout.splitlines() if ln.split()[0] in MODELS}

    import ray

    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import WorkerPool
    from autosync.runtime.runner import RayRunner
    from strategy_space import ClusterSpec, NodeSpec
    from strategy_space.builders import get_builder

    cpus = os.cpu_count() or 1
    local = ClusterSpec(name="local", nodes=(NodeSpec(name="node0", cpus=cpus, workers=WORKERS, chief=True),))
    # the same machine seen as two nodes, so partitioned strategies really use two PS actors
    pair = ClusterSpec(name="pair", nodes=tuple(
        NodeSpec(name=f"node{i}", cpus=max(1, cpus // WORKERS), workers=1, chief=i == 0) for i in range(WORKERS)))
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    for cluster, builders in ((local, ["ps"]), (pair, ["ps_lb", "partitioned_ps"])):
        pool = WorkerPool(ClusterBinding.bind(cluster))
        for name in MODELS:
            runner = RayRunner(model_def(name), cluster, warmup=args.warmup, steps=args.steps, pool=pool)
            for builder in builders:
                opts = {"min_partition_bytes": 1} if builder == "partitioned_ps" else {}
                strategy = get_builder(builder, **opts).build(runner.model, cluster)
                trial = runner.run([strategy])[0]
                if not trial.ok:
                    raise SystemExit(f"{name} {builder}: {trial.status}: {trial.error}")
                rows.append((name, len(runner.model.variables), f"{builder}@{cluster.name}", trial.meta["ps_actors"],
                             trial.meta["ray_calls_per_step_per_worker"], trial.median, single[name],
                             trial.median / single[name], trial.breakdown["compute"], trial.breakdown["sync"],
                             trial.meta["startup_s"]))
        pool.kill_all()
    ray.shutdown()
    print(f"machine: {cpus} CPUs; {WORKERS} workers x batch {BATCH} (global batch {WORKERS * BATCH}); Adam; "
          f"{args.warmup} warm-up + {args.steps} timed steps")
    hdr = ("model", "vars", "strategy", "PS actors", "calls/step/worker", "PS step ms", "1-proc step ms",
           "overhead x", "compute ms", "sync ms", "start-up s")
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join([r[0], str(r[1]), r[2], str(r[3]), f"{r[4]:g}", f"{r[5] * 1e3:.2f}", f"{r[6] * 1e3:.2f}",
                          f"{r[7]:.2f}", f"{r[8] * 1e3:.2f}", f"{r[9] * 1e3:.2f}", f"{r[10]:.2f}"]))
    print(f"import tensorflow in a fresh process: {tf_import:.2f} s; import ray+numpy (what a PS actor "
          f"loads): {ray_np_import:.2f} s")
    sparse_bytes(min(args.steps, 5), min(args.warmup, 2), args.out, args.models)


SPARSE_ZOO = ("ncf", "dlrm", "lm1b", "bert")


def rows_touched(md, workers: int, first: int, steps: int) -> tuple[dict, dict]:
    """Mean unique rows, and mean rows seen more than once, per timed step per worker of each
    sparse variable (by name), from the gradients of the very batches the workers train on."""
    import itertools

    import keras
    import tensorflow as tf

    from autosync.models.ingest import compute_gradients, variable_names

    keras.utils.set_random_seed(md.seed)
    model, loss = md.model_fn(), md.loss()
    counts: dict = {}
    repeated: dict = {}
    for w in range(workers):
        for x, y in itertools.islice(md.batches(w, workers), first, first + steps):
            variables, grads = compute_gradients(model, loss, x, y)
            for name, g in zip(variable_names(variables), grads):
                if isinstance(g, tf.IndexedSlices):
                    seen = np.unique(g.indices.numpy(), return_counts=True)[1]
                    counts.setdefault(name, []).append(len(seen))
                    repeated.setdefault(name, []).append(int(np.sum(seen > 1)))
    return ({name: float(np.mean(c)) for name, c in counts.items()},
            {name: float(np.mean(c)) for name, c in repeated.items()})


APPLY_ZOO = ("ncf", "dlrm", "lm1b")
TABLE_DIM, TABLE_DRAWS = 64, 2048   # --tables: the width of the table and the rows drawn per step
APPLY_OPTIMIZERS = {"sgd": "SGD(0.1)", "adam": "Adam(1e-3)", "adagrad": "Adagrad(0.1)"}
def _startup_s(opt: str, keras_path: bool, repeat: int = 3) -> float:
    """Median wall time, in a fresh process, from the first import to the first applied update."""
    from autosync.runtime.optimizer_config import keras_optimizer_config
    import keras

    config = keras_optimizer_config(eval(f"keras.optimizers.{opt}"))
    code = ("import time, numpy as np\nt0 = time.perf_counter()\n"
            # as a parameter server's process imports it: without Keras' scikit-learn and
            # matplotlib integrations (lean_import)
            + ("from autosync.runtime.lean_import import skip_keras_extras\nskip_keras_extras()\n"
               "from autosync.runtime.keras_optimizer import KerasOptimizer as M\n" if keras_path
               else "from autosync.runtime.optimizers import make_optimizer as M\n")
            + f"o = M({config!r})\n"
            + "o.add_variable('k', np.zeros((1000, 16), np.float32))\n"
            + "o.apply(0, {'k': np.zeros((1000, 16), np.float32)}, {'k': np.ones((1000, 16), np.float32)})\n"
            + "print(time.perf_counter() - t0)\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    runs = [float(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                 text=True).stdout.split()[-1]) for _ in range(repeat)]
    return statistics.median(runs)


def apply_cost(steps: int, warmup: int, models=APPLY_ZOO, tables=()) -> dict:
    """Apply time per step, numpy rules vs the Keras optimizer (compiled by XLA, as it runs, and
    traced, as it ran before), on the zoo models' shapes: the update and then the reads of the pull
    that follows it (every dense value whole, the rows of the step's batch of every sparse one), as
    a parameter server serves them; and each path's first update (tracing, compiling)."""
    import functools

    import keras

    from autosync.models import zoo
    from autosync.runtime.keras_optimizer import KerasOptimizer
    from autosync.runtime.optimizer_config import keras_optimizer_config
    from autosync.runtime.optimizers import make_optimizer

    rng = np.random.default_rng(0)
    # keras: compiled from the first update (what a long run reaches after ``XLA_AFTER`` updates)
    paths = {"numpy": make_optimizer, "keras": functools.partial(KerasOptimizer, xla_after=0),
             "keras_traced": functools.partial(KerasOptimizer, xla_after=None)}
    if tables:   # what a row-local rule (Adagrad) costs on the whole table instead of its rows
        paths["keras_whole_table"] = functools.partial(KerasOptimizer, xla_after=None, row_local=False)
    out = {"startup_s": {}, "apply_ms": {}, "update_ms": {}, "read_ms": {}, "first_update_s": {}}
    print("\nstart-up in a fresh process, first import to first applied update (s)")
    for name, opt in APPLY_OPTIMIZERS.items():
        numpy_s, keras_s = _startup_s(opt, False), _startup_s(opt, True)
        out["startup_s"][name] = {"numpy": numpy_s, "keras": keras_s}
        print(f"{name} | numpy {numpy_s:.2f} | keras {keras_s:.2f} | +{keras_s - numpy_s:.2f}")
    print("\nPS apply time per step, all variables on one PS: update + the pull's reads (ms, median); "
          "keras: compiled by XLA; traced: without XLA")
    print("model | optimizer | numpy | keras | keras / numpy | keras update + read | traced | traced / numpy | "
          "first update s (keras, traced)")
    cases = []
    for model_name in models:
        md = zoo.get_model_def(model_name)
        model = md.model_fn()
        sparse = {id(layer.embeddings) for layer in model.layers if isinstance(layer, keras.layers.Embedding)}
        cases.append((model_name, [(tuple(v.shape), id(v) in sparse) for v in model.trainable_variables],
                      md.batch_size * WORKERS))
    for n in tables:   # one embedding table of n rows and a dense layer, TABLE_DRAWS rows a step
        cases.append((f"table{n}", [((n, TABLE_DIM), True), ((TABLE_DIM, TABLE_DIM), False)], TABLE_DRAWS))
    for model_name, shapes, rows in cases:
        for name, opt in APPLY_OPTIMIZERS.items():
            config = keras_optimizer_config(eval(f"keras.optimizers.{opt}"))
            times = {kind: _time_apply(make(config), shapes, rows, steps, warmup, rng) for kind, make in paths.items()}
            key = f"{model_name}/{name}"
            for part, field in (("total", "apply_ms"), ("update", "update_ms"), ("read", "read_ms")):
                out[field][key] = {kind: t[part] for kind, t in times.items()}
            out["first_update_s"][key] = {kind: t["first"] for kind, t in times.items()}
            n, k, t = times["numpy"], times["keras"], times["keras_traced"]
            whole = (f" | whole table {times['keras_whole_table']['total']:.2f}" if "keras_whole_table" in times
                     else "")
            print(f"{model_name} | {name} | {n['total']:.2f} | {k['total']:.2f} | {k['total'] / n['total']:.2f}x | "
                  f"{k['update']:.2f} + {k['read']:.2f} | {t['total']:.2f} | {t['total'] / n['total']:.2f}x | "
                  f"{k['first']:.2f}, {t['first']:.2f}{whole}")
    return out


def _time_apply(o, shapes, rows: int, steps: int, warmup: int, rng) -> dict:
    """Median ms per step of ``o``'s update and of the reads a pull makes next, and the seconds of
    its first update. A sparse variable gets the distinct rows of ``rows`` draws, summed (what a
    parameter server receives from workers that sum repeated rows: a count that varies by step)."""
    params = {i: rng.standard_normal(s).astype(np.float32) for i, (s, _) in enumerate(shapes)}
    for k, v in params.items():
        o.add_variable(k, v)
    try:   # the arrays a parameter server hands its optimizer: its own copies of what was pushed
        from autosync.runtime.tf_arrays import aligned_copy as own
    except ImportError:   # code before the split of keras_optimizer (and before 4afce9a: plain copies)
        try:
            from autosync.runtime.keras_optimizer import aligned_copy as own
        except ImportError:
            own = np.array
    samples = {"update": [], "read": [], "total": []}
    first = None
    for step in range(warmup + steps):
        grads = {i: ((own(np.unique(rng.integers(0, s[0], rows))), None, None) if is_sparse else
                     own(rng.standard_normal(s).astype(np.float32))) for i, (s, is_sparse) in enumerate(shapes)}
        for i, (s, is_sparse) in enumerate(shapes):
            if is_sparse:
                ids = grads[i][0]
                grads[i] = (ids, own(rng.standard_normal((len(ids),) + s[1:]).astype(np.float32)), None)
        t0 = time.perf_counter()
        o.apply(step, params, grads)
        t1 = time.perf_counter()
        first = t1 - t0 if first is None else first
        wanted = {i: grads[i][0] for i, (_, is_sparse) in enumerate(shapes) if is_sparse}
        # (code before 4afce9a: no ``gather``, a PS read rows from its own arrays)
        reply = (o.gather(params, wanted) if hasattr(o, "gather") else {i: params[i][r] for i, r in wanted.items()})
        whole = [i for i, (_, is_sparse) in enumerate(shapes) if not is_sparse]
        reply.update(o.snapshots(params, whole) if hasattr(o, "snapshots") else {i: o.snapshot(params, i) for i in whole})
        t2 = time.perf_counter()
        del reply   # sent: the reader lets go before the next update
        if step >= warmup:
            samples["update"].append(t1 - t0)
            samples["read"].append(t2 - t1)
            samples["total"].append(t2 - t0)
    return {**{part: statistics.median(v) * 1e3 for part, v in samples.items()}, "first": first}


def sgd_constant():
    import keras

    return keras.optimizers.SGD(0.1)


def sgd_cosine():
    import keras

    return keras.optimizers.SGD(keras.optimizers.schedules.CosineDecay(0.1, decay_steps=1000))


def pool_startup(trials: int, models=APPLY_ZOO, rounds: int = 2) -> dict:
    """Start-up of consecutive trials as a tuning run meets them, numpy rules vs the Keras path
    (see the module doc): for each model, path and round a fresh pool (new workers and PS actors),
    ``trials`` trials of 'ps' on it; the paths' order alternates from round to round. The first
    trial of a pool includes the workers' start and the model's load (the same on both paths) and,
    on the Keras path, the PS actors' import of Keras; the later trials are what a tuner's trials
    cost once its PS processes are warm."""
    import dataclasses

    import ray

    from autosync.models import zoo
    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import WorkerPool
    from autosync.runtime.optimizers import check_model_optimizer
    from autosync.runtime.runner import RayRunner
    from strategy_space import ClusterSpec, NodeSpec
    from strategy_space.builders import get_builder

    models = [m for m in models if m in APPLY_ZOO]
    cpus = os.cpu_count() or 1
    local = ClusterSpec(name="local", nodes=(NodeSpec(name="node0", cpus=cpus, workers=WORKERS, chief=True),))
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    paths = (("numpy", sgd_constant), ("keras", sgd_cosine))
    out: dict = {"startup_s": {}, "load_s": {}, "keras_minus_numpy_s": {}}
    print("\ntrial start-up, consecutive trials on a fresh pool (s)")
    print("model | path | round | trials")
    for name in models:
        for r in range(rounds):
            for path, optimizer in (paths if r % 2 == 0 else paths[::-1]):
                pool = WorkerPool(ClusterBinding.bind(local))
                md = dataclasses.replace(zoo.get_model_def(name), optimizer_fn=optimizer)
                check_model_optimizer(md)   # as every command does before Ray starts (it imports Keras)
                runner = RayRunner(md, local, warmup=1, steps=2, max_steps=2, pool=pool)
                t0 = time.perf_counter()
                model = runner.model   # the workers start and load the model (as a tuning run's first step)
                out["load_s"].setdefault(f"{name}/{path}", []).append(time.perf_counter() - t0)
                strategy = get_builder("ps").build(model, local)
                times = []
                for _ in range(trials):
                    trial = runner.run([strategy])[0]
                    if not trial.ok:
                        raise SystemExit(f"{name} {path}: {trial.status}: {trial.error}")
                    times.append(trial.meta["startup_s"])
                pool.kill_all()
                out["startup_s"].setdefault(f"{name}/{path}", []).append(times)
                print(f"{name} | {path} | {r} | load {out['load_s'][f'{name}/{path}'][-1]:.2f}, trials "
                      + " ".join(f"{t:.2f}" for t in times))
        runs = {p: out["startup_s"][f"{name}/{p}"] for p, _ in paths}
        loads = {p: out["load_s"][f"{name}/{p}"] for p, _ in paths}
        first = [k[0] - n[0] for k, n in zip(runs["keras"], runs["numpy"])]
        # the first trial from nothing: the workers' load (the PS actors import Keras beside it) and its start-up
        whole = [lk + k[0] - ln - n[0] for lk, k, ln, n in zip(loads["keras"], runs["keras"], loads["numpy"],
                                                               runs["numpy"])]
        later = [k[i] - n[i] for k, n in zip(runs["keras"], runs["numpy"]) for i in range(1, trials)]
        out["keras_minus_numpy_s"][name] = {"first_trial": first, "load_and_first_trial": whole,
                                            "later_trials": later}
        print(f"{name}: Keras path minus numpy rules, first trial " + " ".join(f"{d:+.2f}" for d in first)
              + "; load + first trial " + " ".join(f"{d:+.2f}" for d in whole)
              + (f"; later trials median {statistics.median(later):+.2f} [{min(later):+.2f}, {max(later):+.2f}]"
                 if later else ""))
    ray.shutdown()
    return out


def _pair_pool():
    """The two-node ``pair`` cluster on this machine (a worker each) and a warm pool on it."""
    import ray

    from autosync.runtime.binding import ClusterBinding
    from autosync.runtime.engine import WorkerPool
    from strategy_space import ClusterSpec, NodeSpec

    cpus = os.cpu_count() or 1
    pair = ClusterSpec(name="pair", nodes=tuple(
        NodeSpec(name=f"node{i}", cpus=max(1, cpus // WORKERS), workers=1, chief=i == 0) for i in range(WORKERS)))
    if not ray.is_initialized():
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    return pair, WorkerPool(ClusterBinding.bind(pair))


def sparse_bytes(steps: int, warmup: int, out: str | None = None, models=SPARSE_ZOO) -> None:
    """Bytes per step per worker of the sparse variables on PS vs rows touched x width."""
    from _testbed import git_commit, write_json
    from autosync.models import zoo
    from autosync.runtime.optimizer_config import keras_optimizer_config
    from autosync.runtime.optimizers import squares_slices
    from autosync.runtime.runner import RayRunner
    from strategy_space.builders import get_builder

    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    commit = git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    pair, pool = _pair_pool()
    print(f"\nsparse variables on parameter servers ('ps' strategy, {WORKERS} workers, {steps} timed steps): "
          f"bytes per step per worker vs rows touched x width")
    print(" | ".join(("model", "optimizer", "sparse vars", "pulled whole", "rows/step", "repeated rows/step",
                      "min each way KB", "exact min sent KB", "sent KB", "sent x", "sent x exact", "received KB",
                      "received x")))
    results = {"meta": {"commit": commit, "started": started, "cluster": "local, 2 workers as 2 nodes",
                        "strategy": "ps", "warmup": warmup, "steps": steps,
                        "minimum": "rows touched x width, each direction; exact (sent): plus rows repeated in the "
                                   "worker's batch x width where the optimizer squares each slice"},
               "models": {}}
    for name in models:
        md = zoo.get_model_def(name)
        runner = RayRunner(md, pair, warmup=warmup, steps=steps, pool=pool, trial_timeout_s=600)
        spec = runner.model
        trial = runner.run([get_builder("ps").build(spec, pair)])[0]
        if not trial.ok:
            print(f"{name} | failed: {trial.error}")
            continue
        moved = trial.meta["bytes_per_step_per_worker"]
        dense = sum(v.bytes for v in spec.variables if not v.sparse)  # whole, each direction
        touched, repeated = rows_touched(md, WORKERS, warmup, steps)
        width = {v: spec.var(v).bytes / spec.var(v).shape[0] for v in touched}
        minimum = sum(rows * width[v] for v, rows in touched.items())
        config = keras_optimizer_config(md.optimizer_fn())
        squares = squares_slices(config)
        exact = minimum + (sum(rows * width[v] for v, rows in repeated.items()) if squares else 0.0)
        sent, received = moved["bytes_sent"] - dense, moved["bytes_received"] - dense
        print(" | ".join([name, config["class"], str(len(touched)), str(len(trial.meta["full_pull"])),
                          f"{sum(touched.values()):.0f}", f"{sum(repeated.values()):.0f}", f"{minimum / 1e3:.1f}",
                          f"{exact / 1e3:.1f}", f"{sent / 1e3:.1f}", f"{sent / minimum:.2f}", f"{sent / exact:.2f}",
                          f"{received / 1e3:.1f}", f"{received / minimum:.2f}"]))
        for var, why in trial.meta["full_pull"].items():
            print(f"    {var}: pulled whole, because {why}")
        results["models"][name] = {
            "run_started": started, "commit": commit, "optimizer": config["class"], "squares_slices": squares,
            "sparse_variables": len(touched), "pulled_whole": trial.meta["full_pull"],
            "rows_per_step": sum(touched.values()), "repeated_rows_per_step": sum(repeated.values()),
            "minimum_bytes": minimum, "exact_minimum_sent_bytes": exact, "dense_bytes": dense,
            "sent_bytes": sent, "received_bytes": received, "sent_x": sent / minimum, "sent_x_exact": sent / exact,
            "received_x": received / minimum}
        if out:
            write_json(out, results)
    pool.kill_all()


def _write_run(path: str, started: str, meta: dict, result: dict) -> None:
    """One run's figures as JSON: its commit and start at the top (tests/test_results_provenance.py)."""
    from _testbed import git_commit, write_json

    write_json(path, {"commit": git_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "run_started": started, "what_else_ran": os.environ.get("AUTOSYNC_BENCH_NOTE", ""),
                      "meta": meta, **result})


CHECKPOINT_ZOO = ("ncf", "dlrm", "lm1b")


@contextlib.contextmanager
def _peak_private(found: list):
    """Append the highest private (anonymous) memory of this process inside the block, MiB,
    sampled every 20 ms from ``/proc/self/status``: ``ru_maxrss`` also counts the object
    store's shared pages the driver mapped while it wrote or read them."""
    import threading

    stop, peak = threading.Event(), [0.0]

    def sample():
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]) / 1024)
            if stop.wait(0.02):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        found.append(peak[0])


@contextlib.contextmanager
def _timing(owner, name: str, seconds: list):
    """Append the duration of every call of ``owner.name`` to ``seconds`` inside the block."""
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, real)


def checkpoint_cost(repeat: int, models=CHECKPOINT_ZOO) -> dict:
    """``Trainer.save`` seconds per GiB of state, per zoo model (see the module doc)."""
    import tempfile

    from autosync.models import zoo
    from autosync.runtime.plan import model_spec_from_vars
    from autosync.runtime.session_state import BATCH_BYTES
    from autosync.runtime.trainer import Trainer
    from strategy_space.builders import get_builder

    pair, pool = _pair_pool()
    out = {}
    print(f"Trainer.save ('ps' strategy, {WORKERS} workers as 2 nodes, median of {repeat} saves, actors read "
          f"{BATCH_BYTES / 2 ** 20:.0f} MiB at a time)")
    print(" | ".join(("model", "optimizer", "state MiB", "save s", "read actors s", "write files s", "s per GiB",
                      "restore s", "peak RSS MiB", "peak private MiB", "re-cut restore s",
                      "re-cut peak private MiB")))
    try:
        for name in models:
            md = zoo.get_model_def(name)
            pool.ensure(md, pair.devices)
            spec = model_spec_from_vars(md.name, pool.description["variables"], md.batch_size)
            strategy = get_builder("ps").build(spec, pair)
            private, recut_private, timed = [], [], []
            with tempfile.TemporaryDirectory(prefix="autosync-ckpt-") as tmp:
                path = os.path.join(tmp, "ckpt")
                with _peak_private(private):
                    with Trainer(md, strategy, pair, pool=pool) as trainer:
                        trainer.fit(steps=1)
                        rows = []
                        for _ in range(repeat):
                            info = trainer.save(path)
                            rows.append((info.seconds, info.read_seconds, info.seconds - info.read_seconds))
                    # a restore: the started actors loaded from the checkpoint (``Trainer._restore``)
                    with _timing(Trainer, "_restore", timed), Trainer(md, strategy, pair, pool=pool,
                                                                       restore=path) as again:
                        assert again.step == 1, again.step
                # the same checkpoint under another strategy: its optimizer state re-cut (``reshard``)
                recut = get_builder("partitioned_ps").build(spec, pair)
                with _peak_private(recut_private), _timing(Trainer, "_restore", timed), \
                        Trainer(md, recut, pair, pool=pool, restore=path) as again:
                    assert again.step == 1, again.step
            restore_s, recut_s = timed
            seconds, read_s, write_s = (statistics.median(c) for c in zip(*rows))
            gib = info.bytes / 2 ** 30
            # the driver's high-water mark (it writes and reads the files): bounded by the batch,
            # not the model's weights or the optimizer state (no Keras model in the driver where
            # worker 0 lays the weights file out: ``weights_file``)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10
            out[name] = {"bytes": info.bytes, "save_s": seconds, "read_s": read_s, "write_s": write_s,
                         "s_per_gib": seconds / gib, "restore_s": restore_s,
                         "driver_peak_rss_mib": peak, "driver_peak_private_mib": private[0],
                         "recut_restore_s": recut_s, "recut_driver_peak_private_mib": recut_private[0]}
            print(" | ".join([name, pool.description["optimizer"]["class"], f"{info.bytes / 2 ** 20:.1f}",
                              f"{seconds:.3f}", f"{read_s:.3f}", f"{write_s:.3f}", f"{seconds / gib:.2f}",
                              f"{restore_s:.2f}", f"{peak:.0f}", f"{private[0]:.0f}", f"{recut_s:.2f}",
                              f"{recut_private[0]:.0f}"]))
    finally:
        pool.kill_all()
    return out


if __name__ == "__main__":
    main()
