"""Time to a target loss: what a user buys, measured for a few contenders on one model.

The target is the loss the reference (the best lossless baseline) reaches after ``steps`` steps:
the mean of its last ``window`` step losses. Each contender then trains from the same start (same
seed, same data streams) until the mean of its last ``window`` losses is at most the target, or
``cap`` steps. Its time to target is the wall time from the end of its first step (which pays the
workers' tracing, as the peer's first step does) to the end of the step where it crossed; steps
to target is that step's number. Contenders run ``repeats`` times, interleaved, on fresh workers.

AutoSync's contenders train through ``autosync.make_trainer``; the peer (Ray Train's
TensorflowTrainer, ``_peer.measure_peer(target=...)``) trains the same model on the same batches.
"""
from __future__ import annotations

import math
import statistics

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}   # t(0.975, df)


def crossing(losses: list, target: float, window: int) -> int | None:
    """The first step (0-based) where the mean of the last ``window`` losses is <= ``target``."""
    total = 0.0
    for i, loss in enumerate(losses):
        total += loss
        if i >= window:
            total -= losses[i - window]
        if i + 1 >= window and total / window <= target:
            return i
    return None


def log_t_interval(values: list) -> list | None:
    """95 % interval of the typical value of ``values`` (t-interval of their logs); None under 2."""
    xs = [math.log(v) for v in values if v]
    if len(xs) < 2:
        return None
    m, sd = statistics.mean(xs), statistics.stdev(xs)
    h = T95.get(len(xs) - 1, 1.96) * sd / math.sqrt(len(xs))
    return [math.exp(m - h), math.exp(m + h)]


def _autosync_run(source: str, strategy, cluster, steps: int, target: float | None, window: int) -> dict:
    """Train ``strategy`` for ``steps`` steps (until ``target`` if given); losses and wall times."""
    from autosync.api import make_trainer

    with make_trainer(source, strategy, cluster, timeout_s=600.0) as trainer:
        def stop_at_target(step, logs):
            seen.append(logs["loss"])
            if target is not None and len(seen) >= window and sum(seen[-window:]) / window <= target:
                trainer.stop_training = True

        seen: list = []
        history = trainer.fit(steps, callbacks=[stop_at_target])
    return {"losses": list(history.loss), "ends": list(history.wall_times)}


def _outcome(run: dict, target: float, window: int) -> dict:
    losses, ends = run["losses"], run["ends"]
    at = crossing(losses, target, window)
    tail = losses[-window:]
    return {"reached": at is not None, "steps_to_target": None if at is None else at + 1,
            "time_to_target_s": None if at is None else ends[at] - ends[0],
            "steps_run": len(losses), "final_smoothed_loss": sum(tail) / len(tail) if tail else None,
            "median_step_s": statistics.median([b - a for a, b in zip(ends, ends[1:])]) if len(ends) > 1 else None}


def time_to_target(source: str, cluster, reference, contenders: dict, *, steps: int, window: int, cap: int,
                   repeats: int, peer: bool, say) -> dict:
    """Target from ``reference`` (a Strategy), then each of ``contenders`` (name -> Strategy) and,
    with ``peer``, Ray Train's TensorflowTrainer, ``repeats`` times each; see the module doc."""
    import _peer

    ref = _autosync_run(source, reference, cluster, steps, None, window)
    target = sum(ref["losses"][-window:]) / window
    say(f"  target loss {target:.4f} (mean of the reference's last {window} of {steps} steps)")
    out: dict = {"target_loss": target, "reference_steps": steps, "window": window, "cap": cap,
                 "reference_losses": ref["losses"], "contenders": {}}
    names = list(contenders) + (["ray_train"] if peer else [])
    runs: dict = {n: [] for n in names}
    for r in range(repeats):
        for name in names:
            if name == "ray_train":
                got = _peer.measure_peer(source, cluster, warmup=0, steps=0, target=target, window=window, cap=cap)
                if got["status"] != "ok":
                    runs[name].append({"reached": False, "error": got.get("error")})
                    say(f"  {name} {r + 1}/{repeats}: failed: {(got.get('error') or '')[:160]}")
                    continue
                result = _outcome(got, target, window)
            else:
                result = _outcome(_autosync_run(source, contenders[name], cluster, cap, target, window), target, window)
            runs[name].append(result)
            say(f"  {name} {r + 1}/{repeats}: " + (f"{result['time_to_target_s']:.1f} s, {result['steps_to_target']} steps"
                                                  if result["reached"] else
                                                  f"not reached in {result['steps_run']} steps "
                                                  f"(loss {result['final_smoothed_loss']:.4f})"))
    for name, got in runs.items():
        times = [g["time_to_target_s"] for g in got if g.get("reached")]
        out["contenders"][name] = {"runs": got, "time_to_target_s": statistics.median(times) if len(times) == len(got)
                                   else None, "time_to_target_ci95_s": log_t_interval(times),
                                   "reached": f"{len(times)}/{len(got)}"}
    return out


def projected(steps: int, contenders: dict) -> dict:
    """Time to target projected from step times and statistical efficiencies, for compute that
    does not train (emulated) and, beside the measurement, to check the projection with real
    compute: a contender of efficiency E needs ``steps / E`` steps to the loss its lossless twin
    reaches in ``steps``, each taking its measured median step time.

    Args:
        steps: the reference's steps to the target (the target is the best lossless baseline's
            loss after ``steps`` steps, so its own E is 1 by definition).
        contenders: name -> ``(median step seconds or None, E or None)``.

    Returns:
        ``{"reference_steps": steps, "contenders": {name: {"median_step_s", "statistical_efficiency",
        "steps_to_target", "time_to_target_s"}}}``; a contender missing a figure gets None.
    """
    out: dict = {"reference_steps": steps, "method": "steps / statistical efficiency x median step time",
                 "contenders": {}}
    for name, (step_s, e) in contenders.items():
        known = step_s is not None and e is not None and e > 0
        out["contenders"][name] = {"median_step_s": step_s, "statistical_efficiency": e,
                                   "steps_to_target": steps / e if known else None,
                                   "time_to_target_s": steps / e * step_s if known else None}
    return out
