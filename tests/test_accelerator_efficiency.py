"""``benchmarks/accelerator_efficiency.py``: a strategy's E measured on the model itself, W workers
simulated in one process with the product's all-reduce channel (what ran on the lent GPU machine,
where neither TensorFlow nor Ray is installed).

Fast: the compressed members are the ones ``SyncPlan`` plans for the same strategy; whole variables
carry the lossy parts the stand-in prober moves; the refusals. Integration: the script trains a
small zoo model on Keras' torch backend with TensorFlow and Ray unimportable, and the candidate and
its twin start from the same weights on the same batches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from strategy_space import PS, Strategy, VarConfig
from strategy_space.errors import ConfigError
from strategy_space.yaml_io import dumps, load_model_spec, load_strategy
from tests.conftest import CONFIGS, REPO
from tuner.records.goodput import lossy_parts

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import accelerator_efficiency as ae  # noqa: E402

SCRIPT = os.path.join(REPO, "benchmarks", "accelerator_efficiency.py")
TUNED = os.path.join(CONFIGS, "strategies", "lm1b_lstm__emulated_3x1gbit__tuned_at_100mbit.yaml")
FULL = os.path.join(CONFIGS, "models", "nvidia-h200", "lm1b-full.yaml")
SMALL = os.path.join(CONFIGS, "models", "nvidia-h200", "lm1b-small.yaml")


def test_reduce_hands_back_the_mean_without_an_update_over_connected_backends():
    """``AllReduceChannel.reduce`` alone: every rank gets the same mean (fp16-rounded where the
    member says fp16), nothing is applied, and backends passed in need no registry entry."""
    import numpy as np

    from autosync.runtime.sync.allreduce import AllReduceChannel, ARGroup, ARMember
    from autosync.runtime.sync.inprocess import ThreadBackend, run_ranks
    from strategy_space.compressor import Compressor

    world = 3
    exact = ARMember((0, 0), 0, 4, 0, 1, False, Compressor.parse("none"), "thread")
    half = ARMember((1, 0), 0, 5, 0, 1, False, Compressor.parse("fp16"), "thread")
    setup = ThreadBackend.prepare(world, "reduce")
    grads = [[np.full((4, 2), r + 1.0, np.float32), np.full(5, (r + 1) / 3, np.float32)] for r in range(world)]

    def rank(r):
        ch = AllReduceChannel(r, world, [ARGroup(0, (exact, half))], {}, {}, {},
                              backends={"thread": ThreadBackend.connect(r, world, setup)})
        return ch.reduce(0, grads[r]), ch._optimizer

    results = run_ranks(world, rank)
    for reduced, optimizer in results:
        assert optimizer is None   # reduce applies nothing
        np.testing.assert_array_equal(reduced[(0, 0)], np.full((4, 2), 2.0, np.float32))
        np.testing.assert_array_equal(reduced[(1, 0)], results[0][0][(1, 0)])
        assert reduced[(1, 0)] == pytest.approx(np.full(5, 2 / 3), abs=1e-3)
        assert not np.array_equal(reduced[(1, 0)], np.full(5, 2 / 3, np.float32))   # fp16 rounding shows


def test_the_compressed_members_are_the_sync_plans_compressed_ones_on_the_thread_backend():
    strategy, spec = load_strategy(TUNED), load_model_spec(FULL)
    members = [m for g in ae.compressed_members(strategy, spec) for m in g.members]
    assert len(members) == 9 and {m.backend for m in members} == {"thread"}
    assert {str(m.compressor) for m in members} == {"fp16", "powersgd(4)", "powersgd_ef(4)"}
    # the recurrent kernel's three row blocks, each compressed on its own
    assert sorted((m.start, m.stop) for m in members if m.key[0] == 2) == [(0, 683), (683, 1366), (1366, 2048)]


def test_whole_variables_carry_the_lossy_parts_onto_the_model_by_name():
    moved = ae.on_whole_variables(load_strategy(TUNED), load_model_spec(SMALL))
    assert [p[:2] for p in lossy_parts(moved).compressed] == [
        ("lstm/lstm_cell/kernel", 0), ("lstm/lstm_cell/recurrent_kernel", 0), ("projection/kernel", 0)]
    assert all(c.num_shards == 1 for c in moved.variables)
    ncf = load_model_spec(os.path.join(CONFIGS, "models", "nvidia-h200", "ncf-small.yaml"))
    with pytest.raises(ConfigError, match="compresses variables the model ncf-small lacks: lstm/lstm_cell/kernel"):
        ae.on_whole_variables(load_strategy(TUNED), ncf)


def test_a_strategy_whose_variables_are_not_the_models_is_refused():
    ncf = load_model_spec(os.path.join(CONFIGS, "models", "nvidia-h200", "ncf-small.yaml"))
    with pytest.raises(ConfigError, match="lacking in the model embedding/embeddings.*--whole-variables"):
        ae.check(load_strategy(TUNED), ncf)
    ae.check(load_strategy(TUNED), load_model_spec(SMALL))   # same names: accepted


def test_a_spec_of_another_size_is_refused():
    full = load_model_spec(FULL)
    small_vars = [SimpleNamespace(path=v.name, shape=v.shape) for v in load_model_spec(SMALL).variables]
    with pytest.raises(ConfigError, match="does not describe the model lm1b: .*recurrent_kernel: spec"):
        ae.model_spec("lm1b", small_vars, full)


@pytest.mark.parametrize("edit, message", [
    ("lossless", "compresses nothing"),
    ("stale", "stale or asynchronous parameter servers"),
    ("missing", "file not found"),
])
def test_refused_before_any_model_is_built(tmp_path, capsys, edit, message):
    strategy = load_strategy(TUNED)
    path = tmp_path / "s.yaml"
    if edit == "lossless":
        from tuner.records.goodput import lossless_twin

        path.write_text(dumps(lossless_twin(strategy)))
    elif edit == "stale":
        configs = tuple(VarConfig(c.name, (PS("node0", staleness=2),)) if c.name == "projection/bias" else c
                        for c in strategy.variables)
        path.write_text(dumps(Strategy(configs)))
    rc = ae.main(["--model", "lm1b?size=small", "--strategy", str(path), "--out", str(tmp_path / "e.json")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "e.json").exists()


def _run(tmp_path, *args):
    code = ("import runpy, sys\n"
            "for m in ('tensorflow', 'ray'): sys.modules[m] = None\n"
            f"sys.argv = ['accelerator_efficiency.py'] + {list(args)!r}\n"
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"KERAS_BACKEND": "torch"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO)


@pytest.mark.integration
def test_the_script_trains_a_candidate_and_its_twin_from_the_same_start_without_tensorflow(tmp_path):
    out = tmp_path / "e.json"
    common = ["--model", "lm1b?size=small", "--strategy", TUNED, "--spec", SMALL, "--workers", "2",
              "--steps", "8", "--out", str(out)]
    for extra in ([], ["--whole-variables"]):
        proc = _run(tmp_path, *common, *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "E = " in proc.stdout
    runs = list(json.loads(out.read_text())["runs"].values())
    assert [r["whole_variables"] for r in runs] == [False, True]   # a second run is added, not merged
    sharded, whole = runs
    assert len(sharded["lossy_parts"]) == 9 and len(whole["lossy_parts"]) == 3
    for r in runs:
        assert r["device"].startswith("cpu:") and r["commit"] and r["started"]
        assert len(r["candidate_loss"]) == len(r["twin_loss"]) == 8
        # the same weights and batches: the first step's loss is the same; compression changes the updates
        assert r["candidate_loss"][0] == pytest.approx(r["twin_loss"][0], rel=1e-6)
        assert r["candidate_loss"][1:] != pytest.approx(r["twin_loss"][1:], rel=1e-7)
        assert 0.0 <= r["interval"][0] <= r["efficiency"] <= r["interval"][1] <= 1.0
