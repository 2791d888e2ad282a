"""The fault suite (issue 16): the mapper as a real process, a real mosquitto, the test EdgeCore over real
sockets and the simulated NVML with fault injection. Each test is bounded in time. The long trials are marked
``slow`` and opted in with ``GPU_MAPPER_LONG_TRIALS=1`` (the project's CI runs ``slow`` tests); a short form
runs in CI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from pathlib import Path

import pytest

from tests.faults.rig import (
    Consumer,
    MapperProcess,
    PersistentBroker,
    buffered,
    device_folder,
    merged_rows,
    uuids,
    wait,
)

pytestmark = pytest.mark.timeout(180)


def _no_gap(seen: set[tuple[str, int]]) -> list[str]:
    """Per boot id, the seqs missing between the first and the last one seen."""
    gaps = []
    for boot in {b for b, _ in seen}:
        seqs = sorted(s for b, s in seen if b == boot)
        missing = sorted(set(range(seqs[0], seqs[-1] + 1)) - set(seqs))
        if missing:
            gaps.append(f"boot {boot}: {missing[:10]}")
    return gaps


# --- the broker stopped under load, then back --------------------------------------------------------------


def test_the_broker_stopped_under_load_then_back_loses_no_batch_keeps_order_and_reconnects_within_5_s(
    tmp_path: Path,
) -> None:
    broker = PersistentBroker(tmp_path)
    broker.start()
    consumer = Consumer(broker.port)
    devices = device_folder(tmp_path / "devices", 8)
    mapper = MapperProcess(tmp_path, 8, "--devices", str(devices), "--mqtt", broker.url)
    try:
        mapper.wait_started()
        wait(lambda: {f"default/gpu{i}" for i in range(8)} <= set(consumer.seen()), 60, "all 8 devices' telemetry")
        broker.terminate()
        wait(
            lambda: not (mapper.status() or {}).get("mqtt", {}).get("connected", True),
            20,
            "the mapper offline",
        )
        time.sleep(4.0)  # the outage itself: batches pile up in the mapper's buffer
        during = (mapper.status() or {}).get("buffer", {}).get("batches", 0)
        back_at = time.monotonic()
        broker.start()
        wait(lambda: (mapper.status() or {}).get("mqtt", {}).get("connected"), 20, "the mapper reconnected")
        reconnect_s = time.monotonic() - back_at
        wait(
            lambda: (mapper.status() or {}).get("buffer", {}).get("batches", 1) == 0,
            60,
            "the backlog replayed",
        )
        code, _ = mapper.terminate()
        assert code == 0, mapper.log()[-3000:]
        left = buffered(mapper.data_dir)

        def gaps() -> list[str]:
            seen = consumer.seen()
            return [f"{d}: {g}" for d in seen for g in _no_gap(seen[d] | left.get(d, set()))]

        # What the broker acknowledged (and the mapper so removed) reaches the consumer a moment later.
        with contextlib.suppress(AssertionError):
            wait(lambda: not gaps(), 15, "every batch at the consumer or still buffered")
        assert not gaps(), gaps()
        seen = consumer.seen()
        assert {f"default/gpu{i}" for i in range(8)} <= set(seen)
        for device in seen:
            # Order per device: first arrivals of each boot id's seqs increase.
            first: dict[tuple[str, int], int] = {}
            for i, key in enumerate(consumer.arrivals[device]):
                first.setdefault(key, i)
            order = [s for (_, s), _ in sorted(first.items(), key=lambda kv: kv[1])]
            assert order == sorted(order), f"{device}: out of order {order[:20]}"
        assert reconnect_s < 5.0, f"reconnected {reconnect_s:.1f} s after the broker came back"
        assert during > 0, "the outage was long enough to buffer batches"
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()
        consumer.close()
        broker.stop()


# --- SIGKILL at seeded random moments --------------------------------------------------------------------------


def _kill_trials(tmp_path: Path, trials: int, seed: int) -> dict[str, int]:
    """Each trial starts the mapper on the same data dir and SIGKILLs it after a random 1-4 s (a trial before a
    compacting one first stores three batches of each GPU, so that the compactor has something to merge). Every
    third trial has a broker and a consumer, so the kill can land while replaying; in the trials before those the
    backlog is compacted as soon as it is a second old (merged per stream into 2 s slots: the compactor merges what
    the earlier trials left a few seconds in), so the kill can land while compacting. After each trial, nothing
    that was stored before it may be missing: it is still buffered (merged or not) or at the consumer."""
    rng = random.Random(seed)
    broker = PersistentBroker(tmp_path)
    broker.start()
    consumer = Consumer(broker.port, client_id=f"kill-consumer-{seed}")
    broker.terminate()  # the consumer's session is kept; the broker is up only in replay trials
    devices = device_folder(tmp_path / "devices", 2)
    stored: dict[str, set[tuple[str, int]]] = {}
    counts = {"trials": 0, "replay_trials": 0, "compacting_trials": 0, "merged_rows": 0, "stored_checked": 0}
    try:
        for trial in range(trials):
            replay = trial % 3 == 2
            compacting = trial % 3 == 1
            if replay:
                broker.start()
            args = ["--devices", str(devices)] + (["--mqtt", broker.url] if replay else [])
            config = "telemetry: {window: 1s}\n"
            if compacting:
                config += "buffer: {compactAfter: 1s, compactSlot: 2s}\n"
                counts["compacting_trials"] += 1
            mapper = MapperProcess(tmp_path, 2, *args, name=f"trial{trial}", config=config)
            try:
                mapper.wait_started()
                if trial % 3 == 0:
                    # The next trial compacts what this one leaves: three batches of a GPU (1 s windows) always
                    # put two in one 2 s slot. On a loaded machine a 1-4 s run can leave fewer, and then nothing
                    # merges by chance, not by a fault of the compactor.
                    _wait_for_more_batches(mapper, 6)
                # The seeded random moment (later in a compacting trial: its merges begin a few seconds in).
                time.sleep(rng.uniform(2.0, 5.0) if compacting else rng.uniform(1.0, 4.0))
            finally:
                mapper.kill()
            now = buffered(mapper.data_dir)  # (integrity_check runs in it)
            if compacting:
                counts["merged_rows"] += merged_rows(mapper.data_dir)

            def lost(now: dict[str, set[tuple[str, int]]] = now) -> dict[str, list[tuple[str, int]]]:
                seen = consumer.seen()
                out = {d: sorted(k - now.get(d, set()) - seen.get(d, set())) for d, k in stored.items()}
                return {d: v[:10] for d, v in out.items() if v}

            if replay:  # what the broker acknowledged before the kill reaches the consumer a moment later
                with contextlib.suppress(AssertionError):
                    wait(lambda: not lost(), 15, "the acknowledged batches at the consumer")
                broker.terminate()
                counts["replay_trials"] += 1
            assert not lost(), f"trial {trial}: stored batches lost: {lost()}"
            counts["stored_checked"] += sum(len(k) for k in stored.values())
            for device, keys in now.items():
                stored.setdefault(device, set()).update(keys)
            counts["trials"] += 1
    finally:
        consumer.close()
        broker.stop()
    return counts


def _wait_for_more_batches(mapper: MapperProcess, n: int) -> None:
    """Until the running mapper's buffer holds ``n`` more batches than now (without a broker or compaction the
    count only grows)."""

    def held() -> int:
        return int((mapper.status() or {}).get("buffer", {}).get("batches", 0))

    before = held()
    wait(lambda: held() >= before + n, 30, f"{n} more batches stored")


def test_sigkill_at_random_moments_loses_nothing_stored_short_form(tmp_path: Path) -> None:
    counts = _kill_trials(tmp_path, trials=4, seed=16)
    assert counts["trials"] == 4 and counts["replay_trials"] == 1 and counts["compacting_trials"] == 1
    assert counts["stored_checked"] > 0, counts


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    os.environ.get("GPU_MAPPER_LONG_TRIALS") != "1",
    reason="the 24-trial form takes minutes: GPU_MAPPER_LONG_TRIALS=1 scripts/test.sh tests/faults runs it "
    "(CI runs the 4-trial form above; the project's CI runs `slow` tests, so this one is opted in by env)",
)
def test_sigkill_at_24_random_moments_loses_nothing_stored(tmp_path: Path) -> None:
    counts = _kill_trials(tmp_path, trials=24, seed=1616)
    assert counts["trials"] == 24 and counts["replay_trials"] == 8 and counts["compacting_trials"] == 8
    assert counts["merged_rows"] > 0, counts


# --- one GPU of 8 lost, a driver reload, a slow NVML ----------------------------------------------------------


def _gpus_by_device(status: dict) -> dict[str, dict]:
    return {g["device"]: g for g in status.get("gpus", [])}


def test_one_gpu_of_8_lost_goes_offline_and_the_other_7_keep_reporting(tmp_path: Path) -> None:
    devices = device_folder(tmp_path / "devices", 8)
    mapper = MapperProcess(tmp_path, 8, "--devices", str(devices))
    try:
        mapper.wait_started()
        wait(lambda: len([g for g in (mapper.status() or {}).get("gpus", []) if g.get("sample")]) == 8, 60,
             "all 8 GPUs sampled")  # fmt: skip
        mapper.control(op="lose", gpu=3)
        lost = uuids(8)[3]
        wait(lambda: _gpus_by_device(mapper.status() or {}).get("default/gpu3", {}).get("state") == "offline", 20,
             "gpu3 offline")  # fmt: skip
        before = {d: g["sample"]["ts_ms"] for d, g in _gpus_by_device(mapper.status() or {}).items()}
        wait(
            lambda: all(
                g["sample"]["ts_ms"] > before[d] and g["state"] == "online"
                for d, g in _gpus_by_device(mapper.status() or {}).items()
                if d != "default/gpu3"
            ),
            20,
            "the other 7 sampled again, online",
        )
        assert "XID 79" in mapper.log() or f"GPU {lost} is lost" in mapper.log()
        code, _ = mapper.terminate()
        assert code == 0
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()


def test_a_driver_reload_has_every_desired_setting_applied_again_within_one_cycle(tmp_path: Path) -> None:
    devices = device_folder(tmp_path / "devices", 8, power_limit_w=300)
    mapper = MapperProcess(tmp_path, 8, "--devices", str(devices))
    try:
        mapper.wait_started()
        wait(lambda: all(g["power_limit_w"] == 300 for g in mapper.gpu_state()), 60, "300 W on all 8 GPUs", 0.2)
        mapper.control(op="reload")
        reloaded = time.monotonic()
        assert any(g["power_limit_w"] != 300 for g in mapper.gpu_state()), "the reload reset the settings"
        wait(lambda: all(g["power_limit_w"] == 300 for g in mapper.gpu_state()), 10, "300 W again", 0.05)
        took_s = time.monotonic() - reloaded
        # One collect cycle (1 s) after the reload is seen by the next event poll (on the whole second).
        assert took_s < 2.5, f"re-applied {took_s:.2f} s after the reload"
        code, _ = mapper.terminate()
        assert code == 0
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()


def test_a_slow_nvml_degrades_collection_without_blocking_the_event_loop(tmp_path: Path) -> None:
    import urllib.request

    devices = device_folder(tmp_path / "devices", 2)
    mapper = MapperProcess(tmp_path, 2, "--devices", str(devices))
    try:
        mapper.wait_started()
        wait(
            lambda: all(g.get("sample") for g in (mapper.status() or {}).get("gpus", [])),
            60,
            "both sampled",
        )
        mapper.control(op="delay", s=3.0)  # every NVML call takes 3 s
        worst = 0.0
        deadline = time.monotonic() + 8
        health = []
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert mapper.status(timeout_s=2.0) is not None, "/status answers while NVML hangs"
            worst = max(worst, time.monotonic() - started)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mapper.port}/healthz", timeout=2) as r:
                    health.append(r.status)
            except OSError as exc:
                health.append(getattr(exc, "code", 0))
            time.sleep(0.5)
        assert worst < 1.0, f"/status took {worst:.2f} s: the event loop was blocked"
        errors = (mapper.status() or {}).get("collect", {}).get("errors", {})
        # Health says so in /status (and gpu_mapper_collect_errors_total): the failed rounds are counted. /healthz
        # stays 200 while the loops beat, on purpose: a restart would not make the driver faster, and liveness
        # fails only for a stalled loop or a blocked event loop (docs/operations.md), neither of which a slow NVML
        # causes. Every look in the 8 s said so (one every 0.5 s plus the requests: more than a handful).
        assert sum(errors.values()) > 0, (errors, health)
        assert len(health) >= 5 and set(health) == {200}, f"/healthz answered {health} while NVML was slow"
        mapper.control(op="delay", s=0)
        before = {g["device"]: g["sample"]["ts_ms"] for g in (mapper.status() or {}).get("gpus", [])}
        wait(lambda: all(g["sample"]["ts_ms"] > before[g["device"]] for g in (mapper.status() or {})["gpus"]), 40,
             "collection back")  # fmt: skip
        code, _ = mapper.terminate()
        assert code == 0
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()


# --- disk full -------------------------------------------------------------------------------------------------


def test_a_full_buffer_drops_the_oldest_counts_them_and_keeps_running(tmp_path: Path) -> None:
    devices = device_folder(tmp_path / "devices", 8)
    # A size-limited database (no broker: everything stays in the buffer), 8 KiB: full within seconds.
    mapper = MapperProcess(
        tmp_path, 8, "--devices", str(devices), config="buffer: {maxBytes: 8KiB}\ntelemetry: {window: 1s}\n"
    )
    try:
        mapper.wait_started()
        wait(lambda: sum(((mapper.status() or {}).get("buffer", {}).get("drops") or {}).values()) > 0, 90,
             "the oldest batches dropped")  # fmt: skip
        status = mapper.status() or {}
        assert status["buffer"]["bytes"] <= 8 * 1024
        assert mapper.proc.poll() is None
        code, _ = mapper.terminate()
        assert code == 0
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()


# --- SIGTERM at every start-up stage ---------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["nvml-not-ready", "edgecore-absent", "broker-absent"])
def test_sigterm_at_a_start_up_stage_exits_within_the_grace_period_with_pending_samples_stored(
    tmp_path: Path, stage: str
) -> None:
    from tests.brokers import free_port

    devices = device_folder(tmp_path / "devices", 2)
    args = {
        "nvml-not-ready": ["--devices", str(devices)],
        "edgecore-absent": ["--edgecore-socket", str(tmp_path / "absent.sock"), "--socket", _sock(tmp_path)],
        "broker-absent": ["--devices", str(devices), "--mqtt", f"mqtt://127.0.0.1:{free_port()}"],
    }[stage]
    mapper = MapperProcess(tmp_path, 2, *args, not_ready=stage == "nvml-not-ready")
    try:
        if stage == "nvml-not-ready":
            mapper.wait_log("NVML is not ready")
        else:
            mapper.wait_started()
            # A whole collect round done (its duration observed after every GPU's step went to its telemetry
            # stream): a GPU's sample shows in /status before its step ends, and a step cut short at exit is not
            # pending yet.
            wait(lambda: sum(((mapper.status() or {}).get("collect") or {}).get("duration", {}).get("counts", [])) > 0,
                 60, "a collect round done")  # fmt: skip
        code, took_s = mapper.terminate(timeout_s=30)
        assert code == 0, mapper.log()[-3000:]
        assert took_s < 10.0, f"took {took_s:.1f} s to exit (Kubernetes' grace period is 30 s)"
        if stage != "nvml-not-ready":
            assert sum(len(v) for v in buffered(mapper.data_dir).values()) > 0, "pending samples stored at exit"
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()


def _sock(tmp_path: Path) -> str:
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="flt-", dir="/tmp"), "gpu.sock")


# --- EdgeCore stopped and restarted ---------------------------------------------------------------------------


async def test_edgecore_restarted_the_mapper_registers_again_within_5_s_and_the_gpus_keep_their_settings(
    tmp_path: Path, sock_dir: str
) -> None:
    from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model

    ids = uuids(2)
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    edge.devices = [
        pb_device(f"gpu{i}", ids[i], properties={"temperature": None, "power_limit": "310"}, cycle_ms=1000)
        for i in range(2)
    ]
    edge.models = [pb_model()]
    await edge.start()
    mapper = MapperProcess(tmp_path, 2, "--edgecore-socket", edge.socket_path, "--socket", f"{sock_dir}/gpu.sock")
    try:
        await asyncio.to_thread(mapper.wait_started)
        await _until(lambda: all(g["power_limit_w"] == 310 for g in mapper.gpu_state()), 60, "310 W on both")
        await _until(lambda: len(edge.rec.statuses) >= 2, 30, "twins reported")
        registers = len(edge.rec.registers)
        await edge.stop()
        await asyncio.sleep(2.0)  # EdgeCore is away for a while (its socket gone)
        await edge.start()
        back = time.monotonic()
        await _until(lambda: len(edge.rec.registers) > registers, 10, "registered again")
        assert time.monotonic() - back < 5.0
        statuses = len(edge.rec.statuses)
        await _until(lambda: len(edge.rec.statuses) > statuses, 20, "twins reported again")
        assert all(g["power_limit_w"] == 310 for g in mapper.gpu_state()), "the desired state stayed on the GPUs"
        code, _ = await asyncio.to_thread(mapper.terminate)
        assert code == 0
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()
        await edge.stop()


async def _until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.1)
