"""Optimizer state re-cut for another strategy (``autosync.runtime.reshard``): names, the index a
checkpoint keeps, regions cut from overlapping shards, and what is refused. No Ray, no
TensorFlow: plans and Keras variables are fakes."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from autosync.runtime import checkpoint as ck
from autosync.runtime import reshard
from strategy_space.errors import ConfigError


def _ref(var, shard, axis, start, stop):
    return SimpleNamespace(var_index=var, key=(var, shard), axis=axis, start=start, stop=stop)


def _plan(ps=(), ar=()):
    """A plan with one PS actor per list of shard refs in ``ps`` and one group of members ``ar``."""
    return SimpleNamespace(ps_actors=[SimpleNamespace(name=f"ps@n{i}", shards=refs) for i, refs in enumerate(ps)],
                           ar_groups=[SimpleNamespace(members=list(ar))] if ar else [])


SHAPES = [(6, 4), (), (5,)]
FULL = {(0, "momentum"): np.arange(24, dtype=np.float32).reshape(6, 4),
        (1, "momentum"): np.float32(7.0),
        (2, "momentum"): np.arange(5, dtype=np.float32) + 100}


def _saved(plan) -> tuple[dict, dict]:
    """(arrays, index) as a checkpoint of ``plan`` holds them: each shard's slot, numpy-rule names."""
    arrays, canonical = {}, {}
    for p in plan.ps_actors:
        for r in p.shards:
            name = f"ps/{p.name}/{r.var_index}.{r.key[1]}/m"
            full = FULL[(r.var_index, "momentum")]
            index = (slice(None),) * r.axis + (slice(r.start, r.stop),)
            arrays[name] = np.array(full[index] if np.ndim(full) else full)
            canonical[name] = f"{r.var_index}.{r.key[1]}/momentum"
    return arrays, reshard.state_index(canonical, plan, SHAPES)


def test_a_slot_cut_along_one_axis_is_recut_along_another_and_whole():
    old = _plan(ps=[[_ref(0, 0, 0, 0, 2), _ref(1, 0, 0, 0, 1)], [_ref(0, 1, 0, 2, 6), _ref(2, 0, 0, 0, 5)]])
    arrays, index = _saved(old)
    assert index["ps/ps@n1/0.1/m"] == [0, 0, 2, 6, "momentum"] and index["ps/ps@n0/1.0/m"] == [1, -1, 0, 1, "momentum"]
    # the new plan: variable 0 in three column blocks on two servers, variables 1 and 2 all-reduced
    new = _plan(ps=[[_ref(0, 0, 1, 0, 1), _ref(0, 2, 1, 3, 4)], [_ref(0, 1, 1, 1, 3)]],
                ar=[_ref(1, 0, 0, 0, 1), _ref(2, 0, 0, 0, 3), _ref(2, 1, 0, 3, 5)])
    cut = reshard.Recut(index, {**arrays, "loss_scale": np.array([8.0, 1, 2])}, new, SHAPES, step=5, skipped=2)
    assert np.array_equal(cut["ps/ps@n0/0.2/momentum"], FULL[(0, "momentum")][:, 3:4])
    assert np.array_equal(cut["ps/ps@n1/0.1/momentum"], FULL[(0, "momentum")][:, 1:3])
    assert cut["ps/ps@n0/@iteration"] == 3   # the step less the skipped ones: no holder counted
    assert np.array_equal(cut["loss_scale"], [8.0, 1, 2])   # the rest passes as it is
    state = cut.channel_state()
    assert sorted(state) == ["1.0/momentum", "2.0/momentum", "2.1/momentum", "@iteration"]
    assert state["1.0/momentum"] == 7.0 and np.array_equal(state["2.1/momentum"], [103, 104])


def test_a_holder_s_counter_and_own_state_travel_and_a_gap_or_a_foreign_shape_is_refused():
    plan = _plan(ps=[[_ref(0, 0, 0, 0, 3)]])
    index = {"channel0/version": "@iteration", "channel0/keras/1": "@u_product",
             "ps/ps@n0/0.0/m": [0, 0, 0, 3, "momentum"]}
    arrays = {"channel0/version": np.array(9), "channel0/keras/1": np.array(0.5), "ps/ps@n0/0.0/m": np.ones((3, 4))}
    cut = reshard.Recut(index, arrays, plan, SHAPES, step=12)
    assert cut["ps/ps@n0/@iteration"] == 9 and cut["ps/ps@n0/@u_product"] == 0.5
    with pytest.raises(ConfigError, match=r"momentum of variable 0 does not cover its region \[0, 6\)"):
        reshard.Recut(index, arrays, _plan(ps=[[_ref(0, 0, 0, 0, 6)]]), SHAPES, step=12)["ps/ps@n0/0.0/momentum"]
    arrays["ps/ps@n0/0.0/m"] = np.ones((2, 2))   # a factored statistic, not the shard's shape
    with pytest.raises(ConfigError, match=r"has shape \(2, 2\), not its shard's \(3, 4\): it cannot be re-cut"):
        cut["ps/ps@n0/0.0/momentum"]


class _Var:
    def __init__(self, name, shape=(2,)):
        self.name, self.shape = name, shape


def test_keras_slots_are_named_after_their_variables_and_back():
    it = _Var("iteration", ())
    variables = [it, _Var("learning_rate", ()), _Var("shard1_momentum"), _Var("shard10_momentum"),
                 _Var("shard1_velocity"), _Var("variable", ()), _Var("shard2"), _Var("shard2")]
    names = reshard.keras_names(variables, {"shard1": "0.1", "shard10": "3.0", "shard2": "4.0"}, it)
    assert names == {"keras/0": "@iteration", "keras/1": "@learning_rate", "keras/2": "0.1/momentum",
                     "keras/3": "3.0/momentum", "keras/4": "0.1/velocity", "keras/5": "@variable",
                     "keras/6": None, "keras/7": None}   # Adafactor's factors share their variable's name
    arrays = {"@iteration": 4, "0.1/momentum": "m", "3.0/momentum": "m3", "0.1/velocity": "v", "@variable": 0.5}
    named = {k: v for k, v in names.items() if v is not None}
    found, problems = reshard.from_keras_names(named, arrays)
    assert problems == [] and found == {"keras/0": 4, "keras/2": "m", "keras/3": "m3", "keras/4": "v", "keras/5": 0.5}
    _, problems = reshard.from_keras_names(named, {"@iteration": 4, "0.1/momentum": "m"})
    # 0.1 holds a momentum but no velocity: missing (3.0 holds nothing: as it starts, see below)
    assert problems == ["optimizer state missing from the checkpoint: 0.1/velocity, @variable"]
    assert reshard.from_keras_names(named, {"@iteration": 4}) == ({}, [])   # no slot: nothing to set


def test_numpy_rule_slots_take_keras_names_and_back():
    slots = {(0, 1): {"m": 1, "v": 2}, (3, 0): {"momentum": 3}}
    assert reshard.numpy_names(slots) == {"0.1/m": "0.1/momentum", "0.1/v": "0.1/velocity",
                                          "3.0/momentum": "3.0/momentum"}
    arrays = {"0.1/momentum": "a", "0.1/velocity": "b", "3.0/momentum": "c", "9.0/momentum": "other's", "@iteration": 1}
    assert reshard.from_numpy_names(slots, arrays) == {"0.1/m": "a", "0.1/v": "b", "3.0/momentum": "c"}
    assert reshard.from_numpy_names(slots, {"@iteration": 1}) == {}


def test_a_holder_of_whole_variables_joins_its_shards():
    members = [_ref(0, 1, 1, 2, 4), _ref(0, 0, 1, 0, 2), _ref(2, 0, 0, 0, 5)]
    full = FULL[(0, "momentum")][:, :4]
    arrays = {"0.0/momentum": full[:, :2], "0.1/momentum": full[:, 2:], "2.0/momentum": FULL[(2, "momentum")]}
    names = {"keras/2": "0/momentum", "keras/3": "2/momentum", "keras/0": "@iteration"}
    out = reshard.whole_slots(arrays, members, names)
    assert np.array_equal(out["0/momentum"], full) and np.array_equal(out["2/momentum"], FULL[(2, "momentum")])


def test_what_cannot_be_recut_is_said():
    assert "before checkpoints kept" in reshard.restore_problems(None, {}, SHAPES, 3, {})[0]
    arrays = {"ps/ps@n0/keras/5": 1, "seeds/0/0": 2}
    said = reshard.restore_problems({}, arrays, SHAPES, 3, {"ps@n0": {"version": 3, "chunk_version": [3, 3]}})
    assert len(said) == 1 and "ps/ps@n0/keras/5 is not per variable shard" in said[0]
    said = reshard.restore_problems({"ps/ps@n0/keras/5": "@x"}, arrays, SHAPES, 3,
                                    {"ps@n0": {"version": 6, "chunk_version": [6]}})
    assert len(said) == 1 and "update counters" in said[0] and "not its step 3" in said[0]
    assert reshard.restore_problems({"ps/ps@n0/keras/5": "@x"}, arrays, SHAPES, 3,
                                    {"ps@n0": {"version": 3, "chunk_version": [3, 3]}}) == []
    said = reshard.restore_problems({"ps/ps@n0/keras/5": "@x", "ps/ps@n0/0.0/m": [0, 0, 0, 6, "momentum"]}, arrays,
                                    SHAPES, 3, {})
    assert said == ["its state index names arrays its state.npz lacks (ps/ps@n0/0.0/m): the checkpoint is damaged"]


def test_a_manifest_keeps_its_index_and_refuses_a_damaged_one(tmp_path):
    fields = dict(step=2, data_positions=(2, 2), model="m", variables=(("k", (6, 4), "float32"),), optimizer="Adam",
                  strategy={"version": 1, "variables": []}, strategy_fingerprint="f" * 16, directory="step-00000002")
    index = {"ps/ps@n0/0.0/m": [0, 0, 0, 6, "momentum"], "channel0/version": "@iteration"}
    manifest = ck.Manifest(**fields, state_index=index)
    again = ck.Manifest.from_dict(json.loads(json.dumps(manifest.to_dict())), "here")
    assert again.state_index == index
    assert ck.Manifest.from_dict(ck.Manifest(**fields).to_dict(), "here").state_index is None   # an older one
    # another strategy is no mismatch where the index lets the state be re-cut, one where it does not
    other = ck.Manifest(**dict(fields, strategy_fingerprint="0" * 16))
    assert manifest.mismatches(other) == []
    assert "predates the index that lets optimizer state be re-cut" in ck.Manifest(**fields).mismatches(other)[0]
    for bad in ({"a": [1, 0, 0, 6, "m"]}, {"a": [0, 0, 6, 0, "m"]}, {"a": [0, 0, -2, 6, "m"]},
                {"a": [0, -2, 0, 6, "m"]}, {"a": "iteration"}, {"a": [0, 0, 0, 6]}, []):
        with pytest.raises(ConfigError, match="here: damaged checkpoint manifest"):
            ck.Manifest.from_dict(dict(manifest.to_dict(), state_index=bad), "here")


def test_a_variable_whose_old_holder_had_taken_no_update_keeps_its_slots_as_they_start():
    """A Keras optimizer builds its slots at its first update: a checkpoint before it (or after
    only skipped steps) holds none for its variables, while other holders' are there."""
    fresh = np.zeros(2)
    slots = {(0, 0): {"m": fresh, "v": fresh}, (1, 0): {"m": fresh, "v": fresh}}
    arrays = {"@iteration": 0, "0.0/momentum": "m0", "0.0/velocity": "v0"}
    assert reshard.from_numpy_names(slots, arrays) == {"0.0/m": "m0", "0.0/v": "v0", "1.0/m": fresh, "1.0/v": fresh}
    # one slot of a variable it holds others of is missing, not fresh: left out (and refused by the load)
    assert "0.0/v" not in reshard.from_numpy_names(slots, {"0.0/momentum": "m0"})
    names = {"keras/0": "@iteration", "keras/1": "0/momentum", "keras/2": "1/momentum", "keras/3": "12/momentum"}
    found, problems = reshard.from_keras_names(names, {"@iteration": 0, "1.0/momentum": "x", "1/momentum": "x"})
    assert problems == [] and found == {"keras/0": 0, "keras/2": "x"}
    _, problems = reshard.from_keras_names(names, {"@iteration": 0, "1/velocity": "x"})
    assert problems == ["optimizer state missing from the checkpoint: 1/momentum"]
