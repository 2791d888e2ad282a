from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from tests.brokers import Mosquitto
from tests.fake_edgecore import sock_dir  # noqa: F401  (a short /tmp dir for Unix sockets)
from tests.realparts import require


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def kubeedge_crds() -> Path:
    """The KubeEdge CRD schemas (``../shared/kubeedge/crds``): the test is skipped where they are absent, and fails
    under CI (``tests.realparts``)."""
    from tests.test_device_models import CRDS, CRDS_MISSING

    require(CRDS.is_dir(), CRDS_MISSING)
    return CRDS


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A real mosquitto on a free port, private to the test; ``.stop()`` / ``.start()`` to cut the link."""
    broker = Mosquitto(tmp_path)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The bad-input suite's case count (tests/fuzz): how many inputs were tried, by door."""
    import sys

    kit = sys.modules.get("tests.fuzz.kit")
    if kit is None or not kit.CASES:
        return
    total = sum(kit.CASES.values())
    doors = ", ".join(f"{door} {n}" for door, n in sorted(kit.CASES.items()))
    terminalreporter.write_line(f"bad-input cases tried: {total} ({doors})")
