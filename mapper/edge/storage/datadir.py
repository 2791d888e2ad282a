"""The data directory's permissions: the directory 0700, the mapper's files in it 0600, whatever the umask; and
nothing else touched.

The directory holds the desired state (what the cloud and edge applications asked of the GPUs), the buffered
telemetry and ``status.json``: nothing another local user should read or change. ``prepare_data_dir`` first
checks that the path is a directory, or can be made one: a file (or anything else that is not a directory) in
its place is refused before anything is changed. Then it creates it 0700 (its missing parents with the usual
mode) and creates the SQLite files 0600 before SQLite opens them (SQLite gives a database's ``-wal`` and ``-shm``
files the mode of the database file).

**The mapper changes the mode only of what is its own** (it never changes an owner): the files it names
(``MAPPER_FILES``: its SQLite files with their journals and moved-aside copies, ``status.json`` and its temporary
copies) and its simulators' directories (``MAPPER_DIRS``), each tightened when an earlier run, an operator or a
umask left it wider. The directory itself is tightened only when it is the mapper's: made now, or holding nothing
but the mapper's own entries (an empty ``hostPath`` the kubelet made 0755 included). A directory that holds
anything else (``--data-dir /etc``, a home directory) keeps its mode, and so does every file in it that is not the
mapper's; a warning says so. What cannot be tightened (a directory owned by another user, a read-only mount) is
logged with the reason, and the mapper runs on: refusing to start would stop its telemetry and its desired state
for a permission.
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
#: The files the mapper writes in its data directory, by the start of their names: each SQLite file with its
#: ``-wal``/``-shm``/``-journal`` and ``.corrupt-<ms>`` copies, the status file and its temporary copies.
MAPPER_FILES = ("telemetry.db", "desired.db", "status.json", ".status-")
#: The directories the simulators make in the data directory (``--sim``).
MAPPER_DIRS = ("sim-host", "sim-jetson")


def is_mapper_entry(name: str) -> bool:
    """Whether an entry of the data directory, by name, is one the mapper makes."""
    return name in MAPPER_DIRS or name.startswith(MAPPER_FILES)


def require_data_dir(path: Path, files: Iterable[str] = ()) -> list[str]:
    """``prepare_data_dir`` for the mapper's start-up: ``PermanentError`` naming the directory when it cannot be
    made or used, or is not a directory (a file in its place: left as it was)."""
    try:
        problems = prepare_data_dir(path, files)
    except OSError as exc:
        raise PermanentError(f"data dir {path}: cannot create or use it ({exc.strerror or exc})") from exc
    if not path.is_dir():
        raise PermanentError(f"data dir {path}: not a directory")
    return problems


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a directory"


def prepare_data_dir(path: str | os.PathLike[str], files: Iterable[str] = ()) -> list[str]:
    """Check that ``path`` is a directory or can be made one (``PermanentError`` before anything is changed when
    it is not), create it 0700, create each of ``files`` (names in ``path``) empty and 0600 when missing, and
    tighten what is the mapper's (module docstring). Returns the problems found (each also logged as a warning);
    an empty list when everything is as it should be."""
    directory = Path(path)
    problems: list[str] = []
    try:
        st = directory.stat()
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise PermanentError(f"data dir {directory}: {_kind(st.st_mode)} is there, not a directory; left as it was")
    created = False
    if st is None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            directory.mkdir(mode=DIR_MODE)
            created = True
        except FileExistsError:
            if not directory.is_dir():
                raise PermanentError(f"data dir {directory}: not a directory; left as it was") from None
    try:
        entries = list(directory.iterdir())
    except OSError as exc:
        problems.append(f"{directory}: cannot list it ({exc.strerror or exc})")
        entries = []
    foreign = sorted(e.name for e in entries if not is_mapper_entry(e.name))
    if created or not foreign:
        _tighten(directory, DIR_MODE, problems)
    else:
        _leave(directory, foreign)
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
    for entry in entries:
        if not is_mapper_entry(entry.name):
            continue
        try:
            est = entry.lstat()
        except OSError:
            continue  # removed meanwhile
        if stat.S_ISREG(est.st_mode) and entry.name not in MAPPER_DIRS:
            _tighten(entry, FILE_MODE, problems, est)
        elif stat.S_ISDIR(est.st_mode) and entry.name in MAPPER_DIRS:
            _tighten(entry, DIR_MODE, problems, est)
    for problem in problems:
        log.warning("data directory: %s", problem)
    return problems


def _leave(directory: Path, foreign: list[str]) -> None:
    """A directory that is not the mapper's alone keeps its mode: say so when it is wider than 0700."""
    try:
        current = stat.S_IMODE(directory.stat().st_mode)
    except OSError:
        return
    if current & ~DIR_MODE == 0:
        return
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    log.warning(
        "data directory: %s is %04o and holds entries that are not the mapper's (%s): its mode and theirs are "
        "left as they are (the mapper's own files are made 0600); give the mapper a directory of its own",
        directory,
        current,
        shown,
    )


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
