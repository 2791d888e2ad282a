"""The app's devices-folder loop: woken by inotify, a new Device file is on the mapper within a second, an idle
folder is never looked at, a burst of writes is read once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import mapper.edge.kubeedge.devicefiles
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.devicefiles import FolderWatcher, load_folder
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.test_folderwatch import DEVICE


@pytest.mark.timeout(60)
async def test_the_app_picks_up_a_new_device_file_at_once_and_never_looks_at_an_idle_folder(
    tmp_path: Path, monkeypatch
):
    sim = SimNvml(2, "H100", seed=0, scenario="idle")
    uuid0, uuid1 = sim.gpus[0].uuid, sim.gpus[1].uuid
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "gpu0.yaml").write_text(DEVICE.format(name="gpu0", uuid=uuid0, watts=400))

    watchers: list[FolderWatcher] = []
    looks: list[float] = []
    reads: list[float] = []

    class CountingWatcher(FolderWatcher):
        def __init__(self, path: str | Path) -> None:
            super().__init__(path)
            watchers.append(self)

        def fingerprint(self) -> str:
            looks.append(time.monotonic())
            return super().fingerprint()

    def counting_load_folder(path: str | Path, node_name: str | None = None) -> Any:
        reads.append(time.monotonic())
        return load_folder(path, node_name)

    monkeypatch.setattr(mapper.edge.kubeedge.devicefiles, "FolderWatcher", CountingWatcher)
    monkeypatch.setattr(mapper.edge.kubeedge.devicefiles, "load_folder", counting_load_folder)

    settings = fast_settings(str(tmp_path / "data"), devices_dir=str(devices))
    async with running_app(settings, sim) as app:
        await wait_for(lambda: app.registry.device_by_uuid(uuid0) is not None, what="gpu0's Device")
        assert len(watchers) == 1 and watchers[0].watching
        beat = app._beats["devices-dir"]
        assert beat.period_s == 60.0, "the heartbeat's period is the loop's real sleep"

        # Idle: no look, no read, for longer than the old 2 s poll (timed by the mapper's own collect rounds, 10 a
        # second: on a loaded machine a plain sleep could pass with the loop hardly running).
        looks_before, reads_before = len(looks), len(reads)
        rounds = app.status.collect_duration.count
        await wait_for(lambda: app.status.collect_duration.count >= rounds + 25, timeout_s=30, what="25 collect rounds")
        assert len(looks) == looks_before, "an idle folder was looked at"
        assert len(reads) == reads_before, "an idle folder was read"

        # A Device file written into the folder is on the mapper within about a second.
        written_s = time.monotonic()
        (devices / "gpu1.yaml").write_text(DEVICE.format(name="gpu1", uuid=uuid1, watts=350))
        await wait_for(lambda: app.registry.device_by_uuid(uuid1) is not None, timeout_s=1.0, what="gpu1's Device")
        picked_up_s = time.monotonic() - written_s
        assert picked_up_s < 1.0
        assert len(reads) == reads_before + 1, "one write, one read"
        await wait_for(lambda: sim.gpu(uuid1).power_limit_w == 350, what="gpu1's desired power limit applied")

        # A burst of writes (40 ms apart, the loop running in between) is read once it settles, not per write.
        reads_before = len(reads)
        for watts in (300, 310, 320, 330):
            (devices / "gpu1.yaml").write_text(DEVICE.format(name="gpu1", uuid=uuid1, watts=watts))
            await asyncio.sleep(0.04)
        await wait_for(lambda: sim.gpu(uuid1).power_limit_w == 330, what="the last value of the burst applied")
        assert len(reads) - reads_before <= 2, f"{len(reads) - reads_before} reads for one burst"
        watcher = watchers[0]
    assert watcher.fileno() is None, "the loop closed its watcher when it was cancelled"
