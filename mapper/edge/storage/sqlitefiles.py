"""Helpers shared by the two SQLite files of the data directory (the telemetry buffer and the desired store)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: The files one SQLite database in WAL mode consists of.
SQLITE_SUFFIXES = ("", "-wal", "-shm")


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
