"""Strategy files for clusters of hundreds of nodes: a variable partitioned over many shards is
written in the compact form (one synchronizer's options, then each shard's destination or group),
so what AutoSync writes stays within the size every reader accepts, and reads back identical."""
import os

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from strategy_space import (AllReduce, ClusterSpec, ConfigError, NodeSpec, PS, Strategy, VarConfig, dumps,
                            load_model_spec, load_strategy, loads, save)
from strategy_space._yaml_limits import MAX_FILE_BYTES
from strategy_space.builders import BUILDERS, get_builder
from tests.conftest import CONFIGS


def _cluster(nodes: int) -> ClusterSpec:
    return ClusterSpec(f"c{nodes}", tuple(NodeSpec(f"n{i}", address=f"10.{i // 250}.{i % 250}.1", workers=8, gpus=8,
                                                   bandwidth_gbps=100.0) for i in range(nodes)))


@pytest.mark.parametrize("name", ["partitioned_ps", "partitioned_all_reduce", "uneven_partitioned_ps"])
def test_every_builder_on_512_nodes_writes_a_file_its_readers_accept(name, tmp_path):
    if name not in BUILDERS:
        pytest.fail(f"builder {name} is gone: choose another that partitions over every node")
    model = load_model_spec(os.path.join(CONFIGS, "models", "bert_base.yaml"))
    s = get_builder(name).build(model, _cluster(512))
    assert max(c.num_shards for c in s.variables) >= 256   # many shards, or the case is not tested
    path = tmp_path / "s.yaml"
    save(s, path)
    # the shard lists of the 512-node partitioned_ps were 2.6 MB, past the 2 MiB every reader refuses
    assert path.stat().st_size < MAX_FILE_BYTES / 4
    back = load_strategy(path)
    assert back == s and back.fingerprint == s.fingerprint


def _var(syncs) -> VarConfig:
    return VarConfig("emb", tuple(syncs))


def test_compact_form_only_past_a_few_shards_and_only_where_the_shards_share_their_options():
    many_ps = _var(PS(f"n{i % 3}", sync=True, staleness=2) for i in range(9))
    many_ar = _var(AllReduce(compressor="fp16", group=i) for i in range(9))
    few = _var(PS(f"n{i}") for i in range(8))
    mixed = _var([PS("n0")] * 8 + [PS("n1", local_replication=True)])
    kinds = _var([PS("n0")] * 8 + [AllReduce()])
    s = Strategy((many_ps, many_ar, few, mixed, kinds))
    written = loads(dumps(s))
    assert written == s
    data = yaml.safe_load(dumps(s))["variables"]
    assert data[0]["ps"] == {"local_replication": False, "sync": True, "staleness": 2}
    assert data[0]["destinations"] == [f"n{i % 3}" for i in range(9)]
    assert data[1]["all_reduce"] == {"backend": "auto", "compressor": "fp16"}
    assert data[1]["groups"] == list(range(9))
    assert all("shards" in d and "destinations" not in d and "groups" not in d for d in data[2:])


@pytest.mark.parametrize("body, says", [
    ({"ps": {}, "destinations": ["a", 5, True]},
     ["variable emb.destinations[1]: expected a node name, got 5",
      "variable emb.destinations[2]: expected a node name, got True"]),
    ({"ps": {"destination": "a"}, "destinations": ["a", "b", "c"]},
     ["variable emb: give each shard's destination in 'destinations' or one ps.destination for all shards, not both"]),
    ({"ps": {"stale": 1}, "destinations": ["a", "b", "c"]},   # (no destination offered: it is per shard here)
     ["variable emb.ps: unknown key(s) stale; allowed keys are local_replication, staleness, sync"]),
    ({"all_reduce": {"grup": 1}, "groups": [0, 1, 2]},
     ["variable emb.all_reduce: unknown key(s) grup; allowed keys are backend, compressor, hierarchical"]),
    ({"ps": None, "destinations": ["a", "b"]}, ["variable emb: partition.shards is 3 but 'destinations' has 2 entries"]),
    ({"all_reduce": {}, "destinations": ["a", "b", "c"]},
     ["variable emb: 'destinations' goes with one 'ps:' entry (its options, no destination) and nothing else; "
      "remove all_reduce"]),
    ({"ps": {}, "destinations": ["a", "b", "c"], "shards": []}, ["remove shards"]),
    ({"ps": 3, "destinations": ["a", "b", "c"]}, ["variable emb.ps: expected a mapping of options, got 3"]),
    ({"ps": {}, "destinations": "abc"}, ["variable emb.destinations: expected list"]),
    ({"all_reduce": {}, "groups": [1, -1, 2]}, ["variable emb.groups[1]: all_reduce.group must be an integer from 0"]),
    ({"all_reduce": {}, "groups": [1, 2, 3], "destinations": ["a", "b", "c"]}, ["remove all_reduce, groups"]),
])
def test_compact_form_mistakes_are_named(body, says):
    with pytest.raises(ConfigError) as e:
        VarConfig.from_dict({"var": "emb", "partition": {"shards": 3}, **body}, "variables[0]")
    assert len(e.value.problems) == len(says)
    for problem, said in zip(e.value.problems, says):
        assert said in problem


def test_compact_form_reports_at_most_the_kept_problems():
    from strategy_space.strict import MAX_PROBLEMS_KEPT
    body = {"var": "emb", "partition": {"shards": 5000}, "ps": {}, "destinations": [0] * 5000}
    with pytest.raises(ConfigError) as e:
        VarConfig.from_dict(body, "variables[0]")
    assert len(e.value.problems) == MAX_PROBLEMS_KEPT + 1
    assert e.value.problems[-1].endswith(f"stopped reading at item {MAX_PROBLEMS_KEPT} of 5000 after "
                                         f"{MAX_PROBLEMS_KEPT} problems; fix these first")



_SHARDS = st.lists(st.one_of(
    st.builds(PS, destination=st.sampled_from(["a", "b", "c"]), local_replication=st.booleans(),
              staleness=st.sampled_from([0, 3])),
    st.builds(AllReduce, compressor=st.sampled_from(["none", "fp16"]), group=st.integers(0, 5),
              hierarchical=st.booleans())), min_size=1, max_size=20)


@settings(max_examples=150, deadline=None)
@given(st.lists(_SHARDS, min_size=1, max_size=4), st.lists(st.sampled_from(["a", "b", "c"]), max_size=12))
def test_any_shard_lists_read_back_as_written(shard_lists, pattern):
    """Shards alike but for destination (or group) in the compact form, any others in the long one:
    every mix reads back equal, with the same fingerprint."""
    variables = [VarConfig(f"v{i}", tuple(shards)) for i, shards in enumerate(shard_lists)]
    if pattern:   # one variable whose shards surely differ only in destination
        variables.append(VarConfig("w", tuple(PS(d, staleness=3) for d in pattern * 2)))
    s = Strategy(tuple(variables))
    back = loads(dumps(s))
    assert back == s and back.fingerprint == s.fingerprint
