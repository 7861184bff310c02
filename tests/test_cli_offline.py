import os
import subprocess
import sys

import pytest
import yaml

from autosync.cli import main
from strategy_space import load_strategy, save, validate
from tests.conftest import CONFIGS, REPO
from tests.fakes import three_node_cluster, tiny_model


@pytest.fixture
def specs(tmp_path):
    model, cluster = tmp_path / "model.yaml", tmp_path / "cluster.yaml"
    save(tiny_model(), model)
    save(three_node_cluster(), cluster)
    return str(model), str(cluster)


def test_build_writes_valid_yaml(specs, tmp_path, capsys):
    model, cluster = specs
    out = tmp_path / "s.yaml"
    assert main(["build", "--builder", "parallax", "--model", model, "--cluster", cluster, "--out", str(out)]) == 0
    s = load_strategy(out)
    validate(s, tiny_model(), three_node_cluster())
    assert s.origin == "parallax"


def test_build_to_stdout_with_option(specs, capsys):
    model, cluster = specs
    assert main(["build", "--builder", "all_reduce", "--model", model, "--cluster", cluster,
                 "--option", "compressor=fp16", "--option", "chunk_bytes=1024"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["kind"] == "strategy"
    assert any(v.get("all_reduce", {}).get("compressor") == "fp16" for v in doc["variables"])


def test_validate_ok_and_bad(specs, tmp_path, capsys):
    model, cluster = specs
    good = tmp_path / "good.yaml"
    main(["build", "--builder", "ps_lb", "--model", model, "--cluster", cluster, "--out", str(good)])
    assert main(["validate", str(good), "--model", model, "--cluster", cluster]) == 0
    assert "valid for model tiny (6 variables) on cluster three (3 nodes, 3 replicas)" in capsys.readouterr().out
    # the file as run and probe take it, --strategy FILE, works too; neither or both is refused
    assert main(["validate", "--strategy", str(good), "--model", model, "--cluster", cluster]) == 0
    assert main(["show", "--strategy", str(good)]) == 0
    assert f"{good}: valid for model tiny" in capsys.readouterr().out
    for given in ([], [str(good), "--strategy", str(good)]):
        assert main(["validate", *given, "--model", model, "--cluster", cluster]) == 2
        assert "autosync validate: error: give the strategy YAML file once: autosync validate FILE (or --strategy " \
               "FILE)" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("destination: h1", "destination: h9"))
    assert main(["validate", str(bad), "--model", model, "--cluster", cluster]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "ps.destination 'h9' is not a node of cluster three; allowed: h0, h1, h2" in err


def test_show_table_and_totals(specs, tmp_path, capsys):
    model, cluster = specs
    f = tmp_path / "p.yaml"
    main(["build", "--builder", "parallax", "--model", model, "--cluster", cluster, "--out", str(f)])
    capsys.readouterr()
    assert main(["show", str(f), "--model", model, "--cluster", cluster]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("embedding/embeddings"))
    assert "sparse" in line and " PS " in line
    assert any(order in line for order in ("h0,h1,h2", "h1,h2,h0", "h2,h0,h1"))
    assert "bytes per parameter-server node" in out and "all-reduce fusion groups" in out
    assert "1 on parameter servers, 5 all-reduced" in out


def test_bert_parallax_on_4x4_cluster(tmp_path, capsys):
    bert = os.path.join(CONFIGS, "models", "bert_base.yaml")
    if not os.path.exists(bert):
        pytest.fail("configs/models/bert_base.yaml is missing")
    cluster = os.path.join(CONFIGS, "clusters", "paper_4x4t4_50gbit.yaml")
    f = tmp_path / "bert.yaml"
    assert main(["build", "--builder", "parallax", "--model", bert, "--cluster", cluster, "--out", str(f)]) == 0
    capsys.readouterr()
    assert main(["show", str(f), "--model", bert, "--cluster", cluster]) == 0
    out = capsys.readouterr().out
    from strategy_space import load_model_spec

    spec = load_model_spec(bert)
    sparse = [v for v in spec.variables if v.sparse]
    # BERT's token embedding is tied to the MLM output layer, so its gradient is dense (as in
    # Google's BERT); the segment embedding is the sparse one
    assert sparse, "BERT has a sparse embedding"
    for var in sparse:
        row = next(l for l in out.splitlines() if l.startswith(var.name + " "))
        nodes = row.split()[6].split(",")
        assert " PS " in row and len(nodes) == len(set(nodes)) == min(4, var.shape[0])
    dense = [l for l in out.splitlines() if " dense " in l]
    assert dense and all(" AR " in l and " g" in l for l in dense)


def test_bad_input_exit_2_without_traceback(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("kind: strategy\nvariables: [\n")
    for args in (["show", str(f)], ["show", str(tmp_path / "missing.yaml")],
                 ["build", "--builder", "nope", "--model", "x.yaml", "--cluster", "local"],
                 ["validate", str(f), "--model", "m.yaml", "--cluster", "nowhere"]):
        r = subprocess.run([sys.executable, "-m", "autosync", *args], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr


@pytest.mark.parametrize("builder", ["partitioned_ps", "partitioned_all_reduce"])
def test_show_names_a_few_of_many_shards_and_counts_each_group_s_variables(builder, tmp_path, capsys):
    from strategy_space import AllReduce, ClusterSpec, NodeSpec, load_model_spec

    bert = os.path.join(CONFIGS, "models", "bert_base.yaml")
    cluster = tmp_path / "c64.yaml"
    save(ClusterSpec("c64", tuple(NodeSpec(f"n{i}", address=f"10.0.{i}.1", bandwidth_gbps=10.0) for i in range(64))),
         cluster)
    f = tmp_path / "s.yaml"
    assert main(["build", "--builder", builder, "--model", bert, "--cluster", str(cluster), "--out", str(f)]) == 0
    capsys.readouterr()
    assert main(["show", str(f), "--model", bert]) == 0
    out = capsys.readouterr().out
    strategy, spec = load_strategy(f), load_model_spec(bert)
    wide = [c for c in strategy.variables if c.num_shards == 64]
    assert wide, "some variable spans every node"
    for c in wide:
        row = next(line for line in out.splitlines() if line.startswith(c.name + " "))
        first = c.synchronizers[0]
        name = first.destination if builder == "partitioned_ps" else f"g{first.group}"
        assert f" {name},", row
        assert ",...," in row and "(64 distinct)" in row and len(row) < 200, row
    if builder == "partitioned_all_reduce":
        groups = out[out.index("all-reduce fusion groups"):].splitlines()[3:]
        counted = {line.split()[0]: int(line.split()[-1]) for line in groups if line.startswith("g")}
        expect = {}
        for c in strategy.variables:
            for g in {s.group for s in c.synchronizers if isinstance(s, AllReduce)}:
                expect[f"g{g}"] = expect.get(f"g{g}", 0) + 1
        assert counted == expect and len(counted) > 64
    assert len(spec.variables) == len(strategy.variables)


@pytest.mark.parametrize("argv,said", [
    (["tune", "--trails", "5"], "autosync tune: error: unrecognized arguments: --trails 5 (--trails: did you mean "
                                "--trials?); see autosync tune --help"),
    (["run", "--model", "zoo:ncf", "--strategy", "ps", "--setps=3"], "autosync run: error: unrecognized arguments: "
                                                                     "--setps=3 (--setps: did you mean --steps?)"),
    (["testbed", "up", "--nodse", "3"], "autosync testbed up: error: unrecognized arguments: --nodse 3 (--nodse: did "
                                        "you mean --nodes?)"),
    (["builders", "--zzz"], "autosync builders: error: unrecognized arguments: --zzz; see autosync builders --help"),
])
def test_an_unknown_argument_is_said_by_its_command_with_the_option_meant(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err, err
    assert err.startswith(f"usage: autosync {' '.join(argv[:2 if argv[0] == 'testbed' else 1])} ")   # its own usage
