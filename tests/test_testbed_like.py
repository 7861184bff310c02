"""``testbed up --like CLUSTER --dilation K``: the scaled shape, the ClusterSpec it writes, and the
flag combinations it refuses (unit: nothing is brought up)."""
from __future__ import annotations

import dataclasses
import os

import pytest

from autosync.testbed import netns, ray_nodes, state
from autosync.testbed import testbed as tb_mod
from autosync.testbed.like import like_config, nodes_that_fit, oversubscription_warning
from strategy_space import ClusterSpec, NodeSpec
from strategy_space.errors import ConfigError
from strategy_space.yaml_io import load


def _cli(argv, monkeypatch):
    import autosync.cli as cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("testbed",))
    return cli.main(argv)


@pytest.fixture
def paper_b(configs_dir):
    return os.path.join(configs_dir, "clusters", "paper_4x4t4_50gbit.yaml")


def test_like_scales_the_links_and_records_the_dilation(paper_b):
    plan = like_config(load(paper_b, "cluster"), 250)
    c = plan.config
    assert (c.nodes, c.bandwidth, c.workers_per_node, c.compute_dilation, c.like) == \
        (4, "200mbit", 4, 250.0, "paper_4x4t4_50gbit")
    assert not plan.dropped
    spec = state.cluster_spec(c)
    assert spec.compute_dilation == 250.0 and spec.num_workers == 16
    assert {n.bandwidth_gbps for n in spec.nodes} == {0.2}


def test_nodes_that_do_not_fit_are_dropped_and_named(configs_dir):
    target = load(os.path.join(configs_dir, "clusters", "paper_11x1gpu_40gbit.yaml"), "cluster")
    assert nodes_that_fit(1000, 6500) == 4                      # 0.8 * 6500 MiB / 1300 MiB per node
    plan = like_config(target, 200, mem_available_mb=6500)
    assert plan.config.nodes == 4 and plan.dropped == tuple(f"node{i}" for i in range(4, 11))
    assert "dropped: node4" in plan.notes[0]
    assert like_config(target, 200, nodes=3).config.nodes == 3


def test_too_fast_links_are_warned_about(paper_b):
    plan = like_config(load(paper_b, "cluster"), 10)             # 5gbit: CPU-bound here
    assert any("faster than this machine emulates faithfully" in n for n in plan.notes)


@pytest.mark.parametrize("kw, message", [({"dilation": 0.5}, r"--dilation must be a number in \[1, 10000\]"),
                                         ({"dilation": 10_000, "nodes": 9}, "the target .* has 4 nodes"),
                                         ({"dilation": 1e4}, None)])
def test_bad_like_settings(paper_b, kw, message):
    target = load(paper_b, "cluster")
    if message is None:                                          # 50gbit / 1e4 = 5mbit: still shapeable
        assert like_config(target, **kw).config.bandwidth == "5mbit"
        return
    with pytest.raises(ConfigError, match=message):
        like_config(target, **kw)


MIXED = ClusterSpec("mixed", (NodeSpec("a", workers=2, bandwidth_gbps=0.5), NodeSpec("b", workers=1, bandwidth_gbps=0.1),
                               NodeSpec("c", workers=0, bandwidth_gbps=1.0)))


def test_a_cluster_whose_nodes_differ_gets_each_nodes_rate_and_workers():
    c = like_config(MIXED, 2).config
    assert (c.node_bandwidths, c.node_workers, c.workers_per_node) == (("250mbit", "50mbit", "500mbit"), (2, 1, 0), 2)
    assert c.rates_bps == (250_000_000, 50_000_000, 500_000_000) and c.links == "host0 250mbit, host1 50mbit, host2 500mbit"
    spec = state.cluster_spec(c)
    assert [(n.workers, n.bandwidth_gbps) for n in spec.nodes] == [(2, 0.25), (1, 0.05), (0, 0.5)]
    assert spec.num_workers == 3 and spec.compute_dilation == 2.0
    assert "3 workers (2 + 1 + 0 on 3 nodes) on 2 cores" in oversubscription_warning(c, 2)
    uniform = like_config(ClusterSpec("u", (NodeSpec("a", bandwidth_gbps=0.4), NodeSpec("b", bandwidth_gbps=0.4))), 2)
    assert (uniform.config.node_bandwidths, uniform.config.node_workers, uniform.config.links) == ((), (), "200mbit")


def test_rates_out_of_range_and_nodes_without_workers_are_refused():
    slow = ClusterSpec("s", (NodeSpec("a", bandwidth_gbps=0.01),))
    with pytest.raises(ConfigError, match="node a: 0.01 Gbit/s / 100 = 100000 bit/s is outside the 1mbit..100gbit"):
        like_config(slow, 100)
    servers_first = ClusterSpec("p", (NodeSpec("ps", workers=0), NodeSpec("w", workers=1)))
    with pytest.raises(ConfigError, match=r"the 1 node\(s\) of p brought up \(ps\) hold no worker"):
        like_config(servers_first, 2, nodes=1)


@pytest.mark.parametrize("kw, message", [
    (dict(node_bandwidths=("1gbit",)), r"node_bandwidths must give one value per node \(2\), got 1"),
    (dict(node_bandwidths=("1gbit", "fast")), "'fast' is not a rate"),
    (dict(node_workers=(0, 0)), r"node_workers must be integers >= 0 with at least one worker in all, got \[0, 0\]"),
    (dict(node_workers=(1, -1)), "node_workers must be integers >= 0"),
    (dict(node_workers=(1, 2, 3)), r"node_workers must give one value per node \(2\), got 3"),
])
def test_per_node_settings_are_checked(kw, message):
    from autosync.testbed.config import TestbedConfig

    with pytest.raises(ConfigError, match=message):
        TestbedConfig(nodes=2, **kw)


def test_a_list_of_rates_is_a_rate_per_host():   # what the benchmarks' --bandwidth passes to Testbed
    from autosync.testbed.config import TestbedConfig

    c = TestbedConfig(nodes=3, bandwidth="100mbit, 1000mbit,1gbit")
    assert (c.bandwidth, c.node_bandwidths, c.rates_bps) == ("100mbit", ("100mbit", "1gbit", "1gbit"),
                                                             (100_000_000, 1_000_000_000, 1_000_000_000))
    with pytest.raises(ConfigError, match=r"node_bandwidths must give one value per node \(2\), got 3"):
        TestbedConfig(nodes=2, bandwidth="1gbit,1gbit,1gbit")


def test_per_node_settings_survive_the_state_file_and_a_reshape(tmp_path):
    st = state.new_state(like_config(MIXED, 2).config, tmp_path)
    state.save_state(st, tmp_path)
    back = state.load_state(tmp_path)
    assert back == st and back.config.node_bandwidths == ("250mbit", "50mbit", "500mbit")
    reshaped = state.set_bandwidth(back, "100mbit", tmp_path).config   # `testbed shape`: every host alike
    assert reshaped.rates_bps == (100_000_000,) * 3 and reshaped.workers_of == (2, 1, 0)


def test_oversubscription_warning():
    cfg = dataclasses.replace(like_config(ClusterSpec("x", (NodeSpec("a"), NodeSpec("b"), NodeSpec("c"))), 5).config)
    assert "3 workers (3 nodes x 1) on 2 cores" in oversubscription_warning(cfg, 2)
    assert oversubscription_warning(cfg, 4) is None


@pytest.mark.parametrize("argv, message", [
    (["--dilation", "10"], "--dilation scales the links of a target cluster: give it with --like"),
    (["--like", "PAPER", "--bandwidth", "1gbit"], "--like takes the bandwidth from"),
    (["--like", "PAPER", "--dilation", "0"], "--dilation must be a number"),
    (["--like", "nope.yaml", "--dilation", "2"], "nope.yaml"),
    (["--like", "PAPER", "--dilation", "250", "--nodes", "0"], "--nodes 0 with --like: the target"),
])
def test_bad_combinations_exit_2(tmp_path, monkeypatch, capsys, paper_b, argv, message):
    monkeypatch.setenv(state.ENV_DIR, str(tmp_path))
    argv = [paper_b if a == "PAPER" else a for a in argv]
    assert _cli(["testbed", "up", *argv], monkeypatch) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / state.STATE_FILE).exists()


def test_up_like_writes_the_scaled_cluster_spec(tmp_path, monkeypatch, capsys, paper_b):
    """The whole `up --like` path with the system calls replaced: what lands in cluster.yaml."""
    monkeypatch.setenv(state.ENV_DIR, str(tmp_path))
    for mod, name in ((netns, "check_requirements"), (netns, "create_lan"), (netns, "shape"),
                      (ray_nodes, "ray_executable"), (ray_nodes, "start_nodes")):
        monkeypatch.setattr(mod, name, lambda *a, **k: None)
    monkeypatch.setattr(netns, "namespace_exists", lambda ns: False)
    monkeypatch.setattr(ray_nodes, "probe", lambda *a, **k: {"ok": True, "alive": []})
    monkeypatch.setattr(ray_nodes, "testbed_env", lambda d: {})
    assert _cli(["testbed", "up", "--like", paper_b, "--dilation", "250", "--object-store-mb", "200"],
                monkeypatch) == 0
    out = capsys.readouterr()
    assert "like paper_4x4t4_50gbit (4 workers per node, compute dilation 250)" in out.out
    assert "16 workers (4 nodes x 4) on" in out.err or (os.cpu_count() or 1) >= 16
    spec = load(str(tmp_path / state.CLUSTER_FILE), "cluster")
    assert [n.name for n in spec.nodes] == ["host0", "host1", "host2", "host3"]
    assert {(n.bandwidth_gbps, n.workers) for n in spec.nodes} == {(0.2, 4)}
    assert spec.compute_dilation == 250.0 and spec.compute == "real"
    assert tb_mod._dir(tmp_path) == tmp_path.resolve()


def _system_replaced(tmp_path, monkeypatch) -> list:
    """``up`` with the system calls replaced; returns the list each ``netns.shape`` call's rates land in."""
    monkeypatch.setenv(state.ENV_DIR, str(tmp_path))
    shaped = []
    for mod, name in ((netns, "check_requirements"), (netns, "create_lan"), (ray_nodes, "ray_executable"),
                      (ray_nodes, "start_nodes")):
        monkeypatch.setattr(mod, name, lambda *a, **k: None)
    monkeypatch.setattr(netns, "shape", lambda switch, rates: shaped.append(list(rates)))
    monkeypatch.setattr(netns, "namespace_exists", lambda ns: False)
    monkeypatch.setattr(ray_nodes, "probe", lambda *a, **k: {"ok": True, "alive": []})
    monkeypatch.setattr(ray_nodes, "testbed_env", lambda d: {})
    return shaped


def test_up_with_a_rate_per_host(tmp_path, monkeypatch, capsys):
    shaped = _system_replaced(tmp_path, monkeypatch)
    assert _cli(["testbed", "up", "--bandwidth", "500mbit, 100mbit"], monkeypatch) == 0
    assert shaped == [[500_000_000, 100_000_000]]
    assert "host0, host1 at host0 500mbit, host1 100mbit;" in capsys.readouterr().out
    spec = load(str(tmp_path / state.CLUSTER_FILE), "cluster")
    assert [(n.workers, n.bandwidth_gbps) for n in spec.nodes] == [(1, 0.5), (1, 0.1)]


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "1gbit,2gbit", "--nodes", "3"], "--bandwidth 1gbit,2gbit gives 2 rates for --nodes 3: give one"),
    (["--bandwidth", "1gbit,,2gbit"], "bandwidth '' is not a rate"),
])
def test_bad_rates_per_host_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    _system_replaced(tmp_path, monkeypatch)
    assert _cli(["testbed", "up", *argv], monkeypatch) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / state.STATE_FILE).exists()


def test_up_like_a_mixed_cluster_shapes_each_host_at_its_own_rate(tmp_path, monkeypatch, capsys):
    shaped = _system_replaced(tmp_path, monkeypatch)
    from strategy_space.yaml_io import save

    save(MIXED, str(tmp_path / "mixed.yaml"))
    assert _cli(["testbed", "up", "--like", str(tmp_path / "mixed.yaml"), "--dilation", "2"], monkeypatch) == 0
    assert shaped == [[250_000_000, 50_000_000, 500_000_000]]
    assert ("at host0 250mbit, host1 50mbit, host2 500mbit like mixed (workers per node 2, 1, 0, compute dilation 2)"
            in capsys.readouterr().out)
    spec = load(str(tmp_path / state.CLUSTER_FILE), "cluster")
    assert [(n.workers, n.bandwidth_gbps) for n in spec.nodes] == [(2, 0.25), (1, 0.05), (0, 0.5)]
