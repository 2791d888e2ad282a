"""Helpers shared by the two SQLite files of the data directory (the telemetry buffer and the desired store)."""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

#: The files one SQLite database in WAL mode consists of.
SQLITE_SUFFIXES = ("", "-wal", "-shm")
#: Why the data dir does not take a write (``unwritable_reason``).
DATA_DIR_FULL = "data dir full"
DATA_DIR_READ_ONLY = "data dir read-only"
DATA_DIR_UNWRITABLE = "data dir unwritable"

_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14


#: A file system with less room than this is taken for full when SQLite says only "disk I/O error" (what it says
#: when it cannot extend its ``-shm`` on a full tmpfs) or "readonly" (a file opened read-only because it was).
FULL_BELOW_BYTES = 64 * 1024


def unwritable_reason(exc: sqlite3.Error, directory: Path | None = None) -> str | None:
    """Why an SQLite call failed because the data dir cannot take a write (full, read-only, an I/O error, a file
    that cannot be opened), or None (locked, busy, corrupt, anything else). With ``directory`` (the data dir), an
    I/O or read-only error is told apart by the file system: mounted read-only, or (nearly) full."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if code is not None else None
    text = str(exc).lower()
    if primary == _SQLITE_FULL or "database or disk is full" in text:
        return DATA_DIR_FULL
    if primary == _SQLITE_READONLY or "readonly" in text or "read-only" in text:
        why = DATA_DIR_READ_ONLY
    elif primary in (_SQLITE_IOERR, _SQLITE_CANTOPEN) or "disk i/o error" in text or "unable to open" in text:
        why = DATA_DIR_UNWRITABLE
    else:
        return None
    if directory is not None:
        try:
            fs = os.statvfs(directory)
        except OSError:
            return why
        if fs.f_flag & os.ST_RDONLY:
            return DATA_DIR_READ_ONLY
        if fs.f_bavail * fs.f_frsize < FULL_BELOW_BYTES:
            return DATA_DIR_FULL
    return why


#: What a start may open read-only and run degraded on: the file system's state, not a wrong path or permission
#: (those stop the start, naming the file).
DEGRADED_AT_START = (DATA_DIR_FULL, DATA_DIR_READ_ONLY)


def open_read_only(path: Path, *, check_same_thread: bool = True) -> sqlite3.Connection:
    """A read-only connection to a database that cannot be opened for writing (a full or read-only data dir):
    ``immutable``, so that SQLite needs no ``-shm`` (which a full file system cannot extend). It reads the main
    file as the last checkpoint left it (not what a ``-wal`` holds beyond it); nothing is written through it."""
    uri = f"{Path(path).resolve().as_uri()}?mode=ro&immutable=1"
    return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=check_same_thread)


def move_aside(path: Path, stamp_ms: int) -> Path:
    """Rename a database and its WAL files to ``<name>.corrupt-<stamp_ms>`` so a fresh one can start.

    A file that cannot be renamed is deleted (logged): a corrupt file must never stop the mapper starting.
    Returns the new name of the main file.
    """
    target = path.with_name(f"{path.name}.corrupt-{stamp_ms}")
    for suffix in SQLITE_SUFFIXES:
        src = Path(f"{path}{suffix}")
        if not src.exists():
            continue
        try:
            os.replace(src, Path(f"{target}{suffix}"))
        except OSError as exc:
            log.error("cannot move %s aside (%s); deleting it", src, exc)
            src.unlink(missing_ok=True)
    return target
