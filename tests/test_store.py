"""The SQLite desired-state store: real files, reopen, migrations, corrupt files moved aside."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from mapper.edge.control.desired import DesiredState
from mapper.edge.storage.store import DEFAULT_FILE, SCHEMA_VERSION, DesiredStore
from mapper.errors import InvalidValueError, PermanentError, TransientError
from tests.smallfs import NEEDS_ROOT, fill, small_tmpfs

UUID = "GPU-11111111-2222-3333-4444-555555555555"


def _state() -> DesiredState:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    state.set("power_limit", "300", "edge", 2_000)
    state.set("persistence_mode", True, "file", 1_200)
    state.set("compute_mode", "bogus", "cloud", 1_300)
    state.set("locked_gpu_clock_max", "1755", "cloud", 1_000)
    state.remove("locked_gpu_clock_max", "cloud", 3_000)
    state.set("power_limit", "100", "cloud", 10)  # stale
    return state


def test_a_saved_state_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "desired.db"
    with DesiredStore(path, now_ms=lambda: 42) as store:
        store.save("default/gpu-0", _state(), uuid=UUID)
    with DesiredStore(path) as store:
        loaded = store.load("default/gpu-0")
    assert loaded is not None
    assert loaded.uuid == UUID and loaded.updated_at_ms == 42
    assert loaded.state.effective() == _state().effective()
    assert loaded.state.effective()["power_limit"].source == "edge"
    assert loaded.state.effective()["persistence_mode"].value is True
    assert loaded.state.effective()["compute_mode"].reason == "unknown-value"
    assert loaded.state.pending_restore() == frozenset({"locked_gpu_clock_max"})
    assert loaded.state.stale_ignored == {"cloud": 1}


def test_saving_again_replaces_the_device_rows(tmp_path: Path) -> None:
    with DesiredStore(tmp_path) as store:
        store.save("default/gpu-0", _state(), uuid=UUID)
        smaller = DesiredState.from_values({"compute_mode": "default"}, "cloud", 5_000)
        store.save("default/gpu-0", smaller, uuid=UUID)
        loaded = store.load("default/gpu-0")
    assert loaded is not None
    assert set(loaded.state.effective()) == {"compute_mode"}
    assert loaded.state.pending_restore() == frozenset()


def test_a_directory_path_means_the_default_file_name(tmp_path: Path) -> None:
    with DesiredStore(tmp_path) as store:
        assert store.path == tmp_path / DEFAULT_FILE
    assert (tmp_path / DEFAULT_FILE).exists()


def test_the_database_uses_wal_and_records_its_named_migrations(tmp_path: Path) -> None:
    with DesiredStore(tmp_path) as store:
        assert store.schema_version == SCHEMA_VERSION
        assert store.migrations() == ["001_initial"]
    db = sqlite3.connect(tmp_path / DEFAULT_FILE)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()


def test_load_all_lists_every_device_and_delete_forgets_one(tmp_path: Path) -> None:
    with DesiredStore(tmp_path) as store:
        store.save("default/gpu-1", DesiredState.from_values({"power_limit": "250"}, "file", 1), uuid="GPU-b")
        store.save("default/gpu-0", _state(), uuid=UUID)
        assert [d.device for d in store.load_all()] == ["default/gpu-0", "default/gpu-1"]
        assert store.delete("default/gpu-0") is True
        assert store.delete("default/gpu-0") is False
        assert store.load("default/gpu-0") is None
        assert [d.uuid for d in store.load_all()] == ["GPU-b"]


def test_a_corrupt_file_is_moved_aside_and_the_store_starts_empty_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "desired.db"
    path.write_bytes(b"this is not an sqlite database at all" * 100)
    with (
        caplog.at_level(logging.ERROR, logger="mapper.edge.storage.store"),
        DesiredStore(path, now_ms=lambda: 7) as store,
    ):
        assert store.moved_aside == tmp_path / "desired.db.corrupt-7"
        assert store.load_all() == []
        store.save("default/gpu-0", _state(), uuid=UUID)
        assert store.load("default/gpu-0") is not None
    assert (tmp_path / "desired.db.corrupt-7").read_bytes().startswith(b"this is not")
    assert any("starting EMPTY" in r.getMessage() for r in caplog.records)


def test_a_store_from_a_newer_mapper_is_refused_not_destroyed(tmp_path: Path) -> None:
    with DesiredStore(tmp_path) as store:
        store.save("default/gpu-0", _state(), uuid=UUID)
    db = sqlite3.connect(tmp_path / DEFAULT_FILE)
    db.execute("INSERT INTO migrations (name, applied_at_ms) VALUES ('999_future', 1)")
    db.commit()
    db.close()
    with pytest.raises(PermanentError, match=r"newer mapper .*999_future"):
        DesiredStore(tmp_path)
    assert (tmp_path / DEFAULT_FILE).exists()


def test_saving_without_a_device_key_is_refused(tmp_path: Path) -> None:
    with DesiredStore(tmp_path) as store, pytest.raises(InvalidValueError, match="device key"):
        store.save("", _state())


def test_a_version_past_sqlites_integer_is_refused_with_a_mapper_error(tmp_path: Path) -> None:
    # The fuzzer's finding: OverflowError from sqlite3 escaped every caller that catches MapperError.
    with DesiredStore(tmp_path / DEFAULT_FILE) as store:
        state = DesiredState()
        state.set("power_limit", "250", "edge", 2**70)
        with pytest.raises(InvalidValueError, match="too large") as info:
            store.save("default/gpu0", state, uuid="GPU-1")
        assert info.value.reason == "out-of-range"
        assert store.load("default/gpu0") is None, "nothing half-written"
        state = DesiredState()
        state.set("power_limit", "250", "edge", 5)
        store.save("default/gpu0", state, uuid="GPU-1")
        loaded = store.load("default/gpu0")
        assert loaded is not None and loaded.state.get("power_limit") is not None


@NEEDS_ROOT
def test_a_store_opened_on_a_full_data_dir_is_read_never_moved_aside_and_saves_once_it_can(tmp_path: Path) -> None:
    """A restart on a full data dir: SQLite cannot even open the file (its -shm cannot grow). The store reads what
    was saved (so it is enforced again), a save fails softly until space returns, and the file is never taken
    for corrupt."""
    with small_tmpfs(tmp_path / "fs", 1024**2) as fs:
        with DesiredStore(fs) as store:
            store.save("default/gpu-0", _state(), uuid=UUID)
        filler = fill(fs)
        with pytest.raises(sqlite3.OperationalError):  # what stopped the mapper's start before
            sqlite3.connect(fs / DEFAULT_FILE).execute("PRAGMA journal_mode=WAL").fetchone()
        store = DesiredStore(fs)
        try:
            assert store.read_only == "data dir full" and store.moved_aside is None
            loaded = store.load("default/gpu-0")
            assert loaded is not None and loaded.uuid == UUID
            assert loaded.state.effective() == _state().effective()
            newer = DesiredState.from_values({"power_limit": "350"}, "file", 9_000)
            with pytest.raises(TransientError):
                store.save("default/gpu-0", newer, uuid=UUID)
            assert not list(fs.glob("*.corrupt-*"))
            filler.unlink()
            store.save("default/gpu-0", newer, uuid=UUID)  # opened for writing now
            assert store.read_only == ""
        finally:
            store.close()
        with DesiredStore(fs) as again:
            loaded = again.load("default/gpu-0")
        assert loaded is not None and set(loaded.state.effective()) == {"power_limit"}
        assert loaded.state.effective()["power_limit"].raw == "350"
