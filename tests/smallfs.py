"""A real, small file system for the tests of a full data dir: a tmpfs mounted for one test (root only: CI runs as
root), filled up with a file and freed again, unmounted at the end."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")


@contextlib.contextmanager
def small_tmpfs(where: Path, size_bytes: int) -> Iterator[Path]:
    """``where`` (made here) with a tmpfs of ``size_bytes`` mounted on it, unmounted (lazily, even while a process
    still has files open in it) when the block ends."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(where)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True, timeout=30)


def fill(fs: Path, name: str = "filler") -> Path:
    """Write a file into ``fs`` until the file system is full (ENOSPC); its path."""
    path = fs / name
    block = bytes(64 * 1024)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError:
                break
        for size in (4096, 512, 1):  # the last, partly free page too
            while True:
                try:
                    os.write(fd, bytes(size))
                except OSError:
                    break
    finally:
        os.close(fd)
    return path


def free_bytes(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def ext4_that_fails(where: Path, size_bytes: int = 8 * 1024**2) -> Iterator[tuple[Path, Callable[[], None]]]:
    """``where`` with a small ext4 (a loop-mounted image, ``errors=remount-ro``) mounted on it, and the call that
    makes it fail as a failing disk does (ext4's own ``trigger_fs_error``: from then on every write is an I/O
    error and the file system is read-only). Skips where no loop device can be had (a container without one)."""
    where.mkdir(parents=True, exist_ok=True)
    image = where.with_name(where.name + ".img")
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, timeout=60)
    mounted = made.returncode == 0 and (
        subprocess.run(
            ["mount", "-o", "loop,errors=remount-ro", str(image), str(where)], capture_output=True, timeout=60
        ).returncode
        == 0
    )
    if not mounted:
        image.unlink()
        pytest.skip("no ext4 on a loop device here (mkfs.ext4 and a loop device are needed)")
    try:
        source = subprocess.run(
            ["findmnt", "-no", "SOURCE", str(where)], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        trigger = Path("/sys/fs/ext4") / os.path.basename(os.path.realpath(source)) / "trigger_fs_error"

        def fail() -> None:
            trigger.write_text("a test makes this file system fail\n")

        yield where, fail
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True, timeout=30)
        image.unlink(missing_ok=True)
