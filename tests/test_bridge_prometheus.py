"""gpu-mapper bridge against a real mosquitto and a real Prometheus (remote-write receiver, out-of-order window)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.apphelpers import wait_for
from tests.bridgehelpers import bridge_settings, expected_samples, publish_all, running_bridge, stream
from tests.brokers import Mosquitto
from tests.promserver import Prometheus

pytestmark = pytest.mark.slow


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path)
    prom.start()
    try:
        yield prom
    finally:
        prom.stop()


def count_samples(prom: Prometheus, selector: str, at_s: float, window_s: int) -> int:
    return sum(len(v) for v in prom.raw_samples(selector, at_s, window_s).values())


async def test_batches_on_the_broker_reach_prometheus_once_each_named_as_the_mapper_names_them(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    batches = stream(gpus=2, seconds=120)
    want = expected_samples(batches)
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_all(mosquitto.url, batches)
        publish_all(mosquitto.url, batches[:5], with_states=False)  # redelivered: dropped as duplicates
        await wait_for(
            lambda: bridge.stats.batches_written + bridge.stats.duplicate_batches >= len(batches) + 5,
            timeout_s=60,
            what="every batch written",
        )
    assert bridge.stats.duplicate_batches == 5
    assert bridge.stats.samples_written == want
    now = time.time() + 1
    total = count_samples(prometheus, '{__name__=~"gpu_.+"}', now, 600)
    assert total == want
    power = prometheus.raw_samples("gpu_power_usage_watts", now, 600)
    assert len(power) == 2
    for labels, points in power.items():
        names = dict(labels)
        assert names["uuid"].startswith("GPU-") and names["node"] == "edge-1" and "gpu" not in names
        stamps = [t for t, _ in points]
        assert len(stamps) == 120 and stamps == sorted(set(stamps))
