"""The devices folder is watched with inotify (real folders, the real kernel), polled where it cannot be.

The app's devices-folder loop on top of it: tests/test_folderwatch_app.py."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import shutil
import types
from pathlib import Path
from typing import Any

import pytest

from mapper.edge.kubeedge.devicefiles import FolderWatcher, Inotify, load_folder, load_inotify

DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: {name}, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: power_limit, collectCycle: 1000, desired: {{value: "{watts}"}}}}
"""


def readable(watcher: FolderWatcher, timeout_s: float) -> bool:
    fd = watcher.fileno()
    assert fd is not None, "the watcher has no inotify descriptor"
    ready, _, _ = select.select([fd], [], [], timeout_s)
    return bool(ready)


@pytest.fixture
def watcher_factory():
    made: list[FolderWatcher] = []

    def make(path: Path, **kwargs: Any) -> FolderWatcher:
        watcher = FolderWatcher(path, **kwargs)
        made.append(watcher)
        return watcher

    yield make
    for watcher in made:
        watcher.close()


def test_an_idle_folder_is_silent_and_a_new_file_wakes_the_watcher(tmp_path: Path, watcher_factory):
    watcher = watcher_factory(tmp_path)
    assert watcher.watching and watcher.poll_interval_s == 60.0
    assert watcher.changed() and not watcher.changed()
    assert not readable(watcher, 0.3), "nothing changed, yet the descriptor is readable"
    assert not watcher.drain()
    load_folder(tmp_path)  # reading the folder is no event either
    assert not readable(watcher, 0.1)

    (tmp_path / "gpu0.yaml").write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=400))
    assert readable(watcher, 1.0)
    assert watcher.drain()
    assert not watcher.drain(), "drain() reads every pending event"
    assert watcher.changed()

    (tmp_path / "notes.txt").write_text("not a device file")
    assert readable(watcher, 1.0) and watcher.drain(), "any event says: look again"
    assert not watcher.changed(), "the fingerprint decides: a non-YAML file changes nothing"


def test_a_configmap_update_swapping_the_data_symlink_is_seen(tmp_path: Path, watcher_factory):
    # The layout of a Kubernetes ConfigMap volume: a timestamped folder, ..data -> it, each key -> ..data/key.
    old = tmp_path / "..2026_01_01_00_00_00.000000001"
    old.mkdir()
    (old / "devices.yaml").write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=400))
    (tmp_path / "..data").symlink_to(old.name)
    (tmp_path / "devices.yaml").symlink_to("..data/devices.yaml")
    watcher = watcher_factory(tmp_path)
    assert watcher.watching
    assert watcher.changed() and not watcher.changed()

    # kubelet writes the new version beside the old one ...
    new = tmp_path / "..2026_01_01_00_01_00.000000002"
    new.mkdir()
    new_file = new / "devices.yaml"
    new_file.write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=300))
    old_stat = (old / "devices.yaml").stat()
    assert new_file.stat().st_size == old_stat.st_size
    os.utime(new_file, ns=(old_stat.st_atime_ns, old_stat.st_mtime_ns))  # same size, same mtime: only the inode
    (tmp_path / "..data_tmp").symlink_to(new.name)
    watcher.drain()
    assert not readable(watcher, 0.1)

    # ... and swaps ..data atomically with a rename.
    os.rename(tmp_path / "..data_tmp", tmp_path / "..data")
    assert readable(watcher, 1.0), "the rename of ..data raised no event"
    assert watcher.drain()
    assert watcher.changed(), "the swapped symlink was not seen as a change"
    shutil.rmtree(old)
    assert load_folder(tmp_path).devices[0].properties[0].desired == "300"


def test_a_folder_created_after_start_is_polled_then_watched(tmp_path: Path, watcher_factory, caplog):
    folder = tmp_path / "devices"
    with caplog.at_level(logging.WARNING, logger="mapper.edge.kubeedge.devicefiles"):
        watcher = watcher_factory(folder)
    assert not watcher.watching and watcher.poll_interval_s == 2.0
    assert "No such file or directory" in caplog.text and str(folder) in caplog.text
    assert watcher.changed()  # an empty fingerprint, as before
    caplog.clear()
    assert not watcher.changed()
    assert caplog.text == "", "the same reason is logged once, not on every poll"

    folder.mkdir()
    (folder / "gpu0.yaml").write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=400))
    assert watcher.changed()
    assert watcher.watching and watcher.poll_interval_s == 60.0
    (folder / "gpu0.yaml").write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=300))
    assert readable(watcher, 1.0) and watcher.drain()
    assert watcher.changed()


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_a_folder_deleted_or_moved_and_created_again_is_watched_again(tmp_path: Path, watcher_factory, how):
    folder = tmp_path / "devices"
    folder.mkdir()
    (folder / "gpu0.yaml").write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=400))
    watcher = watcher_factory(folder)
    assert watcher.watching and watcher.changed()

    if how == "deleted":
        shutil.rmtree(folder)
    else:
        folder.rename(tmp_path / "elsewhere")
    assert readable(watcher, 1.0) and watcher.drain()
    assert not watcher.watching and watcher.poll_interval_s == 2.0
    assert watcher.changed(), "the files are gone from the path"
    assert not watcher.watching, "nothing to watch at the path yet"

    folder.mkdir()
    assert not watcher.changed()
    assert watcher.watching
    watcher.drain()
    (folder / "gpu1.yaml").write_text(DEVICE.format(name="gpu1", uuid="GPU-1", watts=400))
    assert readable(watcher, 1.0) and watcher.drain()
    assert watcher.changed()
    if how == "moved":
        (tmp_path / "elsewhere" / "gpu0.yaml").write_text("# the old folder is not watched any more\n")
        assert not readable(watcher, 0.2)


class WatchLimitReached(Inotify):
    """The real inotify, except that add_watch fails with ENOSPC (fs.inotify.max_user_watches reached) while
    ``full`` is set."""

    full = True

    def add_watch(self, fd: int, path: Path, mask: int) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().add_watch(fd, path, mask)


def test_when_the_watch_limit_is_reached_the_folder_is_polled_and_watched_once_it_can_be(
    tmp_path: Path, watcher_factory, caplog
):
    limited = WatchLimitReached(ctypes.CDLL(None, use_errno=True))
    with caplog.at_level(logging.WARNING, logger="mapper.edge.kubeedge.devicefiles"):
        watcher = watcher_factory(tmp_path, inotify=limited)
    assert not watcher.watching and watcher.poll_interval_s == 2.0
    assert "max_user_watches" in caplog.text
    assert watcher.changed()

    limited.full = False
    (tmp_path / "gpu0.yaml").write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=400))
    assert watcher.changed(), "polling still sees the change"
    assert watcher.watching, "the next look watched the folder"
    (tmp_path / "gpu0.yaml").unlink()
    assert readable(watcher, 1.0) and watcher.drain()
    assert watcher.changed()


def test_without_inotify_in_the_c_library_the_folder_is_polled(tmp_path: Path, watcher_factory):
    assert load_inotify(types.SimpleNamespace()) is None, "a C library without inotify_init1 is no inotify"
    watcher = watcher_factory(tmp_path, inotify=None)
    assert watcher.fileno() is None and not watcher.watching and watcher.poll_interval_s == 2.0
    assert not watcher.drain()
    assert watcher.changed() and not watcher.changed()
    (tmp_path / "gpu0.yaml").write_text(DEVICE.format(name="gpu0", uuid="GPU-0", watts=400))
    assert watcher.changed()


def test_close_releases_the_descriptor(tmp_path: Path):
    watcher = FolderWatcher(tmp_path)
    fd = watcher.fileno()
    assert fd is not None
    assert os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    watcher.close()
    assert watcher.fileno() is None and not watcher.watching
    watcher.close()  # twice is fine
    assert not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify"
    assert watcher.changed(), "a closed watcher still answers by looking"
