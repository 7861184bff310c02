"""Issue 29: where the main job's results go. ``autosync tune`` with no output flags writes the best
strategy and the HTML report into the run's folder beside its trial store (the user's cache by
default), never into the current folder, and says where; ``autosync report`` with no flags remakes
that report from the store ``tune`` used. End to end through the command line, with the synthetic
runner in place of Ray (as ``test_api_tune``)."""
from __future__ import annotations

import pytest

from autosync.cli import main
from strategy_space import dumps, load_strategy
from tests.fakes import patch_tune_runner, three_node_cluster, tiny_model


@pytest.fixture
def fake_tune(tmp_path, monkeypatch):
    """A user's checkout as the current folder, a private cache, and the synthetic runner."""
    model, cluster = tiny_model(profile=True), three_node_cluster()

    patch_tune_runner(monkeypatch, model, cluster)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "c.yaml").write_text(dumps(cluster))
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    return ["tune", "--cluster", str(tmp_path / "c.yaml"), "--trials", "1", "--confirm", "0", "--warm-start", "none"]


def test_tune_writes_strategy_and_report_beside_the_store_and_report_finds_them(fake_tune, tmp_path, capsys):
    assert main(fake_tune) == 0
    out = capsys.readouterr().out
    assert list((tmp_path / "checkout").iterdir()) == []   # nothing lands in the current folder
    cache = tmp_path / "cache" / "autosync"
    (run,) = (cache / "runs").iterdir()
    assert run.name.startswith(f"{tiny_model().name}-{three_node_cluster().name}-")
    best, page = run / "best_strategy.yaml", run / "report" / "index.html"
    assert load_strategy(best).variables and "AutoSync tuning report" in page.read_text()
    assert f"best strategy written to {best}\n" in out and f"report written to {page}\n" in out
    assert f"trials stored in {cache / 'trials.db'}" in out

    # `autosync report` alone: the store tune used by default, its latest run, the same folder
    page.unlink()
    assert main(["report"]) == 0
    assert capsys.readouterr().out == f"report written to {page}\n" and page.exists()


def test_no_report_writes_the_strategy_alone_and_explicit_paths_are_kept(fake_tune, tmp_path, capsys):
    assert main(fake_tune + ["--no-report", "--json"]) == 0
    import json

    summary = json.loads(capsys.readouterr().out)
    (run,) = (tmp_path / "cache" / "autosync" / "runs").iterdir()
    assert summary["out"] == str(run / "best_strategy.yaml") and summary["report"] is None
    assert [p.name for p in run.iterdir()] == ["best_strategy.yaml"]
    assert main(fake_tune + ["--out", "mine.yaml", "--report", "rep", "--resume"]) == 0   # where the user says
    assert "best strategy written to mine.yaml" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "checkout").iterdir()) == ["mine.yaml", "rep"]
    assert main(fake_tune + ["--report", "r", "--no-report"]) == 2
    assert "--no-report and --report DIR contradict each other" in capsys.readouterr().err


def test_tune_timeout_limits_each_trial_and_bad_values_are_refused(fake_tune, monkeypatch, capsys):
    """tune had no per-trial limit on the command line (run and baselines had --timeout): a dataset
    that hangs on one worker cost 300 s a trial; ``--timeout 20`` recorded each as timed out after
    20 s and the run ended in 53 s (by hand)."""
    import autosync.api

    seen = {}
    make = autosync.api.make_runner

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return make(*args, **kwargs)

    monkeypatch.setattr(autosync.api, "make_runner", recording)
    assert main(fake_tune + ["--timeout", "20", "--no-report"]) == 0
    assert seen["trial_timeout_s"] == 20.0
    capsys.readouterr()
    for bad in ("0", "-1", "inf", "nan"):
        assert main(fake_tune + ["--timeout", bad]) == 2
        assert f"--timeout must be a number of seconds > 0, got {float(bad)}" in capsys.readouterr().err
