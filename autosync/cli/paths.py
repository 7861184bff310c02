"""Output paths checked before the work: a command that will write a file or a folder says at once,
with exit code 2, that it cannot, instead of failing after a tuning run.

Whether a folder takes new files is found by creating one there (a hidden probe, removed at once):
access bits do not say it for root, nor for /proc, /sys or a read-only mount. Nothing else is
created, and no folder is made.
"""
from __future__ import annotations

import os
import tempfile

from strategy_space.errors import ConfigError
from strategy_space.yaml_io import nearest_existing


# a file is written through a temp file beside it named ".NAME.XXXXXXXX" (atomic_write_text)
_TEMP_EXTRA = 16


def _check_length(path: str, flag: str, is_file: bool) -> None:
    """Each part of ``path`` within the file system's limit on a name (the file's own name with
    room for its temp file), the whole within the limit on a path."""
    full = os.path.abspath(path)
    try:
        name_max = os.pathconf(nearest_existing(full), "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    parts = [p for p in full.split(os.sep) if p]
    for i, part in enumerate(parts):
        limit = name_max - (_TEMP_EXTRA if is_file and i == len(parts) - 1 else 0)
        if len(os.fsencode(part)) > limit:
            raise ConfigError(f"{flag} {path[:80]}...: the name {part[:40]}... is {len(os.fsencode(part))} bytes long, "
                              f"more than the {limit} this file system allows here; give a shorter name")
    if len(os.fsencode(full)) > 4000:
        raise ConfigError(f"{flag} {path[:80]}...: the path is longer than 4000 bytes; give a shorter one")


def _check_creatable(path: str, flag: str, what: str) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a folder we may write in."""
    base = nearest_existing(path)
    if not os.path.isdir(base):
        raise ConfigError(f"{flag} {path}: cannot create this {what}: {base} is a file, not a folder; "
                          f"give a path inside a folder")
    _probe(base, flag, path, what)


def _probe(folder: str, flag: str, path: str, what: str) -> None:
    """Create and remove a file in ``folder``, as writing there will."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".autosync-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot create this {what}: the folder {folder} does not take new files "
                          f"({e.strerror or e}); give a path in a folder you may write to") from None


def check_output_file(path: str | os.PathLike | None, flag: str) -> None:
    """Check, writing nothing, that a file can be written at ``path`` (None: nothing to check).

    Raises:
        ConfigError: the path is a folder, a file that is not writable, or lies where no file can
            be created (under a file, in a folder that is not writable).
    """
    if path is None:
        return
    path = os.fspath(path)
    if not path or path.endswith(os.sep):
        raise ConfigError(f"{flag} {path!r}: give a file path (a name, not a folder)")
    _check_length(path, flag, is_file=True)
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a folder; give the path of a file to write")
    if os.path.lexists(path):
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: exists and is not a regular file; give the path of a file to write")
        # the file is replaced by a new one written beside it (atomic_write_text): its folder must take files
        _probe(os.path.dirname(os.path.abspath(path)), flag, path, "file")
        return
    _check_creatable(path, flag, "file")


def check_output_dir(path: str | os.PathLike | None, flag: str) -> None:
    """Check, writing nothing, that files can be written in the folder ``path`` (made if missing).

    Raises:
        ConfigError: the path is a file, a folder that is not writable, or lies where no folder
            can be created.
    """
    if path is None:
        return
    path = os.fspath(path)
    if not path:
        raise ConfigError(f"{flag} '': give a folder path")
    _check_length(path, flag, is_file=False)
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: is a file, not a folder; give a folder path (it is made if missing)")
        _probe(path, flag, path, "folder's files")
        return
    _check_creatable(path, flag, "folder")
