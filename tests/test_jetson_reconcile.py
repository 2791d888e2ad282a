"""Desired state on a Jetson: the devfreq range (snapped to the available frequencies, written in order, read back)
and the nvpmodel power mode, through the real Reconciler over the real JetsonBackend on a simulated board's files
(and its fake nvpmodel, a real subprocess), with the same outcomes in desired_status as on NVML GPUs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.control.desired import DesiredState, make_desired
from mapper.edge.control.reconcile import Reconciler, ReconcileResult, desired_status_twin, parse_desired_status, plan
from mapper.edge.gpu.jetson import JetsonBackend
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simjetson import SimJetson, build_tree, nvpmodel_command
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.storage.store import DesiredStore
from mapper.shared.model import WRITABLE, Constraints
from tests.test_jetson import as_nobody


@dataclass
class Board:
    root: Path
    clock: FakeClock
    backend: JetsonBackend
    uuid: str
    reconciler: Reconciler
    state: DesiredState = field(default_factory=DesiredState)

    def cycle(self) -> ReconcileResult:
        sample = self.backend.sample(self.uuid, WRITABLE)
        result = self.reconciler.step(self.state.effective(), sample, restore=self.state.pending_restore())
        for prop in result.restored:
            self.state.mark_restored(prop)
        self.clock.advance(1.0)
        return result

    def file(self, name: str) -> int:
        return int((self.root / "sys/class/devfreq" / self.devfreq / name).read_text().split()[0])

    @property
    def devfreq(self) -> str:
        return next((self.root / "sys/class/devfreq").iterdir()).name


def make_board(tmp_path: Path, profile: str = "orin-agx", *, nvpmodel: list[str] | None = None, **kwargs) -> Board:
    clock = FakeClock()
    root = tmp_path / profile
    SimJetson.create(root, profile, scenario="steady", clock=clock.monotonic)
    backend = JetsonBackend(root, nvpmodel=nvpmodel or nvpmodel_command(root), clock=clock, **kwargs)
    uuid = backend.list_gpus()[0].uuid
    reconciler = Reconciler(backend, uuid, clock=clock, backoff_min_s=1.0, backoff_max_s=4.0)
    return Board(root, clock, backend, uuid, reconciler)


@pytest.fixture
def orin(tmp_path: Path) -> Iterator[Board]:
    yield make_board(tmp_path)


def test_a_desired_maximum_snaps_down_to_an_available_frequency_and_is_applied_and_acked(orin: Board) -> None:
    orin.state.set("gpu_max_freq", "800", "cloud", 1_000)  # 714 and 816 MHz are the steps around it
    result = orin.cycle()
    assert orin.file("max_freq") == 714_000_000
    assert result.statuses["gpu_max_freq"].text == "applied"
    assert result.desired_status == "gpu_freq_range:applied"
    (ack,) = result.acks
    assert (ack.property, ack.result, ack.effective_value, ack.reported_value) == (
        "gpu_max_freq",
        "applied",
        "714",
        "714",
    )
    assert orin.file("min_freq") == 306_000_000  # the other end: the mode's (MODE_30W: 306 MHz)


def test_a_desired_minimum_snaps_up_and_the_maximum_stays_the_power_modes(orin: Board) -> None:
    orin.state.set("gpu_min_freq", "400", "cloud", 1_000)
    result = orin.cycle()
    assert (orin.file("min_freq"), orin.file("max_freq")) == (408_000_000, 816_000_000)
    assert result.statuses["gpu_min_freq"].text == "applied"


def test_both_ends_move_up_past_the_current_maximum_in_one_step(orin: Board) -> None:
    orin.state.set("gpu_min_freq", "1020", "cloud", 1_000)
    orin.state.set("gpu_max_freq", "1300.5", "cloud", 1_000)
    result = orin.cycle()  # max first (1300.5 > 816), then min: never an inverted range
    assert (orin.file("min_freq"), orin.file("max_freq")) == (1_020_000_000, 1_300_500_000)
    assert {s.text for s in result.statuses.values()} == {"applied"}


def test_values_outside_the_gpus_frequencies_or_an_inverted_range_are_rejected(tmp_path: Path) -> None:
    board = make_board(tmp_path)
    board.state.set("gpu_max_freq", "100", "cloud", 1_000)  # below the lowest step, 306 MHz
    assert board.cycle().desired_status == "gpu_freq_range:rejected-out-of-range"
    assert board.file("max_freq") == 816_000_000
    board.state.set("gpu_max_freq", "510", "cloud", 2_000)
    board.state.set("gpu_min_freq", "900", "cloud", 2_000)
    result = board.cycle()
    assert result.statuses["gpu_min_freq"].text == result.statuses["gpu_max_freq"].text == "rejected-out-of-range"
    board.state.set("gpu_min_freq", "fast", "cloud", 3_000)
    result = board.cycle()
    assert result.statuses["gpu_min_freq"].text == "rejected-not-a-number"
    assert result.statuses["gpu_max_freq"].text == "rejected-not-a-number"


def test_with_clamp_a_maximum_below_the_lowest_step_becomes_the_lowest(tmp_path: Path) -> None:
    board = make_board(tmp_path)
    board.reconciler = Reconciler(board.backend, board.uuid, clock=board.clock, clamp=True)
    board.state.set("gpu_max_freq", "100", "cloud", 1_000)
    result = board.cycle()
    assert board.file("max_freq") == 306_000_000
    assert result.statuses["gpu_max_freq"].text == "applied-clamped"


def test_a_range_changed_behind_the_mappers_back_is_drift_and_set_again(orin: Board) -> None:
    orin.state.set("gpu_max_freq", "612", "cloud", 1_000)
    orin.cycle()
    (orin.root / "sys/class/devfreq" / orin.devfreq / "max_freq").write_text("1300500000\n")  # jetson_clocks, say
    result = orin.cycle()
    assert orin.file("max_freq") == 612_000_000
    assert result.counters.drift_reapplies == {"gpu_freq_range": 1}
    assert result.statuses["gpu_max_freq"].text == "applied"


def test_removing_the_desired_range_returns_to_the_power_modes_range(orin: Board) -> None:
    orin.state.set("gpu_max_freq", "510", "cloud", 1_000)
    orin.cycle()
    orin.state.remove("gpu_max_freq", "cloud", 2_000)
    result = orin.cycle()
    assert (orin.file("min_freq"), orin.file("max_freq")) == (306_000_000, 816_000_000)  # MODE_30W's
    acks = {a.property: a for a in result.acks}
    assert (acks["gpu_max_freq"].result, acks["gpu_max_freq"].reason) == ("applied", "default-restored")


def test_not_root_a_read_only_max_freq_is_rejected_no_permission(tmp_path: Path) -> None:
    clock = FakeClock()
    build_tree(tmp_path, "orin-agx", as_root=False)
    backend = JetsonBackend(tmp_path, clock=clock)
    uuid = backend.list_gpus()[0].uuid

    def step() -> str:
        state = DesiredState()
        state.set("gpu_max_freq", "510", "cloud", 1_000)
        rec = Reconciler(backend, uuid, clock=clock)
        return rec.step(state.effective(), backend.sample(uuid, WRITABLE)).desired_status

    got = step() if os.geteuid() != 0 else as_nobody(tmp_path, step)
    assert got == "gpu_freq_range:rejected-no-permission"


def test_a_power_mode_is_switched_with_nvpmodel_and_its_range_is_the_new_default(orin: Board) -> None:
    orin.state.set("power_mode", "3", "cloud", 1_000)
    result = orin.cycle()
    assert result.desired_status == "power_mode:applied"
    values = orin.backend.sample(orin.uuid, ["power_mode", "power_mode_name", "gpu_max_freq"]).values
    assert values == {"power_mode": 3, "power_mode_name": "MODE_50W", "gpu_max_freq": 1020.0}


def test_a_mode_and_a_maximum_together_end_with_the_maximum_asked_for(orin: Board) -> None:
    orin.state.set("power_mode", "0", "cloud", 1_000)  # MAXN: nvpmodel opens the range to 1300.5 MHz
    orin.state.set("gpu_max_freq", "816", "cloud", 1_000)
    result = orin.cycle()
    assert parse_desired_status(result.desired_status) == {"power_mode": "applied", "gpu_freq_range": "applied"}
    assert orin.file("max_freq") == 816_000_000
    assert orin.backend.sample(orin.uuid, ["power_mode"]).values == {"power_mode": 0}


def test_a_mode_that_needs_a_reboot_is_rejected_with_that_reason_unless_allowed(tmp_path: Path) -> None:
    board = make_board(tmp_path, "orin-nano")
    board.state.set("power_mode", "1", "cloud", 1_000)
    result = board.cycle()
    assert result.desired_status == "power_mode:rejected-needs-reboot"
    assert result.acks[0].reason == "needs-reboot"
    allowed = make_board(tmp_path / "b", "orin-nano", allow_reboot=True)
    allowed.state.set("power_mode", "1", "cloud", 1_000)
    assert allowed.cycle().desired_status == "power_mode:applied"
    assert (allowed.root / "var/lib/nvpmodel/reboot-requested").exists()


def test_an_unknown_mode_a_failing_nvpmodel_and_a_missing_one_are_rejected_with_their_reasons(tmp_path: Path) -> None:
    board = make_board(tmp_path)
    board.state.set("power_mode", "7", "cloud", 1_000)
    assert board.cycle().desired_status == "power_mode:rejected-unknown-value"
    failing = make_board(tmp_path / "f", nvpmodel=["sh", "-c", "echo NVPM ERROR >&2; exit 3", "nvpmodel"])
    failing.state.set("power_mode", "0", "cloud", 1_000)
    result = failing.cycle()
    assert result.desired_status == "power_mode:rejected-command-failed"
    assert "exited with 3" in result.actions[0].error
    missing = make_board(tmp_path / "m", nvpmodel=[str(tmp_path / "nowhere/nvpmodel")])
    missing.state.set("power_mode", "0", "cloud", 1_000)
    assert missing.cycle().desired_status == "power_mode:rejected-not-supported"


def test_a_power_mode_nvpmodel_accepts_but_the_status_does_not_show_is_pending_and_retried(tmp_path: Path) -> None:
    # An nvpmodel that exits 0, says nothing about a reboot and changes nothing: a read-back mismatch.
    board = make_board(tmp_path, nvpmodel=["sh", "-c", "echo done", "nvpmodel"])
    board.state.set("power_mode", "0", "cloud", 1_000)
    result = board.cycle()
    assert [o.outcome for o in result.actions] == ["readback-mismatch"]
    assert "succeeded but the status reads mode 2" in result.actions[0].error
    assert result.desired_status == "power_mode:pending"
    assert [(a.result, a.reason) for a in result.acks] == [("pending", "")]
    assert result.counters.actions[("power_mode", "readback-mismatch")] == 1
    # Each cycle is 1 s: the first backoff (1 s) has passed, the second (2 s) has not.
    assert [o.outcome for o in board.cycle().actions] == ["readback-mismatch"], "retried after the backoff"
    assert board.cycle().actions == (), "the second backoff is 2 s"
    assert [o.outcome for o in board.cycle().actions] == ["readback-mismatch"]


def test_nvml_setters_on_a_jetson_and_jetson_setters_on_an_nvml_gpu_are_not_supported(orin: Board) -> None:
    orin.state.set("power_limit", "20", "cloud", 1_000)
    assert orin.cycle().desired_status == "power_limit:rejected-not-supported"
    clock = FakeClock()
    nvml = NvmlBackend(SimNvml(1, "H100", seed=1, clock=clock.monotonic), clock=clock)
    try:
        uuid = nvml.list_gpus()[0].uuid
        state = DesiredState()
        state.set("gpu_max_freq", "1000", "cloud", 1_000)
        state.set("power_mode", "0", "cloud", 1_000)
        rec = Reconciler(nvml, uuid, clock=clock)
        result = rec.step(state.effective(), nvml.sample(uuid, WRITABLE))
        assert parse_desired_status(result.desired_status) == {
            "power_mode": "rejected-not-supported",
            "gpu_freq_range": "rejected-not-supported",
        }
    finally:
        nvml.shutdown()


def test_the_desired_range_persists_and_is_applied_again_after_a_reboot(tmp_path: Path) -> None:
    board = make_board(tmp_path)
    board.state.set("gpu_max_freq", "612", "cloud", 1_000)
    board.state.set("power_mode", "3", "cloud", 1_000)
    board.cycle()
    with DesiredStore(tmp_path / "data") as store:
        store.save("default/jetson", board.state, uuid=board.uuid)
    # The board reboots: sysfs comes back at the default mode's range, a fresh mapper starts.
    build_tree(board.root, "orin-agx")
    assert board.file("max_freq") == 816_000_000
    again = make_board(tmp_path)  # the same root, the same board: the same UUID
    assert again.uuid == board.uuid
    with DesiredStore(tmp_path / "data") as store:
        (stored,) = store.load_all()
    again.state = stored.state
    result = again.cycle()
    assert again.file("max_freq") == 612_000_000
    assert parse_desired_status(result.desired_status) == {"power_mode": "applied", "gpu_freq_range": "applied"}


def test_the_desired_status_twin_stays_twin_safe_with_every_group() -> None:
    from mapper.edge.control.reconcile import GROUPS, Status

    statuses = {p: Status("rejected", "needs-reboot") for props in GROUPS.values() for p in props}
    text = desired_status_twin(statuses)
    assert text.count(":") == len(GROUPS) and len(text) <= 512


def test_each_bad_side_of_a_desired_frequency_range_is_rejected_with_its_own_reason() -> None:
    board = Constraints(gpu_freqs_mhz=(306.0, 714.0, 816.0, 1300.5), gpu_freq_default_mhz=(306.0, 1300.5))
    desired = {
        "gpu_min_freq": make_desired("gpu_min_freq", "abc", "cloud", 1),
        "gpu_max_freq": make_desired("gpu_max_freq", "-5", "cloud", 1),
    }
    p = plan(desired, {}, board)
    assert {prop: st.text for prop, st in p.statuses.items()} == {
        "gpu_min_freq": "rejected-not-a-number",
        "gpu_max_freq": "rejected-negative",
    }
    assert "gpu_freq_range" not in p.targets


def test_a_removed_power_mode_returns_to_the_boards_default_mode_only_where_modes_are_restored() -> None:
    board = Constraints(power_modes=((0, "MAXN"), (3, "MODE_50W")), power_mode_default=3)
    p = plan({}, {"power_mode": 0}, board, restore={"power_mode"}, restore_modes=True)
    assert p.targets["power_mode"].value == (3,) and p.targets["power_mode"].origin == "default"
    assert [(a.group, a.op, a.value) for a in p.actions] == [("power_mode", "set", (3,))]
    assert "power_mode" not in p.restored, "restored once the board reads the default mode"
    p = plan({}, {"power_mode": 3}, board, restore={"power_mode"}, restore_modes=True)
    assert p.actions == () and p.restored == frozenset({"power_mode"})
    # without restore_modes the mode is left as it is
    p = plan({}, {"power_mode": 0}, board, restore={"power_mode"})
    assert p.targets == {} and p.actions == () and p.restored == frozenset({"power_mode"})
