"""A full disk or a read-only file system met while a command writes its output: one message and
exit code 2, no traceback; and a tuning run's result is not lost with it."""
from __future__ import annotations

import errno
import types

import pytest

from autosync.cli import main
from strategy_space import load, save
from strategy_space.builders import get_builder
from strategy_space.errors import ConfigError
from tests.fakes import three_node_cluster, tiny_model


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_an_output_the_disk_refuses_is_one_message_exit_2(tmp_path, capsys, monkeypatch, code):
    import autosync.cli.offline as offline

    def refused(obj, path):
        raise OSError(code, "No space left on device" if code == errno.ENOSPC else "Read-only file system", str(path))

    monkeypatch.setattr(offline, "save", refused)
    model, cluster = tmp_path / "m.yaml", tmp_path / "c.yaml"
    save(tiny_model(), model)
    save(three_node_cluster(), cluster)
    out = tmp_path / "s.yaml"
    assert main(["build", "--builder", "ps", "--model", str(model), "--cluster", str(cluster), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autosync build: error: cannot write {out}: ") and "Traceback" not in err
    assert "make room" in err and len(err.strip().splitlines()) == 1


def test_other_os_errors_are_not_dressed_as_a_full_disk(tmp_path, monkeypatch):
    import autosync.cli.offline as offline

    def broken(obj, path):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(offline, "save", broken)
    model, cluster = tmp_path / "m.yaml", tmp_path / "c.yaml"
    save(tiny_model(), model)
    save(three_node_cluster(), cluster)
    with pytest.raises(OSError, match="Bad file descriptor"):
        main(["build", "--builder", "ps", "--model", str(model), "--cluster", str(cluster), "--out",
              str(tmp_path / "s.yaml")])


def _result(tmp_path, save_fails: bool):
    strategy = get_builder("parallax").build(tiny_model(), three_node_cluster())

    def save_to(path):
        if save_fails:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        from strategy_space import save as write

        write(strategy, path)

    return types.SimpleNamespace(best_strategy=strategy, save=save_to, store_path=str(tmp_path / "t.db"),
                                 outcome=types.SimpleNamespace(run_id="r1"))


def test_tune_prints_the_best_strategy_it_cannot_write(tmp_path, capsys):
    """Hours of tuning must not end with nothing: the YAML goes to stderr, the message says where
    the trials are and how to get the report."""
    from autosync.cli.tune import _write_results

    with pytest.raises(ConfigError, match=r"cannot write the best strategy to .*best.yaml \(No space left on "
                                          r"device\); it is printed above.*autosync report --store .*t.db --run r1"):
        _write_results(_result(tmp_path, True), str(tmp_path / "best.yaml"), tmp_path / "report")
    err = capsys.readouterr().err
    printed = tmp_path / "printed.yaml"
    printed.write_text(err)
    assert load(printed, "strategy").variables == _result(tmp_path, True).best_strategy.variables
    assert not (tmp_path / "report").exists()


def test_tune_says_a_report_it_cannot_write_after_the_strategy(tmp_path, monkeypatch):
    import autosync.report as report

    def full(store, out, run_id=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(report, "write_report", full)
    from autosync.cli.tune import _write_results

    with pytest.raises(ConfigError, match=r"cannot write the report to .*report \(No space left on device\); the "
                                          r"best strategy was written to .*best.yaml.*--run r1 --out"):
        _write_results(_result(tmp_path, False), str(tmp_path / "best.yaml"), tmp_path / "report")
    assert load(tmp_path / "best.yaml", "strategy").variables == _result(tmp_path, False).best_strategy.variables
