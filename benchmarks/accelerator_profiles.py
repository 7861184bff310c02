"""Model-spec YAMLs with compute profiles measured on an accelerator, for emulated compute.

Reads the runs ``accelerator_step_time.py`` wrote on a GPU machine (a result file holding them as
``{"runs": {NAME: run}}``, or one run's JSON) and, for every zoo model and size they timed, writes
``OUT_DIR/NAME-SIZE.yaml``: the model's ModelSpec (built here with TensorFlow, as ``autosync
inspect`` builds it), whose profile is

* ``step_time_s``: the median over the runs of the device's busy time per forward+backward step
  (the GPU's own work; the eager host dispatch of Keras' torch backend, which TensorFlow's graph
  runtime does not pay, is left out: ``--wall`` takes the wall-clock median instead);
* ``ready_order``: the gradient-ready order of TensorFlow's traced gradient step (a property of
  the graph, not of the device);
* ``device``: the device the runs name.

    python3 benchmarks/accelerator_profiles.py benchmarks/results/accelerator_step_time_h200.json \
        --out-dir configs/models/nvidia-h200

Then ``autosync tune --model configs/models/nvidia-h200/bert-full.yaml --compute emulated ...``
runs trials whose workers take the GPU's time per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_runs(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    if "runs" not in data:
        return [data]
    return list(data["runs"].values()) if isinstance(data["runs"], dict) else data["runs"]


def measured_times(runs: list[dict], *, wall: bool) -> dict[str, tuple[float, str, int]]:
    """``{source: (median step time, device, runs)}`` over the float32 entries of every run that
    measured what is asked (device busy time, or wall-clock)."""
    key = "step_time_s" if wall else "device_busy_s"
    found: dict[str, list[float]] = {}
    device: dict[str, str] = {}
    for run in runs:
        for source, entry in run["models"].items():
            if "@" in source or key not in entry:
                continue
            found.setdefault(source, []).append(float(entry[key]))
            device.setdefault(source, run["meta"]["device"])
    return {s: (statistics.median(v), device[s], len(v)) for s, v in found.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="accelerator_step_time.py output, or a file of such runs")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--wall", action="store_true", help="profile the wall-clock median, not the device's busy time")
    p.add_argument("--only", default="", help="comma-separated sources to write (default: all measured)")
    args = p.parse_args(argv)

    from autosync.models.ingest import built_model_spec
    from autosync.models.profile import gradient_ready_order
    from autosync.models.zoo import get_model_def
    from strategy_space import ComputeProfile
    from strategy_space.yaml_io import save

    times = measured_times(load_runs(args.results), wall=args.wall)
    only = set(filter(None, args.only.split(",")))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for source, (step_s, device, n) in sorted(times.items()):
        if only and source not in only:
            continue
        spec, model, loss, inputs, targets = built_model_spec(get_model_def(source))
        order = gradient_ready_order(model, loss, inputs, targets)
        spec = replace(spec, profile=ComputeProfile(step_time_s=round(step_s, 6), device=device, ready_order=order))
        path = args.out_dir / f"{spec.name}.yaml"
        save(spec, path)
        print(f"{path}: {step_s * 1e3:.2f} ms ({'wall' if args.wall else 'device busy'}, median of {n} runs) "
              f"on {device}, {len(spec.variables)} variables", flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
