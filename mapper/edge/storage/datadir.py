"""The data directory's permissions: the directory 0700, every file in it 0600, whatever the process' umask.

The directory holds the desired state (what the cloud and edge applications asked of the GPUs), the buffered
telemetry and ``status.json``: nothing another local user should read or change. ``prepare_data_dir`` creates
it 0700 (its missing parents with the usual mode), tightens an existing directory or file that is wider (a
``hostPath`` of type ``DirectoryOrCreate`` is made 0755 by the kubelet), and creates the SQLite files 0600
before SQLite opens them (SQLite gives a database's ``-wal`` and ``-shm`` files the mode of the database file).
What cannot be tightened (a directory owned by another user, a read-only mount) is logged with the reason, and
the mapper runs on: refusing to start would stop its telemetry and its desired state for a permission.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from mapper.errors import PermanentError

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


def require_data_dir(path: Path, files: Iterable[str] = ()) -> list[str]:
    """``prepare_data_dir`` for the mapper's start-up: ``PermanentError`` naming the directory when it cannot be
    made or used, or is not a directory (a file in its place)."""
    try:
        problems = prepare_data_dir(path, files)
    except OSError as exc:
        raise PermanentError(f"data dir {path}: cannot create or use it ({exc.strerror or exc})") from exc
    if not path.is_dir():
        raise PermanentError(f"data dir {path}: not a directory")
    return problems


def prepare_data_dir(path: str | os.PathLike[str], files: Iterable[str] = ()) -> list[str]:
    """Create or tighten ``path`` (0700) and its files (0600); create each of ``files`` (names in ``path``)
    empty and 0600 when missing. Returns the problems found (each also logged as a warning); an empty list when
    everything is as it should be."""
    directory = Path(path)
    problems: list[str] = []
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass  # made meanwhile by another process: tightened below
    _tighten(directory, DIR_MODE, problems)
    for name in files:
        target = directory / name
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
        except FileExistsError:
            continue
        except OSError as exc:
            problems.append(f"{target}: cannot create it 0600 ({exc.strerror or exc})")
            continue
        os.close(fd)
        os.chmod(target, FILE_MODE)  # the umask may have cleared bits of 0600, never added any
    try:
        entries = list(directory.iterdir())
    except OSError as exc:
        problems.append(f"{directory}: cannot list it ({exc.strerror or exc})")
        entries = []
    for entry in entries:
        try:
            st = entry.lstat()
        except OSError:
            continue  # removed meanwhile
        if stat.S_ISREG(st.st_mode):
            _tighten(entry, FILE_MODE, problems, st)
    for problem in problems:
        log.warning("data directory: %s", problem)
    return problems


def _tighten(path: Path, mode: int, problems: list[str], st: os.stat_result | None = None) -> None:
    """chmod ``path`` to ``mode`` when it grants more (group or other bits, or owner bits beyond ``mode``)."""
    try:
        st = st or path.stat()
    except OSError as exc:
        problems.append(f"{path}: cannot stat it ({exc.strerror or exc})")
        return
    current = stat.S_IMODE(st.st_mode)
    if current & ~mode == 0:
        return
    try:
        os.chmod(path, mode)
    except OSError as exc:
        owner = f"owned by uid {st.st_uid}, this process is uid {os.geteuid()}" if st.st_uid != os.geteuid() else ""
        why = exc.strerror or str(exc)
        problems.append(
            f"{path} is {current:04o} and cannot be made {mode:04o} ({why}{'; ' + owner if owner else ''}): "
            f"other local users may read it; fix its owner or mode"
        )
        return
    log.info("data directory: %s was %04o, now %04o", path, current, mode)
