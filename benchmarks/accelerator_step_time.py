"""Every zoo model's forward+backward step time on a machine where TensorFlow is not installed: an
accelerator host whose Python holds PyTorch (the GPU machines this project is lent). Keras 3 runs
the zoo's own model builders there on its torch backend, so the network, batch size and data are
the zoo's; only the framework executing them differs from the TensorFlow runtime's.

What is timed is what ``autosync.models.profile.profile_model`` times on TensorFlow: the gradient of
the loss over every trainable variable on one batch (no optimizer update), ``--warmup`` untimed
steps, then the median of ``--timed`` steps, each ended by a device synchronize. float32 with
TensorFloat-32 matrix products allowed (TensorFlow's default on GPUs that have them); with
``--mixed`` each model is timed again under Keras' ``mixed_bfloat16`` policy (reported only).

Writes one JSON (``--out``): the device, the software versions, and per model and size the median,
fastest and slowest step, parameter count and peak device memory; a model that fails is recorded
with its error and the others go on. ``benchmarks/accelerator_profiles.py`` turns it into model-spec
YAMLs with these step times for emulated compute.

    python3 benchmarks/accelerator_step_time.py --out /tmp/steps.json [--models bert,ncf] [--sizes full]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._rows import commit  # noqa: E402

SIZES = ("small", "full")


def _device() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": f"cpu:{platform.processor() or platform.machine()} x{os.cpu_count()}", "cuda": None}
    props = torch.cuda.get_device_properties(0)
    driver = ""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"device": f"gpu:{props.name} x{torch.cuda.device_count()}", "cuda": torch.version.cuda,
            "driver": driver, "memory_gib": round(props.total_memory / 2 ** 30, 1),
            "multiprocessors": props.multi_processor_count}


def _synchronize():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_busy_s(step, steps: int) -> dict:
    """The device's busy time per step: the union of the intervals in which any kernel, copy or
    fill of ``steps`` profiled steps ran on the GPU (CUPTI's timestamps), divided by ``steps``.
    What the GPU itself needs, without the host's per-operation dispatch of eager execution
    (which TensorFlow's graph runtime does not pay)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
        busy, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        return {"device_busy_s": busy / steps * 1e-6, "profiled_steps": steps, "device_events": len(spans)}
    except Exception as e:  # the wall-clock figures stand without it
        return {"device_busy_error": f"{type(e).__name__}: {str(e)[:300]}"}


def measure(source: str, *, warmup: int, timed: int, policy: str = "float32", profiled: int = 10) -> dict:
    """Median, fastest and slowest forward+backward step of one zoo model (``zoo:`` source)."""
    import keras
    import torch

    from autosync.models.zoo import get_model_def

    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model_def = get_model_def(source)
    model = model_def.model_fn()
    loss = model_def.loss()
    inputs, targets = next(model_def.batches(0, 1))
    inputs = keras.tree.map_structure(keras.ops.convert_to_tensor, inputs)
    targets = keras.tree.map_structure(keras.ops.convert_to_tensor, targets)
    variables = [v.value for v in model.trainable_variables]

    def step():
        value = loss(targets, model(inputs, training=True))
        return torch.autograd.grad(value, variables, allow_unused=True)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    _synchronize()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        step()
        _synchronize()
        times.append(time.perf_counter() - start)
    on_gpu = torch.cuda.is_available()
    busy = _device_busy_s(step, profiled) if on_gpu else {}
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if on_gpu else None
    result = {"step_time_s": statistics.median(times), "fastest_s": min(times), "slowest_s": max(times),
              "timed_steps": timed, "warmup_steps": warmup, "batch_size": model_def.batch_size,
              "parameters": int(sum(torch.numel(v) for v in variables)),
              "variables": len(variables), "peak_memory_gib": None if peak is None else round(peak, 2), **busy}
    del model, variables
    keras.backend.clear_session()
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    from autosync.models.zoo import model_names

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(model_names()), help="comma-separated zoo names (default: all)")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated sizes (default: small,full)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timed", type=int, default=20)
    p.add_argument("--mixed", action="store_true", help="also time each model under mixed_bfloat16")
    p.add_argument("--out", required=True, help="the JSON to write (rewritten after every model)")
    args = p.parse_args(argv)
    import keras
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True   # TensorFlow's default on GPUs with TF32
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    started = datetime.now(timezone.utc)
    out = {"meta": {"commit": commit(), "started": started.isoformat(timespec="seconds"),
                    "script": "benchmarks/accelerator_step_time.py", "argv": sys.argv[1:],
                    "keras": keras.__version__, "keras_backend": keras.backend.backend(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "precision": "float32, TF32 matrix products allowed", **_device()},
           "models": {}}
    policies = ["float32"] + (["mixed_bfloat16"] if args.mixed else [])
    for name in args.models.split(","):
        for size in args.sizes.split(","):
            source = f"{name}?size={size}"
            for policy in policies:
                key = source if policy == "float32" else f"{source}@{policy}"
                t0 = time.perf_counter()
                try:
                    entry = measure(source, warmup=args.warmup, timed=args.timed, policy=policy)
                except Exception as e:  # recorded; the other models go on
                    entry = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                entry["wall_s"] = round(time.perf_counter() - t0, 1)
                out["models"][key] = entry
                shown = (f"{entry['step_time_s'] * 1e3:8.2f} ms [{entry['fastest_s'] * 1e3:.2f}-"
                         f"{entry['slowest_s'] * 1e3:.2f}] {entry['parameters'] / 1e6:7.1f}M params"
                         + (f", device busy {entry['device_busy_s'] * 1e3:.2f} ms" if "device_busy_s" in entry
                            else f", {entry['device_busy_error']}" if "device_busy_error" in entry else "")
                         if "error" not in entry else entry["error"])
                print(f"{key:34s} {shown}", flush=True)
                Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    out["meta"]["wall_s"] = round((datetime.now(timezone.utc) - started).total_seconds(), 1)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
