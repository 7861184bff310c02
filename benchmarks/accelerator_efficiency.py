"""Statistical efficiency of a strategy's compressors on the model itself, where Ray and TensorFlow
are not installed: an accelerator host whose Python holds PyTorch (the GPU machines this project is
lent), for models too big to train on the CPU workers of the tuning machine (lm1b-full).

``autosync tune --probe-model`` estimates a model-spec YAML's efficiency on a smaller trainable
stand-in. This script measures it on the full model instead: W data-parallel workers simulated in
one process. Each step every worker computes its gradient on its own batch
(``model_def.batches(w, W)``, Keras 3 on its torch backend running the zoo's own builders, loss
and data); the compressed members' gradients are reduced by the product's own all-reduce channel
(``AllReduceChannel.reduce``, one per worker, ranks as threads: ``autosync.runtime.sync.inprocess``),
so compression, error feedback and PowerSGD's warm start are exactly what a trial runs; the other
members are averaged on the device (what an uncompressed all-reduce delivers); the mean gradient is
applied by the model's own Keras optimizer. The lossless twin trains the same way with every
compressor off, from the same initial weights on the same batches, and E comes from the two loss
curves as ``tune`` computes it (``tuner.records.goodput.estimate_efficiency``).

``--whole-variables`` moves the strategy's lossy parts onto whole variables (every other variable
exact), as ``autosync.probe.StandInProber`` does on a stand-in; with a smaller model's source it
repeats the stand-in's probe here, so the stand-in's estimate and the model's own E can be compared.

Refused (exit 2): stale or asynchronous parameter servers (their effect depends on timing, which one
process does not have); a strategy naming variables the model lacks.

    python3 benchmarks/accelerator_efficiency.py --model "lm1b?size=full" --strategy S.yaml \\
        [--spec configs/models/nvidia-h200/lm1b-full.yaml] [--workers 3] [--steps 200] [--seed 0] \\
        [--whole-variables] --out /tmp/e.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._rows import commit  # noqa: E402
from strategy_space import ModelSpec, Strategy, VariableSpec  # noqa: E402
from strategy_space.errors import ConfigError  # noqa: E402
from tuner.records.goodput import estimate_efficiency, lossless_twin, lossy_parts  # noqa: E402


def model_spec(name: str, variables, spec: ModelSpec | None) -> ModelSpec:
    """The ModelSpec of the Keras model's trainable ``variables``; sparse flags from ``spec``
    (the model's spec YAML), whose names and shapes must match."""
    found = {v.path: tuple(int(d) for d in v.shape) for v in variables}
    if spec is None:
        return ModelSpec(name=name, batch_size=1, variables=tuple(
            VariableSpec(name=n, shape=s, dtype="float32") for n, s in found.items()))
    problems = [f"{v.name}: spec {v.shape}, model {found.get(v.name)}" for v in spec.variables
                if found.get(v.name) != tuple(v.shape)]
    problems += [f"{n}: in the model, not in the spec" for n in found if n not in {v.name for v in spec.variables}]
    if problems:
        raise ConfigError(f"the spec {spec.name} does not describe the model {name}: " + "; ".join(problems[:5])
                          + " (give the spec YAML of this model and size)")
    return spec


def on_whole_variables(strategy: Strategy, model: ModelSpec) -> Strategy:
    """``strategy``'s lossy parts moved onto whole variables of ``model`` by name, as the stand-in
    prober moves them (``autosync.probe.move_lossy_parts``; every other variable exact)."""
    from autosync.probe import move_lossy_parts
    from autosync.sources import load_cluster

    missing = sorted({n for n, _, _ in lossy_parts(strategy).compressed} - {v.name for v in model.variables})
    if missing:
        raise ConfigError(f"the strategy compresses variables the model {model.name} lacks: {', '.join(missing[:5])}")
    return move_lossy_parts(strategy, model, load_cluster("local"))


def check_lossy_parts(strategy: Strategy, source: str) -> None:
    """Refuses a strategy without compressors, or with lossy parts one process cannot simulate."""
    parts = lossy_parts(strategy)
    if parts.stale or parts.asynchronous:
        raise ConfigError(f"{source} has stale or asynchronous parameter servers: their effect depends on "
                          "timing, which one simulated process does not have; probe it with 'autosync probe' "
                          "on a cluster")
    if not parts.compressed:
        raise ConfigError(f"{source} compresses nothing: its E is 1 by construction")


def check(strategy: Strategy, model: ModelSpec) -> None:
    """Refuses a strategy whose variables are not the model's."""
    names, configured = {v.name for v in model.variables}, {c.name for c in strategy.variables}
    if configured != names:
        raise ConfigError(f"the strategy's variables are not the model {model.name}'s: lacking in the model "
                          f"{', '.join(sorted(configured - names)[:5]) or 'none'}, without a config "
                          f"{', '.join(sorted(names - configured)[:5]) or 'none'} (use --whole-variables to move "
                          "its lossy parts onto a model by variable name)")


def compressed_members(strategy: Strategy, model: ModelSpec):
    """The compressed all-reduce members of ``SyncPlan``'s plan for ``strategy`` (sparse
    variables are never compressed), moved onto the in-process backend ``thread``."""
    from autosync.runtime.plan import SyncPlan
    from autosync.runtime.sync.allreduce import ARGroup
    from autosync.sources import load_cluster

    groups = [ARGroup(g.group, tuple(dataclasses.replace(m, backend="thread") for m in g.members
                                     if m.compressor.kind != "none"))
              for g in SyncPlan.build(strategy, model, load_cluster("local")).ar_groups]
    return [g for g in groups if g.members]


def train(model_def, strategy: Strategy, model: ModelSpec | None, spec: ModelSpec | None, *, workers: int,
          steps: int, seed: int, whole: bool, budget_s: float | None = None, progress: int = 0) -> dict:
    """Per-step losses (mean over workers) of ``steps`` simulated data-parallel steps, fewer if
    ``budget_s`` runs out first; every ``progress`` steps the seconds spent so far in each phase are
    printed (gradients, copies to the host, the channel's reduce, the optimizer)."""
    import keras
    import numpy as np
    import torch

    from autosync.runtime.sync.allreduce import AllReduceChannel
    from autosync.runtime.sync.inprocess import ThreadBackend, run_ranks

    keras.utils.set_random_seed(seed)
    net = model_def.model_fn()
    loss_fn, optimizer = model_def.loss(), model_def.optimizer_fn()
    variables = list(net.trainable_variables)
    model = model or model_spec(model_def.name, variables, spec)
    if whole:
        strategy = on_whole_variables(strategy, model)
    check(strategy, model)
    groups = compressed_members(strategy, model)
    setup = ThreadBackend.prepare(workers, "efficiency")
    channels = [AllReduceChannel(r, workers, groups, {}, {}, {}, seed=seed,
                                 backends={"thread": ThreadBackend.connect(r, workers, setup)})
                for r in range(workers)]
    lossy_vars = sorted({m.key[0] for g in groups for m in g.members})
    data = [model_def.batches(w, workers) for w in range(workers)]
    optimizer.build(variables)
    losses, started = [], time.perf_counter()
    phases = dict.fromkeys(("gradients", "to_host", "reduce", "apply"), 0.0)

    def lap(phase, since):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        phases[phase] += now - since
        return now

    for step in range(steps):
        if budget_s is not None and step >= 2 and time.perf_counter() - started > budget_s:
            break
        t = time.perf_counter()
        total, local, step_loss = None, [], 0.0
        for w in range(workers):
            x, y = next(data[w])
            x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
            y = keras.tree.map_structure(keras.ops.convert_to_tensor, y)
            value = loss_fn(y, net(x, training=True))
            grads = torch.autograd.grad(value, [v.value for v in variables], allow_unused=True)
            grads = [torch.zeros_like(v.value) if g is None else g for g, v in zip(grads, variables)]
            step_loss += float(value.detach()) / workers
            t = lap("gradients", t)
            local.append([np.array(grads[i].detach().cpu().numpy(), copy=True) if i in lossy_vars else None
                          for i in range(len(variables))])
            # the copies above are taken: worker 0's gradients become the running sum in place
            total = list(grads) if total is None else [s.add_(g) for s, g in zip(total, grads)]
            del grads, value   # one worker's gradients alive at a time (lm1b-full's are 3.3 GB)
            t = lap("to_host", t)
        mean = [s.div_(workers) for s in total]
        del total
        if groups:
            reduced = run_ranks(workers, lambda r: channels[r].reduce(step, local[r]))[0]
            for g in groups:
                for m in g.members:
                    target = mean[m.key[0]]
                    index = (slice(None),) * m.axis + (slice(m.start, m.stop),)
                    target[index] = torch.as_tensor(np.asarray(reduced[m.key]), device=target.device)
        t = lap("reduce", t)
        optimizer.apply(mean, variables)
        lap("apply", t)
        losses.append(step_loss)
        if progress and (step + 1) % progress == 0:
            print(f"  step {step + 1}: {time.perf_counter() - started:.1f} s, loss {step_loss:.4f}; "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()), flush=True)
        if not np.isfinite(step_loss):
            break
    seconds = time.perf_counter() - started
    del net, variables, optimizer
    keras.backend.clear_session()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"losses": losses, "seconds": seconds, "model": model, "strategy": strategy,
            "phases_s": {k: round(v, 2) for k, v in phases.items()}}


def measure(source: str, strategy: Strategy, spec: ModelSpec | None, *, workers: int, steps: int, seed: int,
            whole: bool, budget_s: float | None = None, progress: int = 0) -> dict:
    """E of ``strategy``'s compressors on the zoo model ``source``: it and its lossless twin trained.
    With ``budget_s``, the candidate stops early once 60 % of it is spent (the twin, without the
    host's compression work, is faster) and the twin trains as many steps."""
    from autosync.models.zoo import get_model_def

    model_def = get_model_def(source)
    cand = train(model_def, strategy, None, spec, workers=workers, steps=steps, seed=seed, whole=whole,
                 budget_s=None if budget_s is None else 0.6 * budget_s, progress=progress)
    twin = train(model_def, lossless_twin(cand["strategy"]), cand["model"], spec, workers=workers,
                 steps=len(cand["losses"]), seed=seed, whole=False, progress=progress)
    e = estimate_efficiency(cand["losses"], twin["losses"])
    parts = lossy_parts(cand["strategy"])
    return {"model": source, "model_name": cand["model"].name, "workers": workers, "steps": len(cand["losses"]),
            "steps_asked": steps, "seed": seed,
            "whole_variables": whole, "lossy_parts": [list(p) for p in parts.compressed],
            "efficiency": e.value, "interval": [e.low, e.high], "note": e.note,
            "candidate_loss": cand["losses"], "twin_loss": twin["losses"],
            "candidate_s": round(cand["seconds"], 1), "twin_s": round(twin["seconds"], 1),
            "candidate_phases_s": cand["phases_s"], "twin_phases_s": twin["phases_s"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="zoo model and size, e.g. 'lm1b?size=full'")
    p.add_argument("--strategy", required=True, help="strategy YAML whose compressors are probed")
    p.add_argument("--spec", help="the model's spec YAML (sparse flags; names and shapes checked)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, help="stop early (fewer steps, both runs) to fit this many seconds")
    p.add_argument("--progress", type=int, default=0, help="print the phases' seconds every N steps")
    p.add_argument("--whole-variables", action="store_true",
                   help="compress whole variables, as the stand-in prober does")
    p.add_argument("--out", required=True, help="JSON to write (an existing one gets this run added)")
    args = p.parse_args(argv)
    from strategy_space.yaml_io import load_model_spec, load_strategy

    try:
        if not 1 <= args.workers <= 64 or not 2 <= args.steps <= 100_000:
            raise ConfigError(f"--workers {args.workers} must be 1..64 and --steps {args.steps} 2..100000")
        strategy = load_strategy(args.strategy)
        spec = load_model_spec(args.spec) if args.spec else None
        check_lossy_parts(strategy, args.strategy)
        os.environ.setdefault("KERAS_BACKEND", "torch")   # before Keras is imported
        import keras
        import torch
        from threadpoolctl import threadpool_limits

        from benchmarks.accelerator_step_time import _device

        torch.backends.cuda.matmul.allow_tf32 = True   # as TensorFlow on GPUs that have it
        started = datetime.now(timezone.utc)
        # the W ranks compress in parallel threads, each on one BLAS thread rather than W pools
        # sharing the cores: lm1b-full's compressed matrices, 3 ranks on this 2-core machine (idle,
        # 5 steps each), 0.28-0.40 s a step against 0.27-0.65 s; the H200 host took about 1 s a
        # step without the limit (with it: not yet measured there)
        with threadpool_limits(1, user_api="blas"):
            result = measure(args.model, strategy, spec, workers=args.workers, steps=args.steps, seed=args.seed,
                             whole=args.whole_variables, budget_s=args.budget_s, progress=args.progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(strategy_file=args.strategy, spec_file=args.spec, commit=commit(),
                  started=started.isoformat(timespec="seconds"), keras=keras.__version__,
                  torch=torch.__version__, python=platform.python_version(), **_device())
    out = Path(args.out)
    kept = json.loads(out.read_text()) if out.exists() else {"script": "benchmarks/accelerator_efficiency.py", "runs": {}}
    kept["runs"][f"run {len(kept['runs']) + 1}"] = result   # each run its own entry, never merged
    out.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{args.model}{' (whole variables)' if args.whole_variables else ''}: E = {result['efficiency']:.3f} "
          f"[{result['interval'][0]:.3f}, {result['interval'][1]:.3f}] over {result['steps']} steps x {args.workers} "
          f"workers; final loss {result['candidate_loss'][-1]:.4f} vs twin {result['twin_loss'][-1]:.4f}; "
          f"{result['candidate_s']} + {result['twin_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
