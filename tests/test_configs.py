"""Every YAML file in configs/ loads; every example strategy validates against the model and
cluster its file name names (``MODEL__CLUSTER__WHAT.yaml``)."""
import glob
import os

import pytest

from strategy_space import load, load_cluster_spec, load_model_spec, validate
from tests.conftest import CONFIGS

FILES = sorted(glob.glob(os.path.join(CONFIGS, "**", "*.yaml"), recursive=True))


def test_configs_present():
    kinds = {os.path.basename(os.path.dirname(f)) for f in FILES}
    assert {"clusters", "strategies"} <= kinds


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, CONFIGS))
def test_config_loads(path):
    obj = load(path)
    folder = os.path.relpath(path, CONFIGS).split(os.sep)[0]
    expected = {"clusters": "cluster", "models": "model", "strategies": "strategy"}[folder]
    assert obj.to_dict()["kind"] == expected
    if folder == "strategies":
        model_name, cluster_name, _ = os.path.basename(path).split("__")
        model = load_model_spec(os.path.join(CONFIGS, "models", model_name + ".yaml"))
        cluster = load_cluster_spec(os.path.join(CONFIGS, "clusters", cluster_name + ".yaml"))
        validate(obj, model, cluster)
