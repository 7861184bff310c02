"""What every benchmark row carries and where rows go: the commit measured and a JSON file."""
from __future__ import annotations

import json
import os
import subprocess


def commit() -> str:
    """Short hash of the checkout this benchmark runs from ("unknown" outside git)."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def write_rows(path: str | None, rows: list[dict]) -> None:
    """Write ``rows`` as JSON to ``path`` (nothing when no path was asked for)."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
