"""Issue 17 regressions at the command line: what a new user's run broke (in-process ``main``)."""
from __future__ import annotations

import os

import pytest

from autosync.cli import main
from strategy_space import save
from tests.fakes import three_node_cluster, tiny_model


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def _one_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"autosync {command}: error: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("content", [b"SQLite format 3\x00" + b"\x00" * 200, os.urandom(3000),
                                     b"just some notes\n"], ids=["truncated", "random", "text"])
@pytest.mark.parametrize("argv", [["report", "--store", "{db}", "--out", "{tmp}/report"],
                                  ["tune", "--store", "{db}", "--warm-start", "none", "--out", "{tmp}/best.yaml"],
                                  ["tune", "--resume", "--store", "{db}", "--warm-start", "none"],
                                  ["simulate", "--eval", "{db}"]],
                         ids=["report", "tune", "tune-resume", "simulate-eval"])
def test_a_damaged_store_is_one_message_exit_2_and_left_untouched(tmp_path, capsys, content, argv):
    """Issue 17, item 2."""
    db = tmp_path / "trials.db"
    db.write_bytes(content)
    before = _files(tmp_path)
    code = main([a.format(db=db, tmp=tmp_path) for a in argv])
    err = _one_error(capsys, argv[0])
    assert code == 2 and "not a readable AutoSync trial store" in err and str(db) in err
    assert _files(tmp_path) == before   # nothing written, nothing changed, no report folder
