"""Warm-start data: trials measured elsewhere that the predictor learns from before (and besides)
the user's own store.

AutoSync ships a dataset it measured itself on its emulated testbed (``benchmarks/make_warmstart.py``
made it): ``BUILTIN_PATH``, a gzip-compressed TrialStore. ``load_warm_start`` reads that, or any
TrialStore file (``.db`` or ``.db.gz``), into (model, cluster, trials) groups; the groups are only
read, never copied into the user's store.
"""
from __future__ import annotations

import gzip
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from strategy_space import ClusterSpec, ModelSpec
from strategy_space.errors import ConfigError

from tuner.records.trial import Trial

BUILTIN_PATH = Path(__file__).parent.parent / "data" / "warmstart.db.gz"
CHOICES = "'builtin' (the dataset shipped with AutoSync), 'none', or a trial store file (.db or .db.gz)"

Group = tuple[ModelSpec, ClusterSpec, list[Trial]]


def resolve_warm_start(source: str | os.PathLike | None) -> Path | None:
    """The file ``source`` names (None for ``none``).

    Raises:
        ConfigError: an unknown word or a missing file.
    """
    if source is None or str(source) == "none":
        return None
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"warm start must be builtin, none or a trial store path (a str or a path), got "
                          f"{type(source).__name__} {source!r:.80}")
    path = BUILTIN_PATH if str(source) == "builtin" else Path(source)
    if not path.is_file():
        if str(source) == "builtin":
            raise ConfigError(f"the built-in warm-start dataset {path} is missing from this installation; "
                              f"reinstall AutoSync or pass --warm-start none")
        raise ConfigError(f"warm start {str(source)!r}: no such file; use {CHOICES}")
    return path


def _open_store(path: Path, scratch: str):
    from tuner.records.store import TrialStore

    if path.suffix == ".gz":
        plain = os.path.join(scratch, path.stem)
        with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst)
        path = Path(plain)
    return TrialStore(path)


def load_warm_start(source: str | os.PathLike | None, *, exclude_models: Iterable[str] = (),
                    exclude_groups: Iterable[tuple[str, str]] = ()) -> list[Group]:
    """The groups of a warm-start dataset (see the module doc).

    Args:
        source: ``builtin``, ``none``/None or a TrialStore path (``.db``, ``.db.gz``).
        exclude_models: model names to leave out (e.g. to measure transfer to an unseen model).
        exclude_groups: (model fingerprint, cluster fingerprint) pairs to leave out.

    Raises:
        ConfigError: the source does not exist or is not a trial store.
    """
    from tuner.records.dataset import store_groups
    from tuner.records.store import StoreError

    path = resolve_warm_start(source)
    if path is None:
        return []
    names, keys = set(exclude_models), set(exclude_groups)
    with tempfile.TemporaryDirectory(prefix="autosync-warm-") as scratch:
        try:
            store = _open_store(path, scratch)
        except StoreError as e:
            raise ConfigError(f"warm start: {e}; use {CHOICES}") from None
        except (OSError, EOFError, gzip.BadGzipFile) as e:   # a damaged .gz
            raise ConfigError(f"warm start {path}: not a readable AutoSync trial store ({e}); use {CHOICES}") from None
        with store:
            groups = store_groups(store)
    return [(m, c, ts) for m, c, ts in groups
            if m.name not in names and (m.fingerprint, c.fingerprint) not in keys]


def merge_groups(*sources: Sequence[Group]) -> list[Group]:
    """One group per (model, cluster) with the trials of every source (a measurement present in
    several sources, e.g. a store that imported the dataset, counts once)."""
    from tuner.records.store import trial_uid

    out: dict[tuple[str, str], Group] = {}
    seen: dict[tuple[str, str], set] = {}
    for groups in sources:
        for model, cluster, trials in groups:
            key = (model.fingerprint, cluster.fingerprint)
            if key not in out:
                out[key], seen[key] = (model, cluster, []), set()
            for t in trials:
                uid = trial_uid(t)
                if uid not in seen[key]:
                    seen[key].add(uid)
                    out[key][2].append(t)
    return list(out.values())
