"""The app's devices-folder loop: woken by inotify, a new Device file is on the mapper within a second, an idle
folder is never looked at, a burst of writes is read once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

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


def _http_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


@pytest.mark.timeout(90)
async def test_a_devices_file_that_fails_to_parse_changes_no_gpu_says_so_and_the_next_valid_version_applies(
    tmp_path: Path, monkeypatch
):
    """An unclosed quote in the Devices file of four GPUs is not an operator asking for defaults: the power caps
    stay on the (simulated) GPUs, the error is in the log, /status, /metrics and each Device's desired_status
    twin; the fixed file applies."""
    import json

    sim = SimNvml(4, "H100", seed=0, scenario="idle")
    uuids = [g.uuid for g in sim.gpus]
    defaults = {u: sim.gpu(u).power_limit_w for u in uuids}
    devices = tmp_path / "devices"
    devices.mkdir()
    path = devices / "gpus.yaml"

    def write(watts: list[int], *, broken: bool = False) -> None:
        text = "---\n".join(
            DEVICE.format(name=f"gpu{i}", uuid=u, watts=w).lstrip("\n")
            for i, (u, w) in enumerate(zip(uuids, watts, strict=True))
        )
        if broken:
            text = text.replace(f'value: "{watts[2]}"', f'value: "{watts[2]}', 1)  # the unclosed quote
        path.write_text(text)

    reads: list[float] = []

    def counting_load_folder(path: str | Path, node_name: str | None = None) -> Any:
        reads.append(time.monotonic())
        return load_folder(path, node_name)

    monkeypatch.setattr(mapper.edge.kubeedge.devicefiles, "load_folder", counting_load_folder)
    caps = [400, 410, 420, 430]
    assert all(defaults[u] not in caps for u in uuids)
    write(caps)
    settings = fast_settings(str(tmp_path / "data"), devices_dir=str(devices))
    async with running_app(settings, sim) as app:
        assert app.metrics is not None
        await wait_for(
            lambda: [sim.gpu(u).power_limit_w for u in uuids] == caps, timeout_s=20, what="the four caps applied"
        )
        read_before = len(reads)
        write([500, 510, 520, 530], broken=True)
        with pytest.raises(yaml.YAMLError):  # what the mapper reads is indeed not YAML
            list(yaml.safe_load_all(path.read_text()))
        await wait_for(lambda: len(reads) > read_before, what="the broken file read")
        # The caps stay (read from the simulated GPUs), for 30 collect rounds after the broken file was read.
        rounds = app.status.collect_duration.count
        await wait_for(lambda: app.status.collect_duration.count >= rounds + 30, timeout_s=90, what="30 collect rounds")
        assert [sim.gpu(u).power_limit_w for u in uuids] == caps, "a file that failed to parse changed a GPU"
        assert {d.key for d in app.registry.devices()} == {f"default/gpu{i}" for i in range(4)}

        def twins() -> list[str]:
            return [app.workers[u].desired_status for u in uuids]

        await wait_for(
            lambda: all(t == "power_limit:applied,config:refused-parse-error" for t in twins()),
            what="every Device's desired_status saying its file was refused",
        )
        status = json.loads(await asyncio.to_thread(_http_text, app.metrics.url + "/status"))
        [refused] = status["config"]["refused"]
        assert refused["devices"] == [f"default/gpu{i}" for i in range(4)]
        assert refused["reason"] == "parse-error" and refused["where"] == str(path)
        assert "while scanning a quoted scalar" in refused["detail"]
        metrics = await asyncio.to_thread(_http_text, app.metrics.url + "/metrics")
        # (the mapper's own series carry its node, as the bridge writes them from the node stream)
        node = status["node"]
        assert f'gpu_mapper_config_errors_total{{node="{node}",source="devices-file"}} 1.0' in metrics
        assert f'gpu_mapper_config_refused{{node="{node}",source="devices-file"}} 1.0' in metrics

        # Fixed: the next valid version applies, and the refusal is gone.
        fixed = [300, 310, 320, 330]
        write(fixed)
        await wait_for(
            lambda: [sim.gpu(u).power_limit_w for u in uuids] == fixed, timeout_s=20, what="the fixed file applied"
        )
        await wait_for(lambda: not any("config:" in t for t in twins()), timeout_s=10, what="the twins clear")
        status = json.loads(await asyncio.to_thread(_http_text, app.metrics.url + "/status"))
        assert status["config"]["refused"] == [] and status["config"]["errors"] == {"devices-file": 1}

        # Only an explicit removal removes: the file deleted, the GPUs return to their defaults.
        path.unlink()
        await wait_for(
            lambda: all(sim.gpu(u).power_limit_w == defaults[u] for u in uuids), timeout_s=20, what="defaults restored"
        )
        assert app.registry.devices() == []


@pytest.mark.timeout(120)
async def test_a_restart_after_a_rename_and_a_typo_keeps_the_cap_the_gpu_has(tmp_path: Path, caplog) -> None:
    """Found by the lifecycle harness (tests/lifecycle, seed 5): the desired store keeps a record per name a GPU
    had (its old Device name and ``_unbound/<uuid>`` with their removals' "defaults to restore"), and a restart
    took whichever record came last in the store, not the newest: the GPU was reset to its default (a transient
    700 W on every restart, and for good when the current Device's value was a typo the mapper refuses)."""
    sim = SimNvml(1, "H100", seed=0, scenario="idle")
    (uuid,) = [g.uuid for g in sim.gpus]
    default_w = sim.gpu(uuid).power_limit_w
    devices = tmp_path / "devices"
    devices.mkdir()

    def write(name: str, watts: str) -> None:
        for old in devices.glob("*.yaml"):
            old.unlink()
        (devices / f"{name}.yaml").write_text(DEVICE.format(name=name, uuid=uuid, watts=watts).lstrip("\n"))

    settings = fast_settings(str(tmp_path / "data"), devices_dir=str(devices))
    # "train" sorts after "spare": the older record (train's removal) comes last out of the store.
    write("train", "400")
    async with running_app(settings, sim) as app:
        await wait_for(lambda: sim.gpu(uuid).power_limit_w == 400, timeout_s=20, what="train's cap applied")
        write("spare", "400")  # renamed: train removed, spare added, on the same GPU
        await wait_for(
            lambda: app.workers[uuid].device is not None and app.workers[uuid].device.name == "spare",
            what="the GPU bound to spare",
        )
        await wait_for(lambda: sim.gpu(uuid).power_limit_w == 400, timeout_s=20, what="spare's cap in force")
        write("spare", "3OO")  # a typo: refused, the GPU keeps 400
        await wait_for(
            lambda: app.workers[uuid].desired_status.startswith("power_limit:rejected"), what="the typo refused"
        )
        assert sim.gpu(uuid).power_limit_w == 400
    settings_calls: list[int] = []
    setter = sim.nvmlDeviceSetPowerManagementLimit

    def recording(handle: Any, limit: int) -> None:
        settings_calls.append(limit)
        setter(handle, limit)

    sim.nvmlDeviceSetPowerManagementLimit = recording  # type: ignore[method-assign]
    caplog.set_level("INFO", logger="mapper.edge.kubeedge.binding")
    caplog.clear()
    async with running_app(settings, sim) as app:
        # What the restart enforces until the folder is read (when a step comes first, it acts on it): the newest
        # record of the GPU, spare's, not train's older "defaults to restore".
        restored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restored desired state")]
        assert restored == [f"restored desired state of default/spare (GPU {uuid}): power_limit=3OO"], restored
        rounds = app.status.collect_duration.count
        await wait_for(lambda: app.status.collect_duration.count >= rounds + 20, timeout_s=60, what="20 collect rounds")
        await wait_for(
            lambda: app.workers[uuid].desired_status.startswith("power_limit:rejected"), what="the typo refused again"
        )
        assert sim.gpu(uuid).power_limit_w == 400 != default_w, "the restart changed the GPU's cap"
        assert settings_calls == [], f"the restart set the power limit: {settings_calls}"


@pytest.mark.timeout(120)
async def test_a_device_whose_file_was_broken_at_start_is_removed_when_the_file_is_deleted(tmp_path: Path) -> None:
    """Found by the lifecycle harness (tests/lifecycle, seed 6): a Devices file that failed to parse when the
    mapper started keeps the cap its Device set (restored from the store: bad input changes no GPU), but the
    mapper never learnt which Devices the file defined, so deleting the file removed nothing and the cap stayed
    on a GPU no Device names."""
    sim = SimNvml(2, "H100", seed=0, scenario="idle")
    uuids = [g.uuid for g in sim.gpus]
    defaults = [sim.gpu(u).power_limit_w for u in uuids]
    devices = tmp_path / "devices"
    devices.mkdir()
    first, second = devices / "gpu0.yaml", devices / "gpu1.yaml"
    first.write_text(DEVICE.format(name="gpu0", uuid=uuids[0], watts="400").lstrip("\n"))
    second.write_text(DEVICE.format(name="gpu1", uuid=uuids[1], watts="410").lstrip("\n"))
    settings = fast_settings(str(tmp_path / "data"), devices_dir=str(devices))
    async with running_app(settings, sim):
        await wait_for(
            lambda: [sim.gpu(u).power_limit_w for u in uuids] == [400, 410], timeout_s=20, what="both caps applied"
        )
    first.write_text(first.read_text().replace('value: "400"', 'value: "400', 1))  # an unclosed quote
    async with running_app(settings, sim) as app:
        rounds = app.status.collect_duration.count
        await wait_for(lambda: app.status.collect_duration.count >= rounds + 10, timeout_s=60, what="10 collect rounds")
        assert [sim.gpu(u).power_limit_w for u in uuids] == [400, 410], "a broken file changed a GPU at start"
        first.unlink()  # the operator removes the Device
        await wait_for(
            lambda: sim.gpu(uuids[0]).power_limit_w == defaults[0], timeout_s=20, what="gpu0's default restored"
        )
        assert sim.gpu(uuids[1]).power_limit_w == 410, "the other Device keeps its cap"
    async with running_app(settings, sim) as app:  # and it stays released across a restart
        rounds = app.status.collect_duration.count
        await wait_for(lambda: app.status.collect_duration.count >= rounds + 10, timeout_s=60, what="10 collect rounds")
        assert [sim.gpu(u).power_limit_w for u in uuids] == [defaults[0], 410]
