"""One bad input, or one GPU's failing step, never stops the other GPUs or the process (issue 16, part 1).

Each test here reproduces a finding of the seeded fuzzer against main, through the real door (a real mosquitto,
the whole mapper in-process on simulated GPUs), and fails without its fix."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from mapper.edge.gpu.simnvml import SimNvml
from tests.apphelpers import running_app, wait_for
from tests.test_app_eventbus import Listener, standalone

DELTA_TOPIC = "$hw/events/device/default/gpu0/twin/update/delta"


def rounds_after(app, n: int):
    """A predicate true once the collector has finished ``n`` more rounds than now."""
    start = app.status.collect_duration.count
    return lambda: app.status.collect_duration.count >= start + n


@pytest.mark.timeout(60)
async def test_a_delta_with_an_out_of_range_timestamp_is_refused_and_the_mapper_keeps_running(
    mosquitto, tmp_path: Path
) -> None:
    sim, uuid0, _, settings = standalone(tmp_path, mosquitto.url)
    listener = Listener(mosquitto.port)
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")
            await wait_for(lambda: app.workers[uuid0].device is not None, what="the Device bound")
            # The fuzzer's finding: a timestamp past SQLite's 64-bit INTEGER went through parse_delta, became the
            # desired value's version, and the store's INSERT raised OverflowError out of the collect step.
            listener.publish(DELTA_TOPIC, json.dumps({"timestamp": 2**70, "delta": {"power_limit": "280"}}).encode())
            listener.publish(DELTA_TOPIC, json.dumps({"timestamp": -5, "delta": {"power_limit": "281"}}).encode())
            await wait_for(rounds_after(app, 5), what="five collect rounds after the bad deltas")
            assert sim.gpu(uuid0).power_limit_w == 700
            assert app.workers[uuid0].desired.get("power_limit") is None
            # And a good delta afterwards still works: nothing was poisoned (no version from the far future).
            now_ms = int(time.time() * 1000)
            listener.publish(DELTA_TOPIC, json.dumps({"timestamp": now_ms, "delta": {"power_limit": "275"}}).encode())
            await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 275, what="275 W on the GPU")
    finally:
        listener.close()


@pytest.mark.timeout(60)
async def test_deeply_nested_eventbus_json_is_refused_without_a_traceback(
    mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim, uuid0, _, settings = standalone(tmp_path, mosquitto.url)
    listener = Listener(mosquitto.port)
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")
            nested = b"[" * 60000 + b"]" * 60000
            listener.publish(DELTA_TOPIC, nested[:60000])
            listener.publish(DELTA_TOPIC, b'{"delta": ' + b"[" * 30000 + b"]" * 30000 + b"}")
            listener.publish("$hw/events/node/edge-1/membership/updated", nested[:65000])
            await wait_for(
                lambda: sum("nested too deeply" in r.getMessage() for r in caplog.records) >= 3,
                what="three refusals that name the nesting",
            )
            assert not [r for r in caplog.records if r.exc_info], "no traceback for a bad message"
            assert sim.gpu(uuid0).power_limit_w == 700
    finally:
        listener.close()


@pytest.mark.timeout(60)
async def test_one_gpus_failing_step_is_counted_and_the_others_keep_reporting(tmp_path: Path) -> None:
    from tests.apphelpers import fast_settings

    sim = SimNvml(3, "T4", seed=0, scenario="steady")
    settings = fast_settings(str(tmp_path))
    async with running_app(settings, sim) as app:
        await wait_for(lambda: all(w.values for w in app.workers.values()), what="every GPU sampled")
        bad = app.workers[sim.gpus[1].uuid]

        # A bug in one GPU's step (here: a policy that raises for it) is not a MapperError the step expects.
        real_decide = app.policies.decide

        def decide(uuid, values, ctx, now_s):
            if uuid == bad.uuid:
                raise ZeroDivisionError("a bug in this GPU's step")
            return real_decide(uuid, values, ctx, now_s)

        app.policies.decide = decide  # type: ignore[method-assign]
        others = [w for w in app.workers.values() if w is not bad]
        before = {w.uuid: w.values_ts_ms for w in others}
        await wait_for(
            lambda: all(w.values_ts_ms > before[w.uuid] + 500 for w in others), what="the other GPUs sampled on"
        )
        assert app.exit_code == 0
        assert app.collector.errors.get("step-failed", 0) >= 1
        assert bad.state == "unhealthy"
        # The GPU recovers when its step works again.
        app.policies.decide = real_decide  # type: ignore[method-assign]
        await wait_for(lambda: bad.state == "online", what="the GPU back online")


@pytest.mark.timeout(30)
async def test_sigterm_while_nvml_is_not_ready_stops_the_mapper(tmp_path: Path) -> None:
    from mapper.edge.app import MapperApp
    from mapper.edge.gpu.nvml import NvmlBackend
    from mapper.errors import TransientError
    from tests.apphelpers import fast_settings

    class NotReady(NvmlBackend):
        calls = 0

        def init(self) -> None:
            type(self).calls += 1
            raise TransientError("NVML driver not loaded yet")

    app = MapperApp(fast_settings(str(tmp_path)), NotReady(SimNvml(1, "T4", seed=0)))
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    await wait_for(lambda: NotReady.calls >= 1, what="the first NVML init")
    stop.set()
    started = time.monotonic()
    code = await asyncio.wait_for(task, 10)
    assert time.monotonic() - started < 2.0, "the NVML retry must look at the stop event"
    assert code == 0


@pytest.mark.timeout(60)
async def test_a_sampling_round_that_raises_a_bug_is_retried_and_the_mapper_keeps_running(tmp_path: Path) -> None:
    from tests.apphelpers import fast_settings

    sim = SimNvml(2, "T4", seed=0, scenario="steady")
    async with running_app(fast_settings(str(tmp_path)), sim) as app:
        await wait_for(lambda: all(w.values for w in app.workers.values()), what="every GPU sampled")
        real = app.backend.sample_many
        failures = []

        def sample_many(requests, poll):
            if len(failures) < 3:
                failures.append(1)
                raise KeyError("a bug in the round")
            return real(requests, poll)

        app.backend.sample_many = sample_many  # type: ignore[method-assign]
        await wait_for(lambda: len(failures) == 3, what="three failed rounds")
        stamps = {w.uuid: w.values_ts_ms for w in app.workers.values()}
        await wait_for(
            lambda: all(w.values_ts_ms > stamps[w.uuid] for w in app.workers.values()), what="sampling again"
        )
        assert app.exit_code == 0
        assert app.collector.errors.get("error", 0) >= 3
