"""Trainer checkpoints on disk: a directory written atomically, its weights readable by Keras.

A checkpoint directory holds one committed checkpoint at a time::

    ckpt/
      manifest.json            # the commit point: names the step directory below
      step-00000040/
        model.weights.h5       # ``model.save_weights``: ``keras.Model.load_weights`` reads it
        state.npz              # optimizer slots of every PS shard and of the all-reduced variables,
                               # each worker's random-layer generator states

``CheckpointStore.write`` writes a new step directory under a temporary name, fsyncs every file
and the directory, renames it, then replaces ``manifest.json`` (written to a temporary file and
fsynced first) with ``os.replace``, and only then deletes the previous step directory. A crash at
any point leaves ``manifest.json`` naming a complete step directory: the previous checkpoint, or
the new one once the replace happened. Leftovers of an interrupted write (``.tmp-*``) are removed
by the next write.

The manifest is plain data (``Manifest``): format version, global step, each worker's data
position, the model's variables and optimizer class, the strategy and its fingerprint, and each
parameter server's update counters. What the state belongs to is checked against the trainer that
restores it (``Manifest.mismatches``) before anything is loaded.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from autosync.runtime.state_file import StateFile
from strategy_space.errors import ConfigError, short_repr
from strategy_space.yaml_io import nearest_existing

FORMAT = "autosync-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "model.weights.h5"
STATE = "state.npz"
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Manifest:
    """What one checkpoint holds, besides its arrays.

    Attributes:
        step: the global step the state is at (steps trained so far).
        data_positions: per worker (replica order), batches drawn from its data iterator.
        model: the model's name.
        variables: trainable variables as ``(name, shape, dtype)``, in model order.
        optimizer: the optimizer's class (``keras_optimizer_config``'s ``class``).
        strategy: ``Strategy.to_dict()`` of the strategy trained with.
        strategy_fingerprint: its fingerprint.
        ps_versions: parameter-server actor name -> ``{"version", "chunk_version"}``.
        directory: the step directory holding the arrays (relative to the checkpoint directory).
        version: the format version.
        state_index: what each optimizer array holds (``reshard.state_index``), which lets a
            restore re-cut the state for another strategy; None in a checkpoint written before
            it was kept (restored only onto its own strategy).
    """

    step: int
    data_positions: tuple
    model: str
    variables: tuple
    optimizer: str
    strategy: dict
    strategy_fingerprint: str
    ps_versions: dict = field(default_factory=dict)
    directory: str = ""
    version: int = FORMAT_VERSION
    state_index: dict | None = None

    def __post_init__(self):
        if not (isinstance(self.step, int) and self.step >= 0):
            raise ConfigError(f"checkpoint step must be an integer >= 0, got {short_repr(self.step)}")
        if not all(isinstance(p, int) and p >= 0 for p in self.data_positions):
            raise ConfigError(f"checkpoint data positions must be integers >= 0, got {short_repr(self.data_positions)}")
        if self.version != FORMAT_VERSION:
            raise ConfigError(f"checkpoint format version {short_repr(self.version)} is not supported; this AutoSync "
                              f"reads version {FORMAT_VERSION}")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": self.version, "step": self.step,
                "data_positions": list(self.data_positions), "model": self.model,
                "variables": [[n, list(s), d] for n, s, d in self.variables], "optimizer": self.optimizer,
                "strategy": self.strategy, "strategy_fingerprint": self.strategy_fingerprint,
                "ps_versions": self.ps_versions, "directory": self.directory,
                **({} if self.state_index is None else {"state_index": self.state_index})}

    @classmethod
    def from_dict(cls, data, where: str) -> "Manifest":
        """Raises ConfigError naming ``where`` for anything that is not a manifest of this format."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"{where} is not an AutoSync checkpoint manifest (no \"format\": \"{FORMAT}\")")
        need = {"version", "step", "data_positions", "model", "variables", "optimizer", "strategy",
                "strategy_fingerprint", "ps_versions", "directory"}
        missing = sorted(need - set(data))
        unknown = sorted(set(data) - need - {"format", "state_index"})
        if missing or unknown:
            raise ConfigError(f"{where}: damaged checkpoint manifest: "
                              + "; ".join(([f"missing keys {missing}"] if missing else [])
                                          + ([f"unknown keys {unknown}"] if unknown else [])))
        try:
            variables = tuple((str(n), tuple(int(x) for x in s), str(d)) for n, s, d in data["variables"])
            directory = data["directory"]
            if not (isinstance(directory, str) and directory.startswith("step-") and "/" not in directory):
                raise ValueError(f"bad step directory {directory!r}")
            return cls(step=data["step"], data_positions=tuple(data["data_positions"]), model=str(data["model"]),
                       variables=variables, optimizer=str(data["optimizer"]), strategy=dict(data["strategy"]),
                       strategy_fingerprint=str(data["strategy_fingerprint"]),
                       ps_versions=dict(data["ps_versions"]), directory=directory, version=data["version"],
                       state_index=_state_index(data.get("state_index"), len(variables)))
        except ConfigError as e:
            raise e.with_source(where) from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: damaged checkpoint manifest ({e})") from None

    def mismatches(self, other: "Manifest") -> list[str]:
        """What differs between this checkpoint and the state ``other`` describes (a trainer's),
        each a sentence; empty when the state fits."""
        problems = []
        if self.variables != other.variables:
            mine = {n: (s, d) for n, s, d in self.variables}
            theirs = {n: (s, d) for n, s, d in other.variables}
            diff = [f"{n} is {mine[n]} in the checkpoint but {theirs[n]} in the model"
                    for n in mine if n in theirs and mine[n] != theirs[n]]
            diff += [f"{n} only in the checkpoint" for n in mine if n not in theirs]
            diff += [f"{n} only in the model" for n in theirs if n not in mine]
            problems.append(f"the model's variables differ from the checkpoint's ({self.model}): "
                            + ("; ".join(diff[:5]) or "their order differs"))
        if self.optimizer != other.optimizer:
            problems.append(f"the optimizer is {other.optimizer} but the checkpoint holds {self.optimizer} state")
        if len(self.data_positions) != len(other.data_positions) and len(set(self.data_positions)) > 1:
            problems.append(f"the strategy trains {len(other.data_positions)} workers but the checkpoint has "
                            f"{len(self.data_positions)}, whose data positions differ "
                            f"({list(self.data_positions)[:8]}): "
                            f"it restores onto another number of workers only where each drew as many batches "
                            f"(a synchronous strategy)")
        if self.strategy_fingerprint != other.strategy_fingerprint and self.state_index is None:
            mine = {v["var"]: v for v in self.strategy.get("variables", [])}
            theirs = {v["var"]: v for v in other.strategy.get("variables", [])}
            diff = [f"{n}: checkpoint {json.dumps({k: x for k, x in mine.get(n, {}).items() if k != 'var'})} vs "
                    f"now {json.dumps({k: x for k, x in theirs.get(n, {}).items() if k != 'var'})}"
                    for n in sorted(set(mine) | set(theirs)) if mine.get(n) != theirs.get(n)]
            rest = {k: v for k, v in self.strategy.items() if k != "variables"}
            now = {k: v for k, v in other.strategy.items() if k != "variables"}
            if rest != now:
                diff.append(f"strategy settings: checkpoint {json.dumps(rest, sort_keys=True)} vs now "
                            f"{json.dumps(now, sort_keys=True)}")
            problems.append(f"the strategy differs from the checkpoint's, the only one it restores onto (it predates "
                            f"the index that lets optimizer state be re-cut; its {WEIGHTS} loads alone with "
                            f"keras.Model.load_weights): " + "; ".join(diff[:5]))
        return problems


def _state_index(data, num_vars: int) -> dict | None:
    """A manifest's ``state_index`` checked: array name -> ``"@name"`` or ``[var, axis, start,
    stop, slot]``. Raises ValueError otherwise."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError("state_index is not a mapping")
    for name, entry in data.items():
        ok = (isinstance(entry, str) and entry.startswith("@")) or (
            isinstance(entry, list) and len(entry) == 5 and all(isinstance(x, int) for x in entry[:4])
            and 0 <= entry[0] < num_vars and entry[1] >= -1 and 0 <= entry[2] <= entry[3]
            and isinstance(entry[4], str))
        if not ok:
            raise ValueError(f"state_index entry {name!r} is {short_repr(entry)}")
    return data


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint as written or read.

    Attributes:
        path: the checkpoint directory.
        step: its global step.
        weights_path: its ``model.weights.h5`` (for ``keras.Model.load_weights``).
        bytes: bytes of its files.
        seconds: time the write took (0 for a read).
        read_seconds: of ``seconds``, the time spent reading the actors' state (a save).
    """

    path: str
    step: int
    weights_path: str
    bytes: int
    seconds: float = 0.0
    read_seconds: float = 0.0


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """One checkpoint directory (see the module doc).

    Args:
        path: the directory; created on the first write.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def check_writable(self) -> None:
        """Raise ConfigError unless ``path`` is absent, an empty directory or a checkpoint
        directory (writing deletes step directories it does not name: never a user's folder)."""
        p = self.path
        if why := _unusable(p):
            raise ConfigError(f"checkpoint path {short_repr(str(p))} cannot be used: {why}; give another path")
        if p.exists() and not p.is_dir():
            raise ConfigError(f"checkpoint path {p} is a file, not a directory; give a directory path")
        base = nearest_existing(p)
        if not os.path.isdir(base):   # made on the first write, as a folder under a file cannot be
            raise ConfigError(f"checkpoint path {p} cannot be made: {base} is a file, not a directory; give a "
                              f"directory path inside a directory")
        if p.is_dir() and any(p.iterdir()) and not (p / MANIFEST).exists():
            raise ConfigError(f"checkpoint path {p} is a non-empty directory without {MANIFEST}; give a new or "
                              f"empty directory (writing a checkpoint replaces its contents)")

    def write(self, manifest: Manifest, write_weights: Callable[[str], None], arrays: dict) -> CheckpointInfo:
        """Commit a checkpoint atomically.

        Args:
            manifest: its manifest (``directory`` is filled in here).
            write_weights: writes the model's weights to the ``.weights.h5`` path it is given.
            arrays: name -> array for ``state.npz``, or ``(name, array)`` pairs: each is written
                as it comes, so a generator that reads them a batch at a time bounds the memory.

        Raises:
            ConfigError: ``path`` is not a place to write a checkpoint (``check_writable``).
            OSError: the write failed (a full disk, a lost mount): the message names the
                checkpoint and says that the one before is whole; its errno is the cause's.
        """
        t0 = time.perf_counter()
        self.check_writable()
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f"{_TMP_PREFIX}{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            write_weights(str(tmp / WEIGHTS))
            _write_npz(tmp / STATE, arrays.items() if isinstance(arrays, dict) else arrays)
            for name in (WEIGHTS, STATE):
                _fsync_file(tmp / name)
            _fsync_dir(tmp)
            final = f"step-{manifest.step:08d}"
            if (self.path / final).exists():   # the same step again (a restart, a second save)
                final = f"{final}-{uuid.uuid4().hex[:6]}"
            os.rename(tmp, self.path / final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise _not_written(e, self.path) from e
            raise
        _fsync_dir(self.path)
        body = dict(manifest.to_dict(), directory=final)
        staged = self.path / f"{_TMP_PREFIX}{MANIFEST}"
        try:
            with open(staged, "w") as f:
                json.dump(body, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            staged.unlink(missing_ok=True)
            shutil.rmtree(self.path / final, ignore_errors=True)
            raise _not_written(e, self.path) from e
        os.replace(staged, self.path / MANIFEST)
        _fsync_dir(self.path)
        self._prune(keep=final)
        size = sum(f.stat().st_size for f in (self.path / final).iterdir()) + (self.path / MANIFEST).stat().st_size
        return CheckpointInfo(str(self.path), manifest.step, str(self.path / final / WEIGHTS), size,
                              time.perf_counter() - t0)

    def _prune(self, keep: str) -> None:
        """Remove step directories other than ``keep`` and leftovers of interrupted writes."""
        for child in self.path.iterdir():
            if child.name == keep:
                continue
            if child.name.startswith("step-") and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            elif child.name.startswith(_TMP_PREFIX):
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)

    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def read(self) -> tuple[Manifest, CheckpointInfo]:
        """The committed checkpoint's manifest and where its files are.

        Raises:
            ConfigError: no checkpoint at ``path``, a damaged manifest, or missing files.
        """
        p = self.path
        if why := _unusable(p):
            raise ConfigError(f"restore: checkpoint {short_repr(str(p))} cannot be read: {why}; give the "
                              f"directory Trainer.save or fit(checkpoint_dir=...) wrote")
        if not p.exists():
            raise ConfigError(f"restore: checkpoint {p} does not exist; give the directory Trainer.save or "
                              f"fit(checkpoint_dir=...) wrote")
        if not (p / MANIFEST).is_file():
            raise ConfigError(f"restore: {p} is not a checkpoint directory (it has no {MANIFEST})")
        try:
            data = json.loads((p / MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"restore: checkpoint manifest {p / MANIFEST} cannot be read ({e}); the checkpoint is "
                              f"damaged") from None
        manifest = Manifest.from_dict(data, f"restore: checkpoint manifest {p / MANIFEST}")
        folder = p / manifest.directory
        missing = [n for n in (WEIGHTS, STATE) if not (folder / n).is_file()]
        if missing:
            raise ConfigError(f"restore: checkpoint {p} lacks {', '.join(missing)} in {manifest.directory}; "
                              f"the checkpoint is damaged")
        size = sum(f.stat().st_size for f in folder.iterdir())
        return manifest, CheckpointInfo(str(p), manifest.step, str(folder / WEIGHTS), size)

    def arrays(self, manifest: Manifest) -> "StateFile":
        """``state.npz`` of the committed checkpoint (name -> array, each read when asked).

        Raises:
            ConfigError: the file cannot be read.
        """
        return StateFile(self.path / manifest.directory / STATE)


def _write_npz(path: Path, items) -> None:
    """Write ``(name, array)`` pairs to an ``.npz`` archive ``np.load`` reads, one array at a time
    (what ``np.savez`` writes, without holding every array at once)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in items:
            with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)


def _not_written(error: OSError, path: Path) -> OSError:
    """The OSError a failed write raises: what failed, where, and that nothing was lost."""
    cause = error.strerror or str(error)
    before = ("the checkpoint written before is whole" if (path / MANIFEST).is_file()
              else "no checkpoint was there before")
    return OSError(error.errno, f"checkpoint {path} not written: {cause}; what it wrote was removed and {before}")


def _unusable(path: Path) -> str | None:
    """Why the file system refuses to even look at ``path`` (a name too long, a component that
    is a file, no permission to search a folder), or None."""
    try:
        path.exists()
    except OSError as e:
        return e.strerror or str(e)
    return None
