import pytest

from strategy_space import ClusterSpec, ConfigError, ModelSpec, NodeSpec, VariableSpec, dumps, loads, save
from tests.fakes import three_node_cluster, tiny_model, two_node_cluster


def test_variable_bytes_and_rows():
    v = VariableSpec("e", (1000, 16), dtype="float16", sparse=True, rows_per_step=10)
    assert v.bytes == 1000 * 16 * 2
    assert v.row_bytes == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="x", shape=(0, 3)), r"every dimension of shape must be >= 1, got \[0, 3\]"),
    (dict(name="x", shape=(2 ** 31, 4), sparse=True), r"a dimension of shape \[2147483648, 4\] is over 2,147,483,647"),
    (dict(name="x", shape=(3,), dtype="float8"), r"dtype 'float8' is not one of"),
    (dict(name="x", shape=(3,), rows_per_step=2), r"rows_per_step is only allowed when sparse is true"),
    (dict(name="x", shape=(3, 2), sparse=True, rows_per_step=4), r"rows_per_step must be in \[1, 3\]"),
])
def test_variable_rules(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        VariableSpec(**kwargs)


def test_the_longest_dimension_allowed_is_planned():   # the strategy space and the features count in int32
    from strategy_space.space import StrategySpace
    from tuner.features.tables import FeatureTables
    import numpy as np

    model = ModelSpec("m", (VariableSpec("e", (2 ** 31 - 1, 4), sparse=True, rows_per_step=100), VariableSpec("d", (4,))))
    space = StrategySpace(model, two_node_cluster())
    assert space.shard_max[0] == space.max_shards
    space.sample(np.random.default_rng(0))
    assert FeatureTables.from_specs(model, two_node_cluster()).dims[0, 0] == 2 ** 31 - 1


def test_model_rejects_duplicate_names():
    with pytest.raises(ConfigError, match="appears twice"):
        ModelSpec("m", (VariableSpec("a", (2,)), VariableSpec("a", (3,))))


def test_cluster_rules_reported_together():
    with pytest.raises(ConfigError) as e:
        ClusterSpec("c", (NodeSpec("a", chief=True), NodeSpec("a", chief=True)))
    text = str(e.value)
    assert "node names must be unique" in text and "exactly one node may be chief" in text


def test_cluster_first_node_is_chief_by_default():
    c = ClusterSpec("c", (NodeSpec("a"), NodeSpec("b")))
    assert c.chief.name == "a"
    assert c.devices == ("a:0", "b:0")


@pytest.mark.parametrize("spec", [tiny_model(), tiny_model(profile=True), two_node_cluster(), three_node_cluster(),
                                  ModelSpec("clipped", tiny_model().variables, 64, global_clipnorm=True)])
def test_yaml_round_trip_exact(spec):
    back = loads(dumps(spec))
    assert back == spec
    assert back.fingerprint == spec.fingerprint


def test_fingerprint_ignores_profile_and_is_stable():
    assert tiny_model().fingerprint == tiny_model(profile=True).fingerprint
    # the same in a fresh interpreter (hash randomization must not leak into it)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from tests.fakes import tiny_model; print(tiny_model().fingerprint)"],
                         capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert out.stdout.strip() == tiny_model().fingerprint
    other = ModelSpec("tiny", tiny_model().variables[:-1], batch_size=64)
    assert other.fingerprint != tiny_model().fingerprint


def test_global_clipping_is_in_the_fingerprint_only_when_set():
    """A held step costs what an unheld one does not, so a clipped model's trials form their own
    group; every spec without it keeps the fingerprint (and YAML) it had before the field."""
    plain = tiny_model()
    clipped = ModelSpec(plain.name, plain.variables, plain.batch_size, global_clipnorm=True)
    assert "global_clipnorm" not in dumps(plain)
    assert "global_clipnorm: true" in dumps(clipped)
    assert clipped.fingerprint != plain.fingerprint
    from strategy_space.strict import fingerprint

    assert plain.fingerprint == fingerprint({"variables": [v.to_dict() for v in plain.variables], "batch_size": 64})
    with pytest.raises(ConfigError, match="global_clipnorm must be true or false"):
        ModelSpec(plain.name, plain.variables, plain.batch_size, global_clipnorm="yes")
    with pytest.raises(ConfigError, match="global_clipnorm"):
        loads(dumps(plain).replace("batch_size: 64", "batch_size: 64\nglobal_clipnorm: 1.0"))


def test_cluster_fingerprint_ignores_name_only():
    c = two_node_cluster()
    renamed = ClusterSpec("other", c.nodes)
    assert renamed.fingerprint == c.fingerprint
    faster = ClusterSpec("two", (NodeSpec("a", address="10.0.0.1", workers=2, bandwidth_gbps=10.0), c.nodes[1]))
    assert faster.fingerprint != c.fingerprint


def test_unknown_keys_are_errors():
    text = dumps(tiny_model()).replace("batch_size: 64", "batch_size: 64\nbatchsize: 3")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) batchsize; allowed keys are"):
        loads(text)


def test_unknown_node_key_names_node():
    text = dumps(two_node_cluster()).replace("cpus: 1", "cpus: 1\n  bandwith_gbps: 3", 1)
    with pytest.raises(ConfigError, match=r"nodes\[0\]: unknown key\(s\) bandwith_gbps"):
        loads(text)


def test_wrong_kind_and_version():
    with pytest.raises(ConfigError, match="expected a cluster file"):
        loads(dumps(tiny_model()), expect="cluster")
    with pytest.raises(ConfigError, match="format version 9 is not supported"):
        loads(dumps(tiny_model()).replace("version: 1", "version: 9"))


def test_bad_yaml_says_where():
    with pytest.raises(ConfigError, match=r"not valid YAML at line 3, column 1: expected .,. or .\]."):
        loads("kind: model\nname: [unclosed\n")


def test_bytes_field_must_match():
    text = dumps(tiny_model()).replace("dtype: int64", "dtype: int64\n  bytes: 3")
    with pytest.raises(ConfigError, match="does not match shape x dtype = 8"):
        loads(text)


@pytest.mark.parametrize("node, intra, says", [
    (dict(gpus=8), None, "up to 8 GPU workers"),            # several GPU workers, their links unsaid
    (dict(gpus=8, workers=2), None, "up to 2 GPU workers"),
    (dict(gpus=8), 2400.0, None),                            # said
    (dict(gpus=1), None, None),                              # one worker a node: nothing between them
    (dict(gpus=0, workers=4), None, None),                   # CPU workers: the host-memory path the default is
])
def test_what_the_links_inside_a_node_are_taken_to_be(node, intra, says):
    from strategy_space.cluster_spec import DEFAULT_INTRA_GBPS

    c = ClusterSpec("c", (NodeSpec("a", address="10.0.0.1", cpus=8, **node),
                          NodeSpec("b", address="10.0.0.2", cpus=8, **node)), intra_node_bandwidth_gbps=intra)
    assert c.intra_node_gbps == (intra or DEFAULT_INTRA_GBPS)
    note = c.intra_node_assumption()
    assert (note is None) == (says is None)
    if says:
        assert says in note and "intra_node_bandwidth_gbps" in note and f"{DEFAULT_INTRA_GBPS:g} Gbit/s" in note


def test_a_path_under_home_is_written_and_read_there(monkeypatch, tmp_path):
    """``save(strategy, "~/runs/best.yaml")`` from Python (no shell expands the ~) made a folder
    named '~' in the working directory, and reading '~/c.yaml' said 'file not found'."""
    from strategy_space import load_cluster_spec

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cluster = ClusterSpec("c", (NodeSpec("a", address="10.0.0.1"),))
    save(cluster, "~/runs/c.yaml")
    assert (tmp_path / "home" / "runs" / "c.yaml").is_file() and not (tmp_path / "~").exists()
    assert load_cluster_spec("~/runs/c.yaml") == cluster
