"""Small dense variables updated together (``runtime.fused``): bit for bit what one update per variable
gives, for every numpy rule, beside large and sparse variables, through a checkpoint's restore and a
live snapshot."""
from __future__ import annotations

import numpy as np
import pytest

from autosync.runtime import fused, optimizer_state
from autosync.runtime.optimizers import make_optimizer

CONFIGS = [
    {"class": "SGD", "learning_rate": 0.1},
    {"class": "SGD", "learning_rate": 0.1, "momentum": 0.9},
    {"class": "SGD", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
    {"class": "Adam", "learning_rate": 0.01},
    {"class": "Adam", "learning_rate": 0.01, "amsgrad": True},
    {"class": "AdamW", "learning_rate": 0.01, "weight_decay": 0.05, "no_weight_decay": [1, 3]},
    {"class": "Adagrad", "learning_rate": 0.05},
]
SHAPES = [(16, 16), (16,), (3, 4, 5), (), (7,), (8,), (2, 3), (5, 5), (9,),
          (fused.SMALL_VALUES + 5,), (50, 8)]   # small ones, a large one, a table (sparse rows)


def _model(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {(i, 0): rng.normal(size=s).astype(np.float32) for i, s in enumerate(SHAPES)}


def _grads(step: int) -> dict:
    rng = np.random.default_rng(100 + step)
    grads = {(i, 0): rng.normal(size=s).astype(np.float32) for i, s in enumerate(SHAPES[:-1])}
    rows = rng.integers(0, 50, size=12)
    grads[(len(SHAPES) - 1, 0)] = (rows, rng.normal(size=(12, 8)).astype(np.float32))   # sparse rows
    if step % 3 == 2:
        del grads[(4, 0)]   # a variable without a gradient this step
    return grads


def _optimizer(config: dict, fuse: bool, params: dict):
    opt = make_optimizer({"name": config["class"].lower(), **config})
    opt.fuse_small = fuse
    for key, value in params.items():
        opt.add_variable(key, value)
    return opt


def _state(opt, params) -> dict:
    return {**{f"value/{k}": np.array(v) for k, v in params.items()}, **optimizer_state.save(opt)}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_small_variables_updated_together_change_no_bit(config):
    alone, together = _model(), _model()
    a, b = _optimizer(config, False, alone), _optimizer(config, True, together)
    for step in range(6):
        a.apply(step, alone, _grads(step))
        b.apply(step, together, _grads(step))
        want, got = _state(a, alone), _state(b, together)
        assert want.keys() == got.keys()   # a checkpoint names every variable's slots as before
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} after step {step}")
    fused_keys = [k for k in together if together[k].base is not None and together[k].size <= fused.SMALL_VALUES]
    if b.slot_names:
        assert len(fused_keys) >= fused.MIN_FUSED   # the small ones do live in one buffer
    else:
        assert fused_keys == []   # plain SGD, one pass: per variable


def test_a_restore_and_a_live_snapshot_rebuild_the_buffer_from_the_current_values():
    config = CONFIGS[3]
    alone, together = _model(), _model()
    a, b = _optimizer(config, False, alone), _optimizer(config, True, together)
    for step in range(2):
        a.apply(step, alone, _grads(step))
        b.apply(step, together, _grads(step))
    saved = optimizer_state.save(b)   # a checkpoint, restored into the fused optimizer (its slots replaced)
    values = {k: np.array(v) for k, v in together.items()}
    assert optimizer_state.load(b, values, saved) == []
    together.clear()
    together.update(values)
    reader = b.snapshot(together, (0, 0))   # a pull still being read: its variable is not updated in place
    before = np.array(reader)
    for step in range(2, 5):
        a.apply(step, alone, _grads(step))
        b.apply(step, together, _grads(step))
    np.testing.assert_array_equal(reader, before)
    for k in alone:
        np.testing.assert_array_equal(together[k], alone[k])
    for name, array in optimizer_state.save(a).items():
        np.testing.assert_array_equal(optimizer_state.save(b)[name], array)
