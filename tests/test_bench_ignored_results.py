"""A benchmark that writes a result git would ignore says so, once, with the fix (the first
collective_latency results were written, quoted and lost because ``benchmarks/results/.gitignore``
did not list them)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import _rows  # noqa: E402
import _testbed  # noqa: E402


def _repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    results = tmp_path / "results"
    results.mkdir()
    (results / ".gitignore").write_text("*\n!.gitignore\n!kept.json\n")
    return results


def test_a_result_git_ignores_is_reported_once_with_the_line_that_keeps_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_rows, "_WARNED", set())
    results = _repo(tmp_path)
    lost = str(results / "lost.json")
    _testbed.write_json(lost, {"a": 1})
    _testbed.write_json(lost, {"a": 2})   # partial results rewrite the file: one note is enough
    err = capsys.readouterr().err
    assert err.count("is ignored by git") == 1
    assert "'!lost.json'" in err
    _rows.write_rows(str(results / "kept.json"), [{"b": 1}])
    assert capsys.readouterr().err == ""


def test_outside_a_git_checkout_nothing_is_said(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_rows, "_WARNED", set())
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    _testbed.write_json(str(tmp_path / "x.json"), {"a": 1})
    assert capsys.readouterr().err == ""
    assert not _rows.ignored_by_git(str(tmp_path / "x.json"))
