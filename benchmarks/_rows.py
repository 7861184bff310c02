"""What every benchmark row carries and where rows go: the commit measured and a JSON file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

_WARNED: set[str] = set()


def commit() -> str:
    """Short hash of the checkout this benchmark runs from ("unknown" outside git)."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def ignored_by_git(path: str) -> bool:
    """Whether git would leave ``path`` out of a commit (``benchmarks/results/.gitignore`` ignores
    every file it does not list); False outside a git checkout or when git cannot say."""
    where = os.path.dirname(os.path.abspath(path))
    try:
        r = subprocess.run(["git", "-C", where, "check-ignore", "-q", os.path.abspath(path)],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def warn_if_ignored(path: str) -> None:
    """Say once per file, on stderr, that a result just written is ignored by git and would be lost
    with the checkout, and how to keep it (how the first collective_latency results were lost)."""
    key = os.path.abspath(path)
    if key in _WARNED or not ignored_by_git(path):
        return
    _WARNED.add(key)
    print(f"note: {path} is ignored by git and will not be committed; to keep it, add the line "
          f"'!{os.path.basename(path)}' to the .gitignore that ignores it (git check-ignore -v {path} "
          f"names it)", file=sys.stderr)


def write_rows(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` as JSON to ``path`` (nothing when no path was asked for); warns when git
    ignores the file."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        warn_if_ignored(path)
