"""Energy attribution: the split sums to the GPU's energy; idle apart; bounded, monotonic ledgers."""

from __future__ import annotations

import math
import random

import pytest

from mapper.edge.processes.attribution import (
    OTHER,
    EnergyLedger,
    EnergySplit,
    IdlePower,
    ProcessUse,
    WorkloadKey,
    split_energy,
    top_processes,
)


def test_split_by_sm_share_with_idle_apart() -> None:
    # 10 s at a mean 300 W = 3000 J; idle 60 W -> 600 J idle, 2400 J active split 3:1.
    shares: dict[str, float | None] = {"a": 0.6, "b": 0.2}
    split = split_energy(3000.0, 10.0, 60.0, shares)
    assert split.idle_j == pytest.approx(600.0)
    assert split.by_key["a"] == pytest.approx(1800.0)
    assert split.by_key["b"] == pytest.approx(600.0)
    assert split.unattributed_j == 0.0


def test_no_process_leaves_the_active_part_unattributed() -> None:
    split = split_energy(1000.0, 10.0, 60.0, dict[str, float | None]())
    assert (split.idle_j, split.unattributed_j, dict(split.by_key)) == (600.0, 400.0, {})


def test_processes_without_sm_figures_share_evenly() -> None:
    split = split_energy(1000.0, 10.0, 60.0, {"a": None, "b": 0.0})
    assert split.by_key == {"a": 200.0, "b": 200.0}


def test_energy_below_idle_is_all_idle() -> None:
    split = split_energy(300.0, 10.0, 60.0, {"a": 0.9})
    assert split.idle_j == 300.0 and split.by_key["a"] == 0.0


@pytest.mark.parametrize(("energy", "duration"), [(-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, -3.0)])
def test_bad_intervals_are_refused_by_name(energy: float, duration: float) -> None:
    with pytest.raises(ValueError, match=r"energy_j|duration_s"):
        split_energy(energy, duration, 50.0, {"a": 0.5})


def test_random_splits_sum_to_the_gpu_energy_within_rounding() -> None:
    rng = random.Random(20)
    for _ in range(2000):
        n = rng.randint(0, 60)
        shares = {i: rng.choice([None, 0.0, rng.random()]) for i in range(n)}
        energy = rng.uniform(0, 7000)
        split = split_energy(energy, rng.uniform(0.5, 30), rng.uniform(0, 120), shares)
        assert math.fsum([split.idle_j, split.unattributed_j, split.attributed_j]) == pytest.approx(
            energy, rel=1e-12, abs=1e-9
        )
        assert all(v >= 0 for v in split.by_key.values())


def test_idle_power_prefers_config_then_idle_minimum_then_any_minimum() -> None:
    idle = IdlePower()
    assert idle.watts is None and idle.source == "unknown"
    idle.observe(250.0, process_count=2)
    assert (idle.watts, idle.source) == (250.0, "observed-minimum")
    idle.observe(75.0, process_count=0)
    idle.observe(90.0, process_count=0)
    idle.observe(60.0, process_count=3)  # lower, but with work running: not idle
    assert (idle.watts, idle.source) == (75.0, "observed-idle")
    assert IdlePower(configured_w=55.0).watts == 55.0


def test_ledger_counters_are_monotonic_and_bounded_with_hundreds_of_short_lived_workloads() -> None:
    rng = random.Random(7)
    ledger = EnergyLedger(max_keys=8, retention_s=60.0)
    last: dict[WorkloadKey, float] = {}
    for step in range(600):
        now = step * 5.0
        # 3..12 workloads per interval, drawn from 400 short-lived pods
        keys = {WorkloadKey("ns", f"job-{rng.randint(0, 399)}", "main") for _ in range(rng.randint(3, 12))}
        energy = rng.uniform(200, 3000)
        split = split_energy(energy, 5.0, 40.0, {k: rng.random() for k in keys})
        ledger.add(split, now)
        assert len([k for k in ledger.entries if k != OTHER]) <= 8
        for key, entry in ledger.entries.items():
            # a key that expired is absent from one snapshot before it may start again at 0
            assert entry.joules_total >= last.get(key, 0.0), f"{key} went backwards"
        last = {k: e.joules_total for k, e in ledger.entries.items()}
    assert OTHER in ledger.entries and ledger.entries[OTHER].joules_total > 0
    # Nothing was lost while every key stayed: expired keys took their energy with them, so compare a ledger
    # that never expires.
    keep = EnergyLedger(max_keys=8, retention_s=math.inf)
    rng = random.Random(7)
    total = 0.0
    for step in range(600):
        keys = {WorkloadKey("ns", f"job-{rng.randint(0, 399)}", "main") for _ in range(rng.randint(3, 12))}
        energy = rng.uniform(200, 3000)
        total += energy
        keep.add(split_energy(energy, 5.0, 40.0, {k: rng.random() for k in keys}), step * 5.0)
    assert keep.total_j == pytest.approx(total, rel=1e-9)
    assert len(keep.entries) <= 9


def test_ledger_power_is_the_last_intervals_mean() -> None:
    ledger = EnergyLedger()
    a, b = WorkloadKey("ns", "a", "c"), WorkloadKey("ns", "b", "c")
    ledger.add(split_energy(1000.0, 10.0, 0.0, {a: 1.0, b: 1.0}), 10.0)
    assert ledger.entries[a].power_w == pytest.approx(50.0)
    ledger.add(split_energy(1000.0, 10.0, 20.0, {a: 1.0}), 20.0)
    assert ledger.entries[a].power_w == pytest.approx(80.0)
    assert ledger.entries[b].power_w == 0.0 and ledger.entries[b].joules_total == pytest.approx(500.0)
    assert ledger.idle_power_w == pytest.approx(20.0)


def test_top_processes_keeps_the_heaviest_and_sums_the_rest() -> None:
    uses = [ProcessUse(pid=100 + i, memory_used_bytes=i << 20, sm_ratio=(300 - i) / 1000) for i in range(300)]
    kept, other = top_processes(uses, 5)
    assert {u.pid for u in kept} == {100, 101, 102, 103, 104, 395, 396, 397, 398, 399}
    assert other is not None and other.pid == 0
    assert other.memory_used_bytes == sum(u.memory_used_bytes or 0 for u in uses) - sum(
        u.memory_used_bytes or 0 for u in kept
    )
    assert other.sm_ratio == pytest.approx(
        math.fsum(u.sm_ratio or 0 for u in uses) - math.fsum(u.sm_ratio or 0 for u in kept)
    )
    few, none = top_processes(uses[:3], 5)
    assert len(few) == 3 and none is None


def test_beyond_a_top_of_one_the_rest_is_one_use_summing_every_ratio() -> None:
    uses = [
        ProcessUse(1, 100, sm_ratio=0.5, memory_ratio=0.1, encoder_ratio=0.2, decoder_ratio=0.3),
        ProcessUse(2, 900, sm_ratio=0.1, memory_ratio=0.4),
        ProcessUse(3, 50, sm_ratio=0.05, memory_ratio=0.02, encoder_ratio=0.1, decoder_ratio=0.05),
        ProcessUse(4, 10, sm_ratio=0.01, memory_ratio=0.01, encoder_ratio=0.25),
    ]
    kept, rest = top_processes(uses, 1)
    assert [u.pid for u in kept] == [1, 2], "the top by SM share and the top by memory"
    assert rest is not None and (rest.pid, rest.memory_used_bytes) == (0, 60)
    assert rest.sm_ratio == pytest.approx(0.06) and rest.memory_ratio == pytest.approx(0.03)
    assert rest.encoder_ratio == pytest.approx(0.35) and rest.decoder_ratio == pytest.approx(0.05)
    with pytest.raises(ValueError, match="n must be >= 1"):
        top_processes(uses, 0)


def test_an_idle_power_below_one_watt_is_still_the_idle_part() -> None:
    split = split_energy(10.0, 4.0, 0.5, {"p": 0.3})
    assert (split.idle_j, split.by_key) == (2.0, {"p": 8.0})


def test_energy_over_the_bound_goes_to_other_with_its_mean_power_however_small() -> None:
    ledger = EnergyLedger(max_keys=2)
    a, b, c, d = (WorkloadKey("ns", f"pod-{x}", "main") for x in "abcd")
    ledger.add(EnergySplit(10.5, 2.0, 0.0, 0.0, {a: 6.0, b: 4.0, c: 0.5}), now_s=0.0)
    assert ledger.slot(a) == a and ledger.slot(c) == OTHER and ledger.slot(d) == OTHER, "two keys, then other"
    assert set(ledger.entries) == {a, b, OTHER}
    assert (ledger.entries[OTHER].joules_total, ledger.entries[OTHER].power_w) == (0.5, 0.25)


def test_a_key_once_summed_into_other_stays_there_after_a_slot_frees_up() -> None:
    """Its energy so far is in ``other``: a series of its own from then on would start again from 0."""
    ledger = EnergyLedger(max_keys=1, retention_s=600.0)
    a, b = WorkloadKey("ns", "a", "main"), WorkloadKey("ns", "b", "main")
    ledger.add(EnergySplit(2.0, 1.0, 0.0, 0.0, {a: 1.0, b: 1.0}), now_s=0.0)
    ledger.add(EnergySplit(0.0, 1.0, 0.0, 0.0, {}), now_s=1000.0)  # a is forgotten
    assert a not in ledger.entries
    ledger.add(EnergySplit(1.0, 1.0, 0.0, 0.0, {b: 1.0}), now_s=1001.0)
    assert b not in ledger.entries and ledger.entries[OTHER].joules_total == 2.0


def test_four_times_the_bound_of_overflowed_keys_are_still_remembered() -> None:
    """The overflow set is forgotten only once it holds more than 4 x ``max_keys`` keys."""
    ledger = EnergyLedger(max_keys=1, retention_s=600.0)
    keys = [WorkloadKey("ns", f"p{i}", "main") for i in range(5)]  # one with a series, four over the bound
    ledger.add(EnergySplit(5.0, 1.0, 0.0, 0.0, dict.fromkeys(keys, 1.0)), now_s=0.0)
    ledger.add(EnergySplit(0.0, 1.0, 0.0, 0.0, {}), now_s=1000.0)  # the first is forgotten
    ledger.add(EnergySplit(1.0, 1.0, 0.0, 0.0, {keys[1]: 1.0}), now_s=1001.0)
    assert keys[1] not in ledger.entries and ledger.entries[OTHER].joules_total == 5.0
