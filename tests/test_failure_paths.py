"""Failure branches no other test reached (issue 16, part 3): each test drives one branch through real parts
(the simulated NVML under the real backend, real SQLite files, a real mosquitto) and fails without it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from mapper.clock import FakeClock
from tests.test_reconcile import Rig, make_rig

# --- the reconciler's read-back mismatch, in both of its forms ------------------------------------------------


@pytest.fixture
def rig(fake_clock: FakeClock) -> Iterator[Rig]:
    r = make_rig(fake_clock)
    try:
        yield r
    finally:
        r.backend.shutdown()


def _lying_setter(rig: Rig, name: str) -> list[tuple[object, ...]]:
    """Make the simulated NVML's ``name`` report success without changing the GPU; the calls it got."""
    calls: list[tuple[object, ...]] = []

    def setter(*args: object) -> None:
        calls.append(args)

    setattr(rig.sim, name, setter)
    return calls


def test_a_power_limit_the_setter_accepts_but_the_gpu_reads_otherwise_is_pending_and_retried(rig: Rig) -> None:
    # Form 1: the backend reads the limit back right after setting it and raises read-back-mismatch.
    real = rig.sim.nvmlDeviceSetPowerManagementLimit
    calls = _lying_setter(rig, "nvmlDeviceSetPowerManagementLimit")
    rig.state.set("power_limit", "450", "cloud", 1_000)
    result = rig.cycle()
    assert len(calls) == 1 and rig.gpu.power_limit_mw == 700_000
    assert [o.outcome for o in result.actions] == ["readback-mismatch"]
    assert "reads back as 700000 mW" in result.actions[0].error
    assert result.statuses["power_limit"].text == "pending", "never 'applied' while the GPU reads otherwise"
    assert not [a for a in result.acks if a.result == "applied"]
    assert rig.reconciler.counters.actions[("power_limit", "readback-mismatch")] == 1
    # Backed off: the next cycle does not call again at once; after the backoff it does, and a GPU that now
    # behaves takes the value.
    rig.cycle()
    assert len(calls) == 1
    rig.sim.nvmlDeviceSetPowerManagementLimit = real  # type: ignore[method-assign]
    rig.clock.advance(5.0)
    result = rig.cycle()
    assert rig.gpu.power_limit_mw == 450_000
    assert result.statuses["power_limit"].text == "applied"


def test_a_mode_the_setter_accepts_but_the_sample_reads_otherwise_is_pending_and_retried(rig: Rig) -> None:
    # Form 2: the setter returns without an error, and the step's own read-back sample shows the old value.
    real = rig.sim.nvmlDeviceSetComputeMode
    calls = _lying_setter(rig, "nvmlDeviceSetComputeMode")
    rig.state.set("compute_mode", "exclusive_process", "cloud", 1_000)
    result = rig.cycle()
    assert len(calls) == 1
    assert [o.outcome for o in result.actions] == ["readback-mismatch"]
    assert result.actions[0].error == "the GPU reads another value"
    assert result.statuses["compute_mode"].text == "pending"
    assert not [a for a in result.acks if a.result == "applied"]
    assert rig.reconciler.counters.actions[("compute_mode", "readback-mismatch")] == 1
    rig.cycle()
    assert len(calls) == 1, "backed off, not hammered every cycle"
    rig.sim.nvmlDeviceSetComputeMode = real  # type: ignore[method-assign]
    rig.clock.advance(5.0)
    result = rig.cycle()
    assert result.statuses["compute_mode"].text == "applied"


# --- the buffer: a locked database, still full after dropping, a newer schema, use after close ----------------


def _buffer(path, clock: FakeClock, **kw: object):
    from mapper.edge.storage.buffer import Buffer

    opts: dict[str, object] = {"max_bytes": 10_000_000, "max_age_s": 86_400.0, "clock": clock}
    opts.update(kw)
    return Buffer(path, **opts)  # type: ignore[arg-type]


def _put(buf, clock: FakeClock, seq: int, size: int = 200) -> int:
    from tests.test_buffer import _item

    return buf.put(_item(clock, seq, size=size))


def test_a_database_another_process_holds_locked_refuses_the_write_as_transient_and_loses_nothing(
    tmp_path, fake_clock: FakeClock
) -> None:
    import sqlite3
    import time

    from mapper.errors import TransientError

    buf = _buffer(tmp_path / "b.db", fake_clock)
    _put(buf, fake_clock, 0)
    other = sqlite3.connect(tmp_path / "b.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # e.g. `gpu-mapper buffer` or sqlite3 on the node holding the write lock
    try:
        buf._conn.execute("PRAGMA busy_timeout = 200")  # (SQLite's own wait: 5 s in production)
        started = time.monotonic()
        with pytest.raises(TransientError, match="locked"):
            _put(buf, fake_clock, 1)
        assert time.monotonic() - started < 4.0
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert buf.stats().files_moved_aside == 0, "a locked file is not corrupt: never moved aside"
    _put(buf, fake_clock, 2)
    assert [r.payload[0] for r in buf.pending(10)] == [0, 2]
    assert sum(buf.stats().drops_by_reason.values()) == 0
    buf.close()


def test_a_batch_that_still_does_not_fit_after_eight_rounds_of_dropping_is_refused_and_counted(
    tmp_path, fake_clock: FakeClock
) -> None:
    from mapper.errors import TransientError

    buf = _buffer(tmp_path / "b.db", fake_clock, max_page_count=40)  # 160 KiB of file
    for seq in range(100):
        _put(buf, fake_clock, seq, size=1000)
    before = buf.stats().batches
    drops_before = buf.stats().drops_by_reason["disk_full"]  # (filling it already dropped some)
    with pytest.raises(TransientError, match="disk still full after dropping; batch lost"):
        _put(buf, fake_clock, 100, size=150_000)
    stats = buf.stats()
    assert 0 < stats.batches < before, "the oldest were dropped trying"
    dropped = stats.drops_by_reason["disk_full"] - drops_before
    assert dropped == before - stats.batches + 1, "the refused batch is counted too"
    assert [r.payload[0] for r in buf.pending(1000)] == list(range(100 - stats.batches, 100)), "the newest kept"
    _put(buf, fake_clock, 101, size=1000)  # and the buffer goes on
    buf.close()


def test_a_buffer_written_by_a_newer_mapper_is_refused_and_kept_for_it(tmp_path, fake_clock: FakeClock) -> None:
    import sqlite3

    from mapper.edge.storage.buffer import SCHEMA_VERSION
    from mapper.errors import PermanentError

    buf = _buffer(tmp_path / "b.db", fake_clock)
    _put(buf, fake_clock, 0)
    buf.close()
    with sqlite3.connect(tmp_path / "b.db") as db:  # an upgrade that was rolled back leaves its file behind
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    with pytest.raises(PermanentError, match=f"buffer schema {SCHEMA_VERSION + 1} is newer"):
        _buffer(tmp_path / "b.db", fake_clock).pending(10)
    assert not list(tmp_path.glob("b.db.*corrupt*")) and not list(tmp_path.glob("*.bad*")), "not moved aside"
    with sqlite3.connect(tmp_path / "b.db") as db:
        assert db.execute("SELECT count(*) FROM batches").fetchone() == (1,), "its batches are still there"


def test_a_closed_buffer_refuses_every_use_with_a_clear_error(tmp_path, fake_clock: FakeClock) -> None:
    from mapper.errors import PermanentError

    buf = _buffer(tmp_path / "b.db", fake_clock)
    _put(buf, fake_clock, 0)
    buf.close()
    buf.close()  # twice is harmless (shutdown paths may both close it)
    for use in (lambda: _put(buf, fake_clock, 1), lambda: buf.pending(10), lambda: buf.ack(1)):
        with pytest.raises(PermanentError, match="is closed"):
            use()


# --- start-up failures and their exit codes -----------------------------------------------------------------
# 2: the configuration is wrong (fix it); 1: the node is (a data dir, a buffer or store that cannot be used).


async def _exit_code_of(settings, caplog: pytest.LogCaptureFixture) -> tuple[int, str]:

    from mapper.edge.app import MapperApp
    from mapper.edge.gpu.nvml import NvmlBackend
    from mapper.edge.gpu.simnvml import SimNvml

    app = MapperApp(settings, NvmlBackend(SimNvml(1, "T4", seed=0)))
    code = await asyncio.wait_for(app.run(asyncio.Event()), 30)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and r.name == "mapper.edge.app"]
    assert not [r for r in caplog.records if r.exc_info], "a clear error, not a traceback"
    return code, " | ".join(errors)


@pytest.mark.timeout(60)
async def test_a_data_dir_that_cannot_be_made_exits_1_naming_it(tmp_path, caplog) -> None:
    from tests.apphelpers import fast_settings

    (tmp_path / "a-file").write_text("")
    code, errors = await _exit_code_of(fast_settings(str(tmp_path / "a-file" / "data")), caplog)
    assert code == 1 and "data dir" in errors and "a-file" in errors, errors


@pytest.mark.timeout(60)
async def test_a_data_dir_that_is_a_file_exits_1_naming_it(tmp_path, caplog) -> None:
    from tests.apphelpers import fast_settings

    (tmp_path / "data").write_text("")
    code, errors = await _exit_code_of(fast_settings(str(tmp_path / "data")), caplog)
    assert code == 1 and "data dir" in errors, errors


@pytest.mark.timeout(90)
def test_a_data_dir_the_mapper_cannot_write_exits_1_naming_what_it_could_not_create(tmp_path) -> None:
    """An existing data dir this user may not write (root-owned 0755: as root the mapper runs as nobody; as any
    other user the directory is made 0555). Root ignores modes, hence the other user."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from tests.apphelpers import setpriv_as
    from tests.brokers import free_port

    base = Path(tempfile.mkdtemp(prefix="gpu-mapper-rodata-"))  # (pytest's tmp_path is 0700: nobody cannot reach it)
    try:
        base.chmod(0o755)
        (base / "devices").mkdir(mode=0o755)
        data = base / "data"
        data.mkdir()
        data.chmod(0o755 if os.geteuid() == 0 else 0o555)
        prefix = setpriv_as(65534) if os.geteuid() == 0 else []
        argv = ["run", "--sim", "1", "--node-name", "edge-1", "--devices", str(base / "devices")]
        argv += ["--data-dir", str(data), "--metrics-addr", f"127.0.0.1:{free_port()}"]
        out = subprocess.run(
            [*prefix, sys.executable, "-m", "mapper.cli", *argv],
            cwd=Path(__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1, out.stderr[-3000:]
        assert f"{data}/telemetry.db: cannot create it 0600 (Permission denied)" in out.stderr, out.stderr[-3000:]
        assert f"cannot start: buffer {data}/telemetry.db: cannot open" in out.stderr, out.stderr[-3000:]
        assert "Traceback" not in out.stderr, "a clear error, not a traceback"
        assert list(data.iterdir()) == [], "nothing was written"
    finally:
        (base / "data").chmod(0o755)
        subprocess.run(["rm", "-rf", str(base)], check=False, timeout=30)


@pytest.mark.timeout(60)
async def test_a_buffer_that_cannot_be_opened_exits_1_naming_it(tmp_path, caplog) -> None:
    from tests.apphelpers import fast_settings

    (tmp_path / "telemetry.db").mkdir()
    code, errors = await _exit_code_of(fast_settings(str(tmp_path)), caplog)
    assert code == 1 and "telemetry.db" in errors, errors


@pytest.mark.timeout(60)
async def test_a_desired_store_that_cannot_be_opened_is_moved_aside_and_the_mapper_starts(tmp_path) -> None:
    from mapper.edge.gpu.simnvml import SimNvml
    from tests.apphelpers import fast_settings, running_app

    (tmp_path / "desired.db" / "desired.db").mkdir(parents=True)  # SQLite cannot open a directory
    async with running_app(fast_settings(str(tmp_path)), SimNvml(1, "T4", seed=0)) as app:
        assert app.store is not None and app.store.moved_aside is not None
        assert app.store.moved_aside.name.startswith("desired.db.corrupt-")
        assert app.store.load_all() == []


@pytest.mark.timeout(60)
async def test_a_buffer_from_a_newer_mapper_exits_1_and_is_kept(tmp_path, caplog, fake_clock: FakeClock) -> None:
    import sqlite3

    from mapper.edge.storage.buffer import SCHEMA_VERSION
    from tests.apphelpers import fast_settings

    buf = _buffer(tmp_path / "telemetry.db", fake_clock)
    _put(buf, fake_clock, 0)
    buf.close()
    with sqlite3.connect(tmp_path / "telemetry.db") as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    code, errors = await _exit_code_of(fast_settings(str(tmp_path)), caplog)
    assert code == 1 and "newer" in errors, errors
    with sqlite3.connect(tmp_path / "telemetry.db") as db:
        assert db.execute("SELECT count(*) FROM batches").fetchone() == (1,)


@pytest.mark.timeout(60)
async def test_a_metrics_port_in_use_exits_2_naming_it(tmp_path, caplog) -> None:
    import socket

    from tests.apphelpers import fast_settings

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, errors = await _exit_code_of(fast_settings(str(tmp_path), metrics_addr=f"127.0.0.1:{port}"), caplog)
    assert code == 2 and f"127.0.0.1:{port}" in errors and "in use" in errors, errors


@pytest.mark.timeout(60)
async def test_a_dmi_socket_path_too_long_exits_2_naming_it(tmp_path, caplog) -> None:
    from tests.apphelpers import fast_settings

    long_path = "/tmp/" + "x" * 120 + ".sock"
    code, errors = await _exit_code_of(fast_settings(str(tmp_path), socket=long_path), caplog)
    assert code == 2 and "longer than 107 bytes" in errors, errors


@pytest.mark.timeout(60)
async def test_a_dmi_socket_path_that_is_a_directory_exits_2_naming_it(tmp_path, caplog, sock_dir) -> None:
    import os

    from tests.apphelpers import fast_settings

    os.mkdir(f"{sock_dir}/gpu.sock")
    code, errors = await _exit_code_of(fast_settings(str(tmp_path), socket=f"{sock_dir}/gpu.sock"), caplog)
    assert code == 2 and "gpu.sock" in errors, errors


# --- the DMI client: a permanent refusal, and the retry after it -----------------------------------------------


async def test_a_register_edgecore_refuses_for_good_is_retried_after_30_s_and_succeeds_once_it_accepts(
    sock_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import grpc

    from tests import fake_edgecore
    from tests.fake_edgecore import FakeEdgeCore
    from tests.test_dmi_client import make_client

    clock = FakeClock()
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), now=clock.monotonic)
    refusing = {"on": True}
    accept = fake_edgecore._Manager.MapperRegister

    async def register(self, request, context):  # type: ignore[no-untyped-def]
        if refusing["on"]:
            self.edge.rec.refused.append(("MapperRegister", "refused"))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "mapper gpu is not allowed on this node")
        return await accept(self, request, context)

    monkeypatch.setattr(fake_edgecore._Manager, "MapperRegister", register)
    await core.start()
    client = make_client(core, sock_dir, clock=clock)
    try:
        await client.step()
        assert not client.registered
        assert "not allowed on this node" in (client.last_error or "")
        assert len(core.rec.refused) == 1
        clock.advance(29.0)
        await client.step()
        assert len(core.rec.refused) == 1, "a permanent refusal is not retried at once"
        refusing["on"] = False
        clock.advance(1.5)
        await client.step()
        assert client.registered, "retried 30 s after the refusal, and EdgeCore now accepts"
    finally:
        await client.close()
        await asyncio.wait_for(core.stop(), 5)


# --- callbacks that raise -------------------------------------------------------------------------------------


async def test_mqtt_callbacks_that_raise_are_logged_and_the_session_goes_on(mosquitto, caplog) -> None:
    from mapper.net.mqtt import MqttSession
    from tests.apphelpers import wait_for

    got: list[bytes] = []
    sess = MqttSession(mosquitto.url, "raising", reconnect_min_s=0.05, reconnect_max_s=0.2)

    def bad_message(topic: str, payload: bytes) -> None:
        raise RuntimeError("a bug in a message callback")

    async def bad_async_message(topic: str, payload: bytes) -> None:
        raise RuntimeError("a bug in an async message callback")

    def bad_connect() -> None:
        raise RuntimeError("a bug in an on-connect callback")

    sess.subscribe("t/#", bad_message)
    sess.subscribe("t/#", bad_async_message)
    sess.subscribe("t/#", lambda t, p: got.append(p))
    sess.add_on_connect(bad_connect)
    await sess.start()
    try:
        assert await sess.wait_subscribed(5)
        await sess.publish("t/1", b"one", timeout_s=5)
        await sess.publish("t/2", b"two", timeout_s=5)
        await wait_for(lambda: got == [b"one", b"two"], what="both messages at the good callback")
        await wait_for(
            lambda: sum("callback task failed" in r.getMessage() for r in caplog.records) >= 2,
            what="the async callback's failures logged",
        )
        messages = [r.getMessage() for r in caplog.records]
        assert sum("message callback for t/" in m for m in messages) == 2
        assert any("on-connect callback" in m for m in messages)
        assert sess.connected and sess.reconnects == 0, "a raising callback does not cost the connection"
    finally:
        await sess.stop(2)


async def test_a_registry_listener_that_raises_does_not_starve_the_other_listeners_and_a_sync_goes_on() -> None:
    from mapper.edge.kubeedge.dmi.convert import device_from_pb
    from mapper.edge.kubeedge.registry import Registry
    from tests.fake_edgecore import pb_device

    seen: list[str] = []
    registry = Registry(node_gpus=lambda: ["GPU-1", "GPU-2"])

    def bad(change) -> None:  # type: ignore[no-untyped-def]
        if change.device.name == "gpu0":
            raise RuntimeError("a bug in a listener")

    registry.subscribe(bad)
    registry.subscribe(lambda change: seen.append(f"{change.kind} {change.device.name}"))
    # A DMI call: the change is made and every listener hears of it; the error comes back (DMI answers INTERNAL).
    with pytest.raises(RuntimeError, match="a bug in a listener"):
        registry.upsert_device(device_from_pb(pb_device("gpu0", "GPU-1")))
    assert seen == ["added gpu0"] and registry.get_device("default", "gpu0").uuid == "GPU-1"
    # A folder or register sync: the bad entry is reported, the others are made.
    gpu1 = device_from_pb(pb_device("gpu1", "GPU-2"))
    changes, errors = registry.sync([gpu1], [])
    assert [c.kind for c in changes] == ["added"] and [(k, str(e)) for k, e in errors] == [
        ("default/gpu0", "a bug in a listener")
    ]
    assert seen == ["added gpu0", "removed gpu0", "added gpu1"]


def test_a_sync_that_renames_a_device_or_moves_one_to_the_gpu_another_leaves_makes_every_change() -> None:
    """Found by the lifecycle harness (tests/lifecycle, seed 3): a Device renamed inside one devices file was
    refused (``GPU ... already belongs to device <old name>``) while the old name was removed, and the GPU was
    left unbound until the next edit."""
    from mapper.edge.kubeedge.dmi.convert import device_from_pb
    from mapper.edge.kubeedge.registry import Registry
    from tests.fake_edgecore import pb_device

    registry = Registry(node_gpus=lambda: ["GPU-1", "GPU-2", "GPU-3"])
    seen: list[str] = []
    registry.subscribe(lambda change: seen.append(f"{change.kind} {change.device.name}"))
    changes, errors = registry.sync([device_from_pb(pb_device("spare", "GPU-1"))], [])
    assert errors == [] and seen == ["added spare"]
    # One version of the files: spare renamed to infer (same GPU).
    changes, errors = registry.sync([device_from_pb(pb_device("infer", "GPU-1"))], [])
    assert errors == []
    assert sorted(f"{c.kind} {c.device.name}" for c in changes) == ["added infer", "removed spare"]
    assert registry.get_device("default", "infer").uuid == "GPU-1"
    # One version: a (infer) moves to GPU-3, b takes GPU-1, listed first so that its first try finds GPU-1 taken.
    changes, errors = registry.sync(
        [device_from_pb(pb_device("b", "GPU-1")), device_from_pb(pb_device("infer", "GPU-3"))], []
    )
    assert errors == []
    assert registry.get_device("default", "infer").uuid == "GPU-3"
    assert registry.get_device("default", "b").uuid == "GPU-1"
    # Two Devices asking for one GPU: one is refused and named, the other keeps it.
    changes, errors = registry.sync(
        [device_from_pb(pb_device("b", "GPU-1")), device_from_pb(pb_device("c", "GPU-1"))], [], keep=["default/infer"]
    )
    assert [(k, "already belongs" in str(e)) for k, e in errors] == [("default/c", True)]
    assert registry.get_device("default", "b").uuid == "GPU-1"


# --- the shipper and the MQTT session failing while connected ---------------------------------------------------


async def test_a_broker_that_stops_answering_while_connected_costs_no_batch(tmp_path, mosquitto) -> None:
    import signal

    from mapper.clock import SystemClock
    from mapper.edge.outbox.shipper import TelemetryShipper
    from mapper.edge.storage.buffer import Buffer
    from mapper.net.mqtt import MqttSession
    from tests.apphelpers import wait_for
    from tests.test_shipper import Consumer, _batch

    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    session = MqttSession(mosquitto.url, "mapper-n1", reconnect_min_s=0.05, reconnect_max_s=0.2, keepalive_s=30)
    shipper = TelemetryShipper(buf, session.publish, node="n1", clock=SystemClock(), retry_s=0.2, publish_timeout_s=1)
    session.add_on_connect(shipper.notify_connected)
    await session.start()
    task = asyncio.create_task(shipper.run())
    try:
        async with Consumer(mosquitto.url) as consumer:
            assert await session.wait_connected(5)
            shipper.submit(_batch("default/gpu0", 0))
            await wait_for(lambda: len(consumer.seen) == 1 and buf.stats().batches == 0, what="the first batch")
            assert mosquitto.proc is not None
            mosquitto.proc.send_signal(signal.SIGSTOP)  # connected, but no PUBACK comes
            try:
                for seq in range(1, 4):
                    shipper.submit(_batch("default/gpu0", seq))
                await wait_for(lambda: shipper.stats().publish_failures >= 1, what="a publish timed out")
                assert buf.stats().batches == 3, "unacknowledged batches stay in the buffer"
            finally:
                mosquitto.proc.send_signal(signal.SIGCONT)
            await wait_for(lambda: len(consumer.seen) == 4 and buf.stats().batches == 0, what="every batch")
        assert consumer.order["default/gpu0"] == [0, 1, 2, 3], "in order; a resend is a duplicate a consumer drops"
    finally:
        await shipper.stop(2)
        task.cancel()
        await session.stop(2)
        buf.close()


async def test_a_publish_that_raises_unexpectedly_keeps_the_batch_for_the_next_try(tmp_path, mosquitto, caplog) -> None:
    from mapper.clock import SystemClock
    from mapper.edge.outbox.shipper import TelemetryShipper
    from mapper.edge.storage.buffer import Buffer
    from mapper.net.mqtt import MqttSession
    from tests.apphelpers import wait_for
    from tests.test_shipper import Consumer, _batch

    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    session = MqttSession(mosquitto.url, "mapper-n1", reconnect_min_s=0.05, reconnect_max_s=0.2)
    raised: list[str] = []

    async def flaky(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        if len(raised) < 2:
            raised.append(topic)
            raise OSError("a bug below the session: the socket object is gone")
        await session.publish(topic, payload, qos, retain, timeout_s)

    shipper = TelemetryShipper(buf, flaky, node="n1", clock=SystemClock(), retry_s=0.2, publish_timeout_s=3)
    session.add_on_connect(shipper.notify_connected)
    await session.start()
    task = asyncio.create_task(shipper.run())
    try:
        async with Consumer(mosquitto.url) as consumer:
            assert await session.wait_connected(5)
            for seq in range(3):
                shipper.submit(_batch("default/gpu0", seq))
            await wait_for(lambda: len(consumer.seen) == 3 and buf.stats().batches == 0, what="every batch")
        assert len(raised) == 2 and shipper.stats().publish_failures >= 2
        # Nothing lost, nothing twice. (A publish that fails alone while later ones of the in-flight window
        # succeed is overtaken by them: consumers order by seq, see docs/reliability.md.)
        assert sorted(consumer.order["default/gpu0"]) == [0, 1, 2] and consumer.duplicates == 0
        assert any("raised" in r.getMessage() for r in caplog.records)
    finally:
        await shipper.stop(2)
        task.cancel()
        await session.stop(2)
        buf.close()


@pytest.mark.timeout(90)
async def test_an_ack_whose_publish_fails_while_connected_is_kept_and_sent_again(tmp_path, mosquitto) -> None:
    import json

    from mapper.errors import TransientError
    from tests.apphelpers import running_app, wait_for
    from tests.test_app_eventbus import DEVICE, Listener, matching, standalone

    sim, uuid0, devices, settings = standalone(tmp_path, mosquitto.url)
    listener = Listener(mosquitto.port, "gpu-mapper/#")
    try:
        async with running_app(settings, sim) as app:
            assert app.session is not None
            await wait_for(lambda: app.session.subscribed, what="MQTT subscribed")
            publish = app.session.publish
            failed: list[str] = []

            async def failing_acks(topic: str, payload: bytes, *args, **kwargs):  # type: ignore[no-untyped-def]
                if topic.endswith("/desired/ack") and not failed:
                    failed.append(topic)
                    raise TransientError("no PUBACK within 5 s", reason="mqtt-timeout")
                return await publish(topic, payload, *args, **kwargs)

            app.session.publish = failing_acks  # type: ignore[method-assign]
            desired = DEVICE.format(uuid=uuid0).replace(
                "  - {name: power_limit, collectCycle: 100, reportCycle: 300, reportToCloud: true}",
                '  - {name: power_limit, desired: {value: "300"}, collectCycle: 100, reportCycle: 300, '
                "reportToCloud: true}",
            )
            (devices / "gpu0.yaml").write_text(desired)
            await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 300, timeout_s=15, what="300 W on the GPU")
            acks = await wait_for(
                lambda: [a for a in matching(listener, "/desired/ack") if a["result"] == "applied"],
                timeout_s=30,
                what="the ack, sent again from the buffer",
            )
            assert failed, "the first publish of the ack failed"
            assert acks[0]["property"] == "power_limit" and acks[0]["desired"] == "300"
            assert json.dumps(acks[0])
    finally:
        listener.close()
