"""Issue 17: malformed, oversized and adversarial input to every YAML loader and every CLI command
that reads user input. Whatever the input, the answer is a success or one clear error (a
ConfigError, or exit code 2 with a one-paragraph message), never a traceback; no file is written
or changed; time and memory stay bounded (an alarm per example, peak RSS per test).

The ``testbed`` commands are left out: they change this machine's network namespaces, and a
valid generated value would reshape a testbed another process may be using.
"""
from __future__ import annotations

import hashlib
import os
import resource
import signal
import subprocess
import sys
from contextlib import contextmanager

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autosync.cli import main
from strategy_space import ConfigError, load, save
from strategy_space.builders import get_builder
from tests.conftest import CONFIGS, REPO
from tests.fakes import three_node_cluster, tiny_model
from tuner.search.constraints import load_constraints

# CI runs a fixed, small sample (derandomized); FUZZ_EXAMPLES=N explores N random examples instead
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 30)), deadline=None,
                derandomize="FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ALARM_S = 20          # no single input may take longer than this (a hang, an expansion)
RSS_GROWTH_MB = 400   # nor make the test process grow by more than this

# keys of AutoSync's formats, so generated mappings often reach deep into the parsers
KEYS = ["kind", "version", "name", "variables", "var", "shape", "dtype", "sparse", "rows_per_step", "batch_size",
        "profile", "step_time_s", "nodes", "address", "cpus", "gpus", "workers", "bandwidth_gbps", "chief",
        "partition", "shards", "axis", "ps", "all_reduce", "destination", "sync", "staleness", "compressor",
        "group", "backend", "replicas", "match", "local_replication", "hierarchical", "origin"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.sampled_from(["model", "cluster", "strategy", "constraints", "ps", "all_reduce", "h0", "node0",
                                     "fp16", "powersgd(0)", "zip", "*", "-1", "1e309", ""]),
                    st.text(max_size=40))
DOCS = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                    st.dictionaries(st.sampled_from(KEYS), kids, max_size=6)),
                    max_leaves=40)


def _valid_texts() -> list[str]:
    out = []
    for sub in ("models", "clusters", "strategies"):
        folder = os.path.join(CONFIGS, sub)
        for name in sorted(os.listdir(folder))[:2]:
            with open(os.path.join(folder, name)) as f:
                out.append(f.read())
    return out


VALID = _valid_texts()


def _bomb(levels: int) -> str:
    lines = ["- &a0 [x, x, x, x, x, x, x, x]"]
    lines += [f"- &a{i} [" + ", ".join([f"*a{i - 1}"] * 8) + "]" for i in range(1, levels)]
    return "kind: model\nname: m\nvariables:\n- var:\n" + "\n".join("  " + ln for ln in lines) + "\n"


ADVERSARIAL = st.one_of(
    st.integers(3, 14).map(_bomb),
    st.integers(65, 3000).map(lambda n: "kind: strategy\nvariables: " + "[" * n + "]" * n + "\n"),
    st.just("a: &a [*a]\n"),
    st.integers(10**5, 3 * 10**6).map(lambda n: "kind: cluster\nname: " + "x" * n + "\n"),
    st.just("kind: model\nvariables:\n" + "- {name: v, shape: [3]}\n" * 20000),
    st.just("\x00\xff\ufffe garbage"),
    st.just("kind: !!python/object/apply:os.system ['true']\n"),
)


@st.composite
def mutated_valid(draw) -> str:
    """A shipped config with one line deleted, duplicated or replaced."""
    lines = draw(st.sampled_from(VALID)).splitlines()
    i = draw(st.integers(0, len(lines) - 1))
    how = draw(st.sampled_from(["delete", "dup", "replace", "truncate"]))
    if how == "delete":
        del lines[i]
    elif how == "dup":
        lines.insert(i, lines[i])
    elif how == "truncate":
        lines = lines[:i]
    else:
        lines[i] = lines[i][: len(lines[i]) // 2] + draw(st.sampled_from([": ", "- ", "{", "]", "&x", "*x", "\t", "9" * 30]))
    return "\n".join(lines) + "\n"


INPUTS = st.one_of(
    DOCS.map(lambda d: yaml.safe_dump(d, default_flow_style=None)),
    st.text(max_size=300),
    mutated_valid(),
    ADVERSARIAL,
)


@contextmanager
def bounded():
    def fail(*_):
        raise AssertionError(f"an input took longer than {ALARM_S} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(ALARM_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _snapshot(root) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _check_message(msg: str) -> None:
    assert msg and "Traceback" not in msg and "\n\n" not in msg, msg[:2000]
    assert len(msg) < 20_000, f"a {len(msg)}-character message"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    save(tiny_model(profile=True), d / "model.yaml")
    save(three_node_cluster(), d / "cluster.yaml")
    save(get_builder("ps").build(tiny_model(), three_node_cluster()), d / "strategy.yaml")
    return d


def _write(workdir, text: str):
    path = workdir / "input.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    return path


@FUZZ
@given(text=INPUTS, kind=st.sampled_from(["strategy", "model", "cluster", "constraints"]))
def test_every_yaml_loader_answers_with_a_value_or_one_clear_error(workdir, text, kind):
    rss0 = _peak_mb()
    path = _write(workdir, text)
    before = _snapshot(workdir)
    with bounded():
        try:
            load_constraints(str(path)) if kind == "constraints" else load(path, kind)
        except ConfigError as e:
            _check_message(str(e))
    assert _snapshot(workdir) == before
    assert _peak_mb() - rss0 < RSS_GROWTH_MB


# every command that reads a user file, the fuzzed file in each position it can take; a model
# that cannot load (a missing script) stops tune/run/baselines before TensorFlow or Ray
COMMANDS = [
    ["show", "{F}"],
    ["show", "{F}", "--model", "{W}/model.yaml", "--cluster", "{W}/cluster.yaml"],
    ["validate", "{F}", "--model", "{W}/model.yaml", "--cluster", "{W}/cluster.yaml"],
    ["validate", "{W}/strategy.yaml", "--model", "{F}", "--cluster", "{W}/cluster.yaml"],
    ["validate", "{W}/strategy.yaml", "--model", "{W}/model.yaml", "--cluster", "{F}"],
    ["build", "--builder", "partitioned_ps", "--model", "{F}", "--cluster", "{W}/cluster.yaml"],
    ["build", "--builder", "all_reduce", "--model", "{W}/model.yaml", "--cluster", "{W}/cluster.yaml",
     "--option", "compressor={T}"],
    ["inspect", "--model", "{F}"],
    ["simulate", "--model", "{F}", "--cluster", "{W}/cluster.yaml", "--strategy", "{W}/strategy.yaml"],
    ["simulate", "--model", "{W}/model.yaml", "--cluster", "{W}/cluster.yaml", "--strategy", "{F}"],
    ["simulate", "--eval", "{F}"],
    ["report", "--store", "{F}", "--out", "{W}/report"],
    ["tune", "--model", "{W}/missing.py:build", "--cluster", "{F}", "--warm-start", "none",
     "--store", "{W}/t.db", "--out", "{W}/best.yaml"],
    ["tune", "--model", "{W}/missing.py:build", "--constraints", "{F}", "--warm-start", "none",
     "--store", "{W}/t.db", "--out", "{W}/best.yaml"],
    ["tune", "--model", "{W}/missing.py:build", "--store", "{F}", "--warm-start", "{F}", "--out", "{W}/best.yaml"],
    ["run", "--model", "{W}/missing.py:build", "--strategy", "{F}"],
    ["baselines", "--model", "{W}/missing.py:build", "--cluster", "{F}"],
]


@FUZZ
@given(text=INPUTS, argv=st.sampled_from(COMMANDS), as_bytes=st.booleans())
def test_every_command_exits_0_or_2_with_one_message(workdir, capsys, text, argv, as_bytes):
    rss0 = _peak_mb()
    path = workdir / "input.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass") if not as_bytes else os.urandom(len(text) % 4096))
    before = _snapshot(workdir)
    args = [a.format(F=path, W=workdir, T=text[:200].replace("\x00", "")) for a in argv]
    with bounded():
        code = main(args)
    out, err = capsys.readouterr()
    assert code in (0, 2), (args, code, err[-2000:])
    if code == 2:
        assert err.startswith(f"autosync {argv[0]}: error: "), err[:2000]
        _check_message(err)
    assert "Traceback" not in err
    assert _snapshot(workdir) == before, args
    assert _peak_mb() - rss0 < RSS_GROWTH_MB


@pytest.mark.parametrize("argv, content", [
    (["show", "{F}"], _bomb(12)),
    (["report", "--store", "{F}", "--out", "{D}/r"], "SQLite format 3\x00" + "\x01" * 300),
])
def test_the_real_command_line_prints_no_traceback(tmp_path, argv, content):
    path = tmp_path / "input"
    path.write_text(content)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-m", "autosync", *[a.format(F=path, D=tmp_path) for a in argv]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"autosync {argv[0]}: error: ") and "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["input"]
