"""GPU-class compute profiles: the committed model specs in ``configs/models/nvidia-h200`` and
``configs/models/nvidia-h100`` are the committed runs on that GPU
(``benchmarks/results/accelerator_step_time_h200.json``, ``..._h100.json``) turned into specs by
``benchmarks/accelerator_profiles.py``; the zoo runs on Keras' torch backend without TensorFlow
(how the GPU runs measured it); emulated compute takes the GPU's step time from such a spec."""
from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from strategy_space.yaml_io import load_model_spec
from tests.conftest import CONFIGS, REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from accelerator_profiles import measured_times  # noqa: E402

RESULT = os.path.join(REPO, "benchmarks", "results", "accelerator_step_time_h200.json")
# each GPU's spec folder, the result file its specs come from, and the device name its runs give
DEVICES = {"nvidia-h200": ("accelerator_step_time_h200.json", "gpu:NVIDIA H200"),
           "nvidia-h100": ("accelerator_step_time_h100.json", "gpu:NVIDIA H100")}
SPECS = sorted(glob.glob(os.path.join(CONFIGS, "models", "nvidia-h*", "*.yaml")))
# the full sizes' specs shipped without a profile, by the name of the zoo model they were made from
SHIPPED = {"bert-full": "bert_base", "dlrm-full": "dlrm", "lm1b-full": "lm1b_lstm", "ncf-full": "ncf",
           "resnet50-full": "resnet50", "vgg16-full": "vgg16"}


def _runs(result: str = RESULT) -> list[dict]:
    with open(os.path.join(REPO, "benchmarks", "results", os.path.basename(result))) as f:
        return list(json.load(f)["runs"].values())


@pytest.mark.parametrize("folder", sorted(DEVICES))
def test_every_zoo_model_and_size_has_a_spec_for_each_gpu(folder):
    from autosync.models.zoo import list_models

    want = {f"{m.name}-{size}" for m in list_models() for size in m.sizes}
    assert {os.path.basename(p)[:-5] for p in SPECS if os.path.basename(os.path.dirname(p)) == folder} == want
    assert {os.path.basename(os.path.dirname(p)) for p in SPECS} == set(DEVICES)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: "/".join(p.split(os.sep)[-2:]))
def test_a_gpu_spec_is_the_median_device_busy_time_of_the_committed_runs(path):
    spec = load_model_spec(path)          # also checks that ready_order lists every variable once
    name, _, size = spec.name.rpartition("-")
    source = f"{name}?size={size}"
    result, device = DEVICES[os.path.basename(os.path.dirname(path))]
    runs = _runs(result)
    busy = [r["models"][source]["device_busy_s"] for r in runs if "device_busy_s" in r["models"].get(source, {})]
    assert len(busy) >= 2, f"{source}: fewer than two runs measured its device busy time"
    assert spec.profile.step_time_s == pytest.approx(statistics.median(busy), abs=6e-7)   # written to the microsecond
    assert spec.profile.device == runs[-1]["meta"]["device"] and spec.profile.device.startswith(device)
    measured = runs[-1]["models"][source]
    assert measured["batch_size"] == spec.batch_size and measured["variables"] == len(spec.variables)
    assert measured["parameters"] == sum(int(np.prod(v.shape)) for v in spec.variables)
    if spec.name in SHIPPED:    # the same variables as the shipped full-size spec (row counts follow the data)
        shipped = load_model_spec(os.path.join(CONFIGS, "models", SHIPPED[spec.name] + ".yaml"))
        assert [(v.name, v.shape, v.dtype, v.sparse) for v in shipped.variables] == \
               [(v.name, v.shape, v.dtype, v.sparse) for v in spec.variables]


def test_measured_times_are_medians_over_the_runs_that_measured_them():
    def run(device, **models):
        return {"meta": {"device": device}, "models": models}

    runs = [run("gpu:A x1", **{"a?size=small": {"step_time_s": 0.5, "device_busy_s": 0.1},
                               "a?size=small@mixed_bfloat16": {"step_time_s": 0.2, "device_busy_s": 0.01},
                               "b?size=small": {"error": "RuntimeError: out of memory"}}),
            run("gpu:A x1", **{"a?size=small": {"step_time_s": 0.7, "device_busy_s": 0.3}}),
            run("gpu:A x1", **{"a?size=small": {"step_time_s": 0.9}})]
    assert measured_times(runs, wall=False) == {"a?size=small": (pytest.approx(0.2), "gpu:A x1", 2)}
    assert measured_times(runs, wall=True) == {"a?size=small": (pytest.approx(0.7), "gpu:A x1", 3)}


@pytest.mark.integration
def test_the_step_time_script_runs_every_small_zoo_model_on_the_torch_backend_without_tensorflow(tmp_path):
    """What ran on the GPU machine, where neither TensorFlow nor Ray is installed: TensorFlow is
    made unimportable in the subprocess, so a zoo model that needs it fails here too."""
    out = tmp_path / "steps.json"
    code = ("import runpy, sys\n"
            "for m in ('tensorflow', 'ray'): sys.modules[m] = None\n"
            f"sys.argv = ['accelerator_step_time.py', '--sizes', 'small', '--warmup', '1', '--timed', '2', "
            f"'--out', {str(out)!r}]\n"
            f"runpy.run_path({os.path.join(REPO, 'benchmarks', 'accelerator_step_time.py')!r}, run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"KERAS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["meta"]["keras_backend"] == "torch" and result["meta"]["device"].startswith("cpu:")
    from autosync.models.zoo import model_names

    assert set(result["models"]) == {f"{n}?size=small" for n in model_names()}
    for source, entry in result["models"].items():
        assert "error" not in entry, (source, entry)
        spec = load_model_spec(os.path.join(CONFIGS, "models", "nvidia-h200", source.replace("?size=", "-") + ".yaml"))
        assert entry["parameters"] == sum(int(np.prod(v.shape)) for v in spec.variables), source
        assert 0 < entry["fastest_s"] <= entry["step_time_s"] <= entry["slowest_s"]


@pytest.mark.integration
def test_emulated_compute_takes_the_gpu_step_time_from_a_gpu_spec(ray_session, tmp_path):
    import autosync
    from autosync.runtime.emulated import emulated_model_def
    from autosync.sources import load_cluster, load_emulated_model
    from tuner.search.model_based import SearchSettings

    path = os.path.join(CONFIGS, "models", "nvidia-h200", "ncf-small.yaml")
    spec = load_emulated_model(path)
    cluster = load_cluster("local")
    assert spec.profile.device.startswith("gpu:NVIDIA H200")
    assert emulated_model_def(spec, cluster).step_time_s == pytest.approx(spec.profile.step_time_s
                                                                          * cluster.compute_dilation)
    result = autosync.tune(path, "local", compute="emulated", trials=1, steps=3, warmup=1, precision=None,
                           confirm=0, warm_start="none", store=tmp_path / "t.db",
                           settings=SearchSettings(batch=1, candidates=16, chains=4, anneal_steps=4))
    assert result.best_trial.ok
    recorded = result.model.profile
    assert (recorded.step_time_s, recorded.ready_order) == (spec.profile.step_time_s, spec.profile.ready_order)
    assert recorded.device == f"emulated {spec.profile.device}"


@pytest.mark.integration
@pytest.mark.parametrize("folder", sorted(DEVICES))
def test_the_spec_writer_rebuilds_a_committed_spec_from_the_committed_runs(tmp_path, folder):
    """``accelerator_profiles.py`` on the committed runs writes what is committed (model spec,
    median device busy time, TensorFlow's traced ready order), byte for byte."""
    result = os.path.join(REPO, "benchmarks", "results", DEVICES[folder][0])
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "accelerator_profiles.py"), result,
                           "--out-dir", str(tmp_path), "--only", "ncf?size=small"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["ncf-small.yaml"]
    with open(os.path.join(CONFIGS, "models", folder, "ncf-small.yaml")) as f:
        assert (tmp_path / "ncf-small.yaml").read_text() == f.read()
