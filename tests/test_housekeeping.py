"""The housekeeping loop (``mapper.edge.status.housekeeping``): the status file written each round (a failure logged,
the loop goes on), and the config file's policies reloaded when it changes (a bad edit refused)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

import pytest

from mapper.edge.control.policy import PolicyEngine, parse_policies
from mapper.edge.status.housekeeping import Housekeeping
from mapper.edge.status.metrics import read_status_file, write_status_file
from mapper.edge.status.stats import MapperSnapshot
from mapper.errors import NotFoundError
from tests.apphelpers import wait_for


def thermal(max_c: int, release_c: int) -> str:
    return f"policies:\n  thermalThrottling: {{enabled: true, maxTemp: {max_c}, releaseTemp: {release_c}}}\n"


def touch_later(path: Path, text: str, bump_s: float) -> None:
    """Write ``text`` and move the mtime on by ``bump_s`` (a coarse-mtime filesystem must still see a change)."""
    st = path.stat()
    path.write_text(text)
    os.utime(path, (st.st_atime + bump_s, st.st_mtime + bump_s))


def keeper(cfg: Path | None, policies: PolicyEngine, **kwargs: object) -> Housekeeping:
    return Housekeeping(
        lambda: MapperSnapshot(node="edge-1"),
        lambda snap: None,
        str(cfg) if cfg is not None else None,
        policies,
        lambda: {},
        lambda name, period_s: None,
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_changed_config_file_reloads_the_policies_and_a_bad_edit_keeps_the_previous_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(thermal(85, 80))
    policies = PolicyEngine(parse_policies({"thermalThrottling": {"enabled": True, "maxTemp": 85, "releaseTemp": 80}}))
    hk = keeper(cfg, policies)
    hk.maybe_reload_config()
    assert hk.config_mtime == cfg.stat().st_mtime, "the first look only notes the mtime"
    hk.maybe_reload_config()
    assert policies.config.thermal.max_temp_c == 85

    touch_later(cfg, thermal(78, 70), 1.0)
    with caplog.at_level(logging.INFO, logger="mapper.edge.app"):
        hk.maybe_reload_config()
    assert policies.config.thermal.max_temp_c == 78
    assert any("reloaded" in r.getMessage() for r in caplog.records)

    touch_later(cfg, thermal(70, 75), 1.0)  # release above max: refused
    with caplog.at_level(logging.ERROR, logger="mapper.edge.app"):
        hk.maybe_reload_config()
    assert policies.config.thermal.max_temp_c == 78, "a bad edit keeps the previous policies"
    assert hk.config_mtime == cfg.stat().st_mtime, "and is not looked at again until the next change"
    assert any("refused" in r.getMessage() and str(cfg) in r.getMessage() for r in caplog.records)


def test_no_config_file_or_a_missing_one_changes_nothing(tmp_path: Path) -> None:
    policies = PolicyEngine()
    before = policies.config
    for hk in (keeper(None, policies), keeper(tmp_path / "absent.yaml", policies)):
        hk.maybe_reload_config()
        assert hk.config_mtime == 0.0
    assert policies.config == before


async def test_the_loop_writes_the_status_file_each_round_and_logs_a_failure_without_stopping(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rounds = 0
    beats: list[tuple[str, float]] = []

    def snapshot() -> MapperSnapshot:
        nonlocal rounds
        rounds += 1
        return MapperSnapshot(node="edge-1", taken_at_ms=rounds)

    data = tmp_path / "data"
    swapping = threading.Lock()  # held while the test swaps the data dir: no write (on its thread) in between

    def write(snap: MapperSnapshot) -> None:
        with swapping:
            write_status_file(data, snap)

    hk = Housekeeping(
        snapshot,
        write,
        None,
        PolicyEngine(),
        lambda: {},
        lambda name, period_s: beats.append((name, period_s)),
        interval_s=0.01,
    )
    with pytest.raises(NotFoundError):
        read_status_file(data)
    task = asyncio.create_task(hk.run())
    try:
        await wait_for(lambda: rounds >= 3, what="three rounds")
        assert read_status_file(data).taken_at_ms >= 2
        # The data dir becomes a file: the write fails, is logged, and the loop goes on.
        with swapping:
            for entry in data.iterdir():
                entry.unlink()
            data.rmdir()
            data.write_text("not a directory")
        seen = rounds
        with caplog.at_level(logging.WARNING, logger="mapper.edge.app"):
            await wait_for(lambda: rounds >= seen + 2, what="two more rounds")
        assert not task.done()
        assert any("could not write the status file" in r.getMessage() for r in caplog.records)
    finally:
        task.cancel()
    assert beats[0] == ("housekeeping", 0.01)
