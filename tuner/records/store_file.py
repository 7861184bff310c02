"""The trial store's file, before SQLite opens it for writing: what makes a path not a trial
store (a directory, another file, a damaged or foreign database), checked without changing it, and
the errors a store raises, each naming the file and what to do (``tuner.records.store``)."""
from __future__ import annotations

import os
import sqlite3
import urllib.parse

from strategy_space.errors import ConfigError

SCHEMA_VERSION = 1

SQLITE_MAGIC = b"SQLite format 3\x00"
_NEEDED_TABLES = {"info", "models", "clusters", "strategies", "trials"}


class StoreError(ConfigError):
    """A file given as a trial store that is not one (or is damaged), left as it is; or a write
    to a store that SQLite refused (``write_error``), rolled back."""


def store_error(path: str, why: str) -> StoreError:
    """The file at ``path`` is not a trial store this AutoSync can read; nothing was changed."""
    return StoreError(f"{path} is not a readable AutoSync trial store: {why}. The file was left unchanged; "
                      f"give another trial store file (a new path starts an empty store) or move this one away")


def write_error(path: str, error: sqlite3.Error) -> StoreError:
    """SQLite refused a write to the store at ``path`` (a full disk, a read-only file, a lock held
    past the timeout); the transaction was rolled back, every trial committed before is kept."""
    why = " ".join(str(error).split())[:160]
    fix = ("another process holds its lock (wait for it, or give another --store)" if "locked" in why else
           "free space on its disk, make the file and its folder writable, or give another --store")
    return StoreError(f"cannot write to the trial store {path} ({why}); what it held before is kept, each trial "
                      f"whole. Fix: {fix}; `autosync tune ... --resume` then continues a tuning run")


def check_store_file(path: str | os.PathLike) -> None:
    """Check, without writing anything, that ``path`` is missing, empty, or a readable AutoSync
    trial store of this schema version.

    The file is read through an immutable read-only connection (no lock, journal or WAL files
    are created). When a write-ahead log sits beside it (a writer was killed before
    checkpointing), the main file alone may not be consistent, so only its header is checked.

    Raises:
        StoreError: a directory, a file that is not SQLite, a damaged database, or an SQLite
            database that is not a trial store (or of another schema version).
    """
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
        raise store_error(path, "it is a directory")
    if not os.path.exists(path):
        return
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise store_error(path, f"it cannot be read ({e.strerror or e})") from None
    if not head:
        return
    if head != SQLITE_MAGIC:
        raise store_error(path, "it is not an SQLite database (wrong file header)")
    wal = path + "-wal"
    if os.path.exists(wal) and os.path.getsize(wal) > 0:
        return
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro&immutable=1"
    try:
        db = sqlite3.connect(uri, uri=True)
        try:
            check = db.execute("PRAGMA quick_check").fetchone()
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            version = (db.execute("SELECT value FROM info WHERE key='schema_version'").fetchone()
                       if "info" in tables else None)
        finally:
            db.close()
    except (sqlite3.DatabaseError, UnicodeDecodeError) as e:   # (a damaged table name is not UTF-8)
        raise store_error(path, f"SQLite cannot read it ({str(e)[:200]}); it is damaged or truncated") from None
    if not check or check[0] != "ok":
        raise store_error(path, f"the database is damaged ({str(check[0] if check else '')[:120]})")
    if tables and not _NEEDED_TABLES <= tables:
        raise store_error(path, f"it is an SQLite database without AutoSync's tables (it has "
                          f"{', '.join(sorted(tables)[:5])}{' ...' if len(tables) > 5 else ''})")
    if version is not None and str(version[0]) != str(SCHEMA_VERSION):
        raise store_error(path, f"it has schema version {str(version[0])[:20]}, this AutoSync reads {SCHEMA_VERSION}")
