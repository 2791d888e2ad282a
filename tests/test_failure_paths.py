"""Failure branches no other test reached (issue 16, part 3): each test drives one branch through real parts
(the simulated NVML under the real backend, real SQLite files, a real mosquitto) and fails without it."""

from __future__ import annotations

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
