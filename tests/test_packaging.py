"""Issue 17, item 8: the benchmarks run from a README install (``pip install -e ".[bench]"``)."""
from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys

from tests.conftest import REPO


def _setup_kwargs() -> dict:
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def _dist(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_bench_extra_pins_ray_train_to_the_installed_ray():
    bench = _setup_kwargs()["extras_require"]["bench"]
    assert f"ray[train]=={importlib.metadata.version('ray')}" in bench


def test_every_third_party_module_the_benchmarks_import_is_declared():
    kw = _setup_kwargs()
    declared = {_dist(r) for r in kw["install_requires"] + kw["extras_require"]["bench"]}
    owners = importlib.metadata.packages_distributions()
    bench_dir = os.path.join(REPO, "benchmarks")
    # the project's packages and the benchmarks' own helper modules (benchmarks/_*.py)
    local = {"autosync", "strategy_space", "tuner", "benchmarks"} | {
        n[:-3] for n in os.listdir(bench_dir) if n.endswith(".py")}
    missing = {}
    for name in sorted(os.listdir(bench_dir)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(bench_dir, name)).read())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for mod in mods:
                top = mod.split(".")[0]
                if top in local or top in sys.stdlib_module_names:
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                if not dists & declared:
                    missing.setdefault(top, []).append(name)
    assert not missing, f"imported by the benchmarks but not in install_requires or the bench extra: {missing}"


def test_what_the_python_api_raises_is_importable_from_autosync():
    """A training script catches AutoSync's errors by the package's own names, without reaching
    into strategy_space or the runtime's engine (neither imports Ray or TensorFlow for it)."""
    import autosync
    from autosync.runtime.engine import TrialFailed, TrialTimeout
    from strategy_space.errors import ConfigError

    assert (autosync.ConfigError, autosync.TrialFailed, autosync.TrialTimeout) == (ConfigError, TrialFailed,
                                                                                    TrialTimeout)
    assert issubclass(autosync.TrialTimeout, autosync.TrialFailed) and issubclass(autosync.TrialFailed, RuntimeError)
    assert {"ConfigError", "TrialFailed", "TrialTimeout"} <= set(dir(autosync))
