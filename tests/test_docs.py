"""Issue 29: the README stays a front page (at most 250 lines) whose links resolve, and every
result file the README or a docs page names exists (a figure always names the file it comes from)."""
from __future__ import annotations

import glob
import os
import re
import subprocess

from tests.conftest import REPO

PAGES = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_the_readme_is_a_front_page():
    assert len(_text(PAGES[0]).splitlines()) <= 250


def test_every_relative_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _text(page)):
            assert os.path.exists(os.path.join(os.path.dirname(page), target)), f"{page}: link to {target}"


def test_every_result_file_named_exists():
    """Named with its folder (``archive/NAME`` under it), or bare (``ps_step_profile_emulated.json``)
    after a sibling of the same family or after the benchmark that writes it (``collective_latency_*``
    from ``benchmarks/collective_latency.py``, even where no file of that family is there): either
    must be there, and not ignored by git (a clean clone would lack it). (Other bare names, such as
    the testbed's ``state.json``, are not result files.)"""
    results = os.path.join(REPO, "benchmarks", "results")
    families = {f.split("_")[0] for f in os.listdir(results)}
    scripts = [os.path.basename(f)[:-3] for f in glob.glob(os.path.join(REPO, "benchmarks", "[a-z]*.py"))]
    named, cited = 0, set()
    for page in PAGES:
        for prefix, name in re.findall(r"(benchmarks/results/)?\b((?:archive/)?[a-z0-9_]+\.(?:json|png))\b", _text(page)):
            stem = os.path.basename(name).rsplit(".", 1)[0]
            if (prefix or stem.split("_")[0] in families
                    or any(stem == s or stem.startswith(s + "_") for s in scripts)):
                named += 1
                assert os.path.exists(os.path.join(results, name)), f"{page} names {name}, which is not in benchmarks/results"
                cited.add(name)
    assert named > 25
    # a cited file that git ignores exists only on the machine that measured it: a clean clone lacks it
    # (benchmarks/results/.gitignore ignores every file it does not list)
    check = subprocess.run(["git", "check-ignore", "--stdin"], cwd=results, input="\n".join(sorted(cited)),
                           capture_output=True, text=True)
    if check.returncode in (0, 1):   # 0: some ignored, 1: none; anything else: not a git checkout
        assert not check.stdout.split(), f"cited but ignored by git (list them in benchmarks/results/.gitignore): {check.stdout.split()}"
