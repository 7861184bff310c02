"""Issue 17, item 3: every YAML AutoSync reads refuses alias bombs, recursive aliases and runaway
nesting quickly and with a clear message; error messages quote huge values only in part."""
from __future__ import annotations

import os
import tracemalloc

import pytest

from strategy_space import ConfigError, load, save
from strategy_space.strict import get_typed
from strategy_space.builders import get_builder
from tests.fakes import three_node_cluster, tiny_model
from tuner.search.constraints import load_constraints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def anchors(levels: int, fan: int = 9, indent: str = "      ") -> str:
    """Nested anchors: level i is a list of ``fan`` aliases of level i-1 (fan**levels leaves)."""
    lines = [f"{indent}- &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{indent}- &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels)]
    return "\n".join(lines)


def bombs() -> dict[str, tuple[str, str]]:
    """One file per loader, the bomb inside a field that loader allows (kind -> (file, text))."""
    deep = anchors(12)
    return {
        "model": ("model.yaml", "kind: model\nversion: 1\nname: m\nbatch_size: 8\nvariables:\n"
                                f"- name: v\n  shape:\n{deep}\n"),
        "cluster": ("cluster.yaml", "kind: cluster\nversion: 1\nname: c\nnodes:\n"
                                    f"- name: n0\n  address:\n{deep}\n"),
        "strategy": ("s.yaml", "kind: strategy\nversion: 1\nvariables:\n"
                               f"- var: v\n  ps:\n    destination:\n{deep}\n"),
        "constraints": ("c.yaml", f"kind: constraints\nvariables:\n- match:\n{deep}\n"),
    }


def _load(kind, path):
    return load_constraints(str(path)) if kind == "constraints" else load(path, kind)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["model", "cluster", "strategy", "constraints"])
def test_an_alias_bomb_is_refused_before_it_expands(tmp_path, kind):
    name, text = bombs()[kind]
    assert len(text) < 2000   # a 1 KB file that stands for 9**12 values
    path = tmp_path / name
    path.write_text(text)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as info:
            _load(kind, path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert msg.startswith(str(path)) and "aliases" in msg and "\n" not in msg and len(msg) < 500, msg
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("text, why", [("kind: model\nname: &a [x, *a]\n", "recursive alias"),
                                       ("kind: model\nname: " + "[" * 3000 + "]" * 3000 + "\n", "nesting deeper")])
def test_recursive_aliases_and_deep_nesting_are_refused(tmp_path, text, why):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        load(path, "model")


def test_a_few_aliases_still_load(tmp_path):
    """Aliases are YAML: a file that shares a value through an anchor loads as written out."""
    model, cluster = tiny_model(), three_node_cluster()
    s = get_builder("ps").build(model, cluster)
    path = tmp_path / "s.yaml"
    save(s, path)
    flow = "{destination: h0, local_replication: false, sync: true, staleness: 0}"
    head, rest = path.read_text().split(flow, 1)
    text = head + "&ps0 " + flow + rest.replace(flow, "*ps0")
    assert "*ps0" in text
    path.write_text(text)
    assert load(path, "strategy").variables == s.variables


@pytest.mark.parametrize("libyaml", [True, False])
def test_a_key_written_twice_in_one_mapping_is_refused(tmp_path, monkeypatch, libyaml):
    """PyYAML keeps the last of two equal keys silently: ``group: 0, group: 3`` would train
    group 3 while the writer reads group 0. Merged keys (``<<``) still give way to written ones."""
    import strategy_space.yaml_io as yaml_io

    if not libyaml:   # the pure-Python loader alone (PyYAML without libyaml)
        monkeypatch.setattr(yaml_io, "FastLoader", yaml_io.PlainLoader)
    model, cluster = tiny_model(), three_node_cluster()
    path = tmp_path / "s.yaml"
    save(get_builder("all_reduce").build(model, cluster), path)
    text = path.read_text()
    assert text.count("group: 0}") >= 2
    line = text[:text.index("group: 0}")].count("\n") + 1
    path.write_text(text.replace("group: 0}", "group: 0, group: 3}", 1))
    with pytest.raises(ConfigError, match=rf"line {line}, .*the key 'group' appears twice in one mapping"):
        load(path, "strategy")
    path.write_text(text.replace("version: 1\n", "version: 1\nversion: 1\n", 1))
    with pytest.raises(ConfigError, match="the key 'version' appears twice"):
        load(path, "strategy")
    path.write_text("base: &b {x: 1, y: 2}\nm: {<<: *b, x: 3}\n")
    assert yaml_io.parse_text(path.read_text()) == {"base": {"x": 1, "y": 2}, "m": {"x": 3, "y": 2}}


def test_a_directory_is_not_reported_as_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load(tmp_path, "model")
    for empty in ("", "  "):   # Path("") is the current folder: said as the empty path it is
        with pytest.raises(ConfigError, match="^the file path is empty; give the path of a YAML file$"):
            load(empty, "strategy")


def test_a_device_or_a_pipe_is_not_reported_as_a_missing_file(tmp_path):
    import os

    with pytest.raises(ConfigError, match="/dev/null is not a regular file; give the path of a YAML file"):
        load("/dev/null", "strategy")
    os.mkfifo(tmp_path / "pipe")   # reading a pipe nobody writes would block: refused before any read
    with pytest.raises(ConfigError, match="pipe is not a regular file"):
        load(tmp_path / "pipe", "strategy")


class _Loud:
    """A value whose repr is counted (a message must not repr every item of a huge value)."""

    calls = 0

    def __repr__(self):
        _Loud.calls += 1
        return "loud"


def test_messages_quote_only_the_start_of_a_huge_value():
    huge = [_Loud()] * 1_000_000
    _Loud.calls = 0
    with pytest.raises(ConfigError) as info:
        get_typed({"name": huge}, "name", str, "model")
    assert _Loud.calls < 10 and len(str(info.value)) < 200
    with pytest.raises(ConfigError) as info:
        get_typed({"name": "x" * 10**7}, "name", int, "model")
    assert len(str(info.value)) < 200


def test_the_text_written_does_not_depend_on_libyaml():
    """Stores keep each strategy's YAML: a machine with PyYAML's C emitter and one without must
    write the same text for what the product writes (every builder's strategy, samples, specs)."""
    import numpy as np
    import yaml

    from strategy_space import yaml_io
    from strategy_space.builders import build_all
    from strategy_space.space import StrategySpace

    class PlainDumper(yaml.SafeDumper):
        pass

    PlainDumper.add_representer(list, yaml_io._represent_list)
    PlainDumper.add_representer(dict, yaml_io._represent_dict)
    model = yaml_io.load_model_spec(os.path.join(REPO, "configs/models/dlrm.yaml"))
    cluster = yaml_io.load_cluster_spec(os.path.join(REPO, "configs/clusters/emulated_3x1gbit.yaml"))
    rng = np.random.default_rng(0)
    objects = [model, cluster, *build_all(model, cluster).values(),
               *(StrategySpace(model, cluster).sample(rng) for _ in range(5))]
    for obj in objects:
        plain = yaml.dump(obj.to_dict(), Dumper=PlainDumper, sort_keys=False, default_flow_style=False, width=120)
        assert yaml_io.dumps(obj) == plain
