"""A command says what is wrong with its cheap inputs (a builder's name or options, a cluster or
strategy file, emulated compute's settings) before it reads the model, and so does
``autosync.make_trainer``: reading one imports TensorFlow and builds it, ten seconds and more,
which a user waited through only to be told of a typo. The model loaders are replaced by ones
that fail the test if called."""
from __future__ import annotations

import pytest

import autosync.cli.offline
import autosync.sources
from autosync.cli import main
from strategy_space import save
from strategy_space.builders import strategy_or_builder
from strategy_space.errors import ConfigError
from strategy_space.strategy import Strategy
from tests.fakes import tiny_model, two_node_cluster


@pytest.fixture
def no_model(monkeypatch):
    """Reading the model fails the test."""
    def read(*args, **kwargs):
        raise AssertionError("the model was read before the command's cheap inputs were checked")

    for name in ("load_model_spec", "load_model_def", "load_emulated_model"):
        monkeypatch.setattr(autosync.sources, name, read)
    monkeypatch.setattr(autosync.cli.offline, "load_model_spec", read)


@pytest.fixture
def files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("garbage: [1, 2\n")
    return {"bad": str(bad), "tmp": str(tmp_path)}


CASES = {
    "build-unknown-builder": (["build", "--builder", "nope", "--model", "zoo:ncf", "--cluster", "local"],
                              ["unknown builder 'nope'"]),
    "build-unknown-option": (["build", "--builder", "ps", "--option", "shards=3", "--model", "zoo:ncf",
                              "--cluster", "local"], ["unknown option(s) shards"]),
    "build-bad-cluster": (["build", "--builder", "ps", "--model", "zoo:ncf", "--cluster", "{bad}"],
                          ["not valid YAML"]),
    "simulate-bad-cluster": (["simulate", "--model", "zoo:ncf", "--cluster", "{bad}", "--strategy", "ps"],
                             ["not valid YAML"]),
    "simulate-unknown-strategy": (["simulate", "--model", "zoo:ncf", "--cluster", "local", "--strategy", "nope"],
                                  ["strategy 'nope' is neither a strategy YAML file nor a builder's name"]),
    "simulate-bad-strategy-file": (["simulate", "--model", "zoo:ncf", "--cluster", "local", "--strategy", "{bad}"],
                                   ["not valid YAML"]),
    "train-unknown-strategy": (["train", "--model", "zoo:ncf", "--strategy", "nope", "--steps", "5"],
                               ["strategy 'nope' is neither"]),
    "train-bad-strategy-file": (["train", "--model", "zoo:ncf", "--strategy", "{bad}", "--steps", "5"],
                                ["not valid YAML"]),
    "run-emulated-settings": (["run", "--model", "zoo:ncf", "--strategy", "ps", "--compute", "emulated",
                               "--step-time", "-1", "--optimizer", "nope"],
                              ["--step-time must be a number of seconds >= 0, got -1.0",
                               "optimizer 'nope' for emulated compute is not one of sgd"]),
    "tune-emulated-optimizer": (["tune", "--model", "zoo:ncf", "--compute", "emulated", "--optimizer", "nope",
                                 "--warm-start", "none", "--store", "{tmp}/trials.db"],
                                ["optimizer 'nope' for emulated compute"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_cheap_input_is_said_before_the_model_is_read(case, no_model, files, capsys):
    argv, said = CASES[case]
    assert main([a.format(**files) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autosync {argv[0]}: error: ") and "Traceback" not in err, err
    for text in said:
        assert text in err, err


def test_strategy_or_builder_reads_a_file_keeps_a_name_and_refuses_the_rest(tmp_path):
    model, cluster = tiny_model(), two_node_cluster()
    from strategy_space.builders import get_builder

    strategy = get_builder("ps").build(model, cluster)
    path = tmp_path / "s.yaml"
    save(strategy, path)
    assert strategy_or_builder(str(path)) == strategy
    assert strategy_or_builder(path) == strategy
    assert strategy_or_builder(strategy) is strategy
    assert strategy_or_builder("all_reduce") == "all_reduce"
    named = tmp_path / "ps"   # a file of a builder's name wins, as resolve_strategy has it
    save(strategy, named)
    assert isinstance(strategy_or_builder(str(named)), Strategy)
    with pytest.raises(ConfigError, match="neither a strategy YAML file nor a builder's name"):
        strategy_or_builder(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="got int 3"):
        strategy_or_builder(3)


def test_make_trainer_says_an_unknown_keyword_and_a_bad_strategy_before_the_model_loads(no_model, files):
    import autosync

    with pytest.raises(TypeError, match="nonsense"):
        autosync.make_trainer("zoo:ncf", "ps", "local", nonsense=1)
    with pytest.raises(ConfigError, match="not valid YAML"):
        autosync.make_trainer("zoo:ncf", files["bad"], "local")
    with pytest.raises(ConfigError, match="neither a strategy YAML file nor a builder's name"):
        autosync.make_trainer("zoo:ncf", "nope", "local", timeout_s=30)


RAY_CASES = {
    "run": ["run", "--model", "zoo:ncf", "--strategy", "ps", "--cluster", "{cluster}"],
    "run-emulated": ["run", "--model", "zoo:ncf", "--strategy", "ps", "--compute", "emulated",
                     "--cluster", "{cluster}"],
    "train": ["train", "--model", "zoo:ncf", "--strategy", "ps", "--steps", "5", "--cluster", "{cluster}"],
    "probe": ["probe", "--model", "zoo:ncf", "--strategy", "ps", "--cluster", "{cluster}", "--store", "{tmp}/t.db"],
    "tune": ["tune", "--model", "zoo:ncf", "--cluster", "{cluster}", "--warm-start", "none", "--store", "{tmp}/t.db"],
    "tune-emulated": ["tune", "--model", "zoo:ncf", "--compute", "emulated", "--cluster", "{cluster}",
                      "--warm-start", "none", "--store", "{tmp}/t.db"],
    "tune-probe-model": ["tune", "--model", "zoo:ncf", "--compute", "emulated", "--probe-model", "zoo:ncf",
                         "--cluster", "{cluster}", "--warm-start", "none", "--store", "{tmp}/t.db"],
}


@pytest.fixture
def closed_port():
    """A loopback port nothing listens at (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", list(RAY_CASES))
def test_a_ray_cluster_that_cannot_be_reached_is_said_before_the_model_is_read(case, no_model, files, closed_port,
                                                                                 monkeypatch, capsys):
    """A cluster of other machines with no RAY_ADDRESS, or a RAY_ADDRESS where nothing answers: said
    after the 9-10 s of reading the model before (the runner's start), now before it."""
    import os
    import sys

    cluster = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "clusters", "emulated_3x1gbit.yaml")
    argv = [a.format(cluster=cluster, **files) for a in RAY_CASES[case]]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if "ray" in sys.modules:   # an earlier test of this process left Ray connected: as a fresh command, it is not
        monkeypatch.setattr(sys.modules["ray"], "is_initialized", lambda: False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autosync {argv[0]}: error: cluster emulated_3x1gbit has 3 node(s) but Ray is not running "
                          f"here; fix by starting the Ray cluster and setting RAY_ADDRESS="), err
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port}")
    assert main([a if a != cluster else "local" for a in argv]) == 2   # also for local: RAY_ADDRESS is used
    err = capsys.readouterr().err
    assert err.startswith(f"autosync {argv[0]}: error: could not connect to the Ray cluster at RAY_ADDRESS=127.0.0.1:"
                          f"{closed_port}: nothing listens at 127.0.0.1:{closed_port}; fix by giving"), err


def test_make_trainer_says_a_ray_cluster_that_cannot_be_reached_before_the_model_is_read(no_model, monkeypatch):
    import os
    import sys

    import autosync

    cluster = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "clusters", "emulated_3x1gbit.yaml")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if "ray" in sys.modules:   # as a fresh process (see above)
        monkeypatch.setattr(sys.modules["ray"], "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="has 3 node.s. but Ray is not running here"):
        autosync.make_trainer("zoo:ncf", "ps", cluster, timeout_s=30)


def test_a_bad_stand_in_argument_is_said_before_the_ray_check(no_model, files, monkeypatch, capsys):
    """``--probe-model`` with real compute: the argument's own error, not the cluster's Ray."""
    import os
    import sys

    cluster = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "clusters", "emulated_3x1gbit.yaml")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if "ray" in sys.modules:   # as a fresh process (see above)
        monkeypatch.setattr(sys.modules["ray"], "is_initialized", lambda: False)
    argv = ["tune", "--model", "zoo:ncf", "--probe-model", "zoo:ncf", "--cluster", cluster, "--warm-start", "none",
            "--store", f"{files['tmp']}/t.db"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autosync tune: error: --probe-model zoo:ncf: a stand-in is for emulated compute"), err
