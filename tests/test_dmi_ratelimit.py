"""The node-wide budget and the coalescing report queue, on fake time."""

from __future__ import annotations

import pytest

from mapper.clock import FakeClock, TokenBucket
from mapper.edge.kubeedge.dmi.ratelimit import ReportScheduler, StateReport, StatusReport
from mapper.shared.model import Twin


def test_a_newer_offer_replaces_the_pending_value_instead_of_queueing_it(fake_clock: FakeClock) -> None:
    scheduler = ReportScheduler(TokenBucket(fake_clock, rate_per_s=1, burst=10))
    scheduler.offer_status("default", "gpu0", [Twin("temperature", "", "60"), Twin("power_usage", "", "100")])
    scheduler.offer_status("default", "gpu0", [Twin("temperature", "", "61")])
    scheduler.offer_state("default", "gpu0", "online")
    scheduler.offer_state("default", "gpu0", "unhealthy", prompt=True)
    assert scheduler.pending == 2
    assert scheduler.stats.coalesced == 2
    state = scheduler.pop_ready()
    status = scheduler.pop_ready()
    assert state == StateReport("default", "gpu0", "unhealthy", prompt=True)
    assert isinstance(status, StatusReport)
    assert {t.name: t.reported for t in status.twins} == {"temperature": "61", "power_usage": "100"}
    assert scheduler.pop_ready() is None


def test_prompt_states_then_prompt_twins_then_periodic_twins_then_periodic_states_devices_taking_turns(
    fake_clock: FakeClock,
) -> None:
    scheduler = ReportScheduler(TokenBucket(fake_clock, rate_per_s=1, burst=10), reserve=0)
    for i in range(3):
        scheduler.offer_state("default", f"gpu{i}", "online")
        scheduler.offer_status("default", f"gpu{i}", [Twin("temperature", "", str(i))])
    scheduler.offer_status("default", "gpu0", [Twin("temperature", "", "99")])  # keeps gpu0's turn
    scheduler.offer_status("default", "gpu2", [Twin("power_limit", "400", "400")], prompt=True)  # gpu2 turns prompt
    scheduler.offer_state("default", "gpu1", "unhealthy", prompt=True)
    order = []
    while (report := scheduler.pop_ready()) is not None:
        order.append((type(report).__name__, report.name, report.prompt))
    assert order == [
        ("StateReport", "gpu1", True),
        ("StatusReport", "gpu2", True),
        ("StatusReport", "gpu0", False),
        ("StatusReport", "gpu1", False),
        ("StateReport", "gpu0", False),
        ("StateReport", "gpu2", False),
    ]
    assert scheduler.stats.popped_prompt == 2


def test_periodic_reports_leave_a_token_per_device_for_prompt_ones(fake_clock: FakeClock) -> None:
    """8 devices' first twins and states (periodic) against a bucket of 10: they leave 8 tokens, so 8 prompt
    reports right after still go at once; the periodic ones follow as the bucket refills."""
    bucket = TokenBucket(fake_clock, rate_per_s=0.8, burst=10)
    scheduler = ReportScheduler(bucket)
    for i in range(8):
        scheduler.offer_state("default", f"gpu{i}", "online")
        scheduler.offer_status("default", f"gpu{i}", [Twin("temperature", "", "40")])
    assert scheduler.reserve == 8
    sent = []
    while (report := scheduler.pop_ready()) is not None:
        sent.append(report)
    assert len(sent) == 2 and all(isinstance(r, StatusReport) for r in sent), "the first twins before the states"
    assert bucket.tokens == pytest.approx(8.0)
    assert scheduler.wait_s() == pytest.approx(1.25), "the next periodic one when the bucket holds 9 again"
    for i in range(8):
        scheduler.offer_status("default", f"gpu{i}", [Twin("power_limit", "400", "400")], prompt=True)
    prompt = []
    while (report := scheduler.pop_ready()) is not None:
        prompt.append(report)
    assert sorted(r.name for r in prompt) == [f"gpu{i}" for i in range(8)] and all(r.prompt for r in prompt)
    # (the two devices whose first twins went out are prompt alone; the other six carry their first twins too)
    assert all(
        {t.name for t in r.twins} == {"temperature", "power_limit"} for r in prompt if r.name not in ("gpu0", "gpu1")
    )
    assert bucket.tokens == pytest.approx(0.0)
    assert scheduler.wait_s() == pytest.approx(9 / 0.8), "the 8 states wait until the reserve is back"
    fake_clock.advance(9 / 0.8)
    assert scheduler.pop_ready() == StateReport("default", "gpu0", "online")


def test_the_reserve_is_one_token_per_gpu_from_the_start_and_at_most_the_burst_less_one(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(fake_clock, rate_per_s=0.8, burst=10)
    scheduler = ReportScheduler(bucket, devices=8)
    assert scheduler.reserve == 8, "before any offer: the first one must not spend the reserve"
    scheduler.offer_status("default", "gpu0", [Twin("temperature", "", "40")])
    scheduler.offer_status("default", "gpu1", [Twin("temperature", "", "40")])
    assert scheduler.pop_ready() is not None and scheduler.pop_ready() is not None
    assert scheduler.pop_ready() is None, "two periodic reports leave 8 tokens"
    assert ReportScheduler(bucket, devices=20).reserve == 9
    assert ReportScheduler(bucket, devices=0).reserve == 0
    assert ReportScheduler(bucket).reserve == 0, "without a count: the devices offered for, none yet"
    with pytest.raises(ValueError, match="devices must be >= 0"):
        ReportScheduler(bucket, devices=-1)


def test_a_periodic_report_waiting_long_enough_is_promoted_and_never_starves(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(fake_clock, rate_per_s=1.0, burst=3)
    scheduler = ReportScheduler(bucket, reserve=2, promote_after_s=30.0)
    bucket.take_forced()
    bucket.take_forced()
    bucket.take_forced()  # empty
    offered_at = fake_clock.monotonic()
    scheduler.offer_state("default", "gpu0", "online")
    assert scheduler.wait_s() == pytest.approx(3.0), "until the bucket keeps its reserve of 2 after it"
    sent_at = None
    for _ in range(400):  # a prompt change every 0.1 s on another device keeps the bucket below the reserve
        scheduler.offer_status("default", "gpu1", [Twin("power_limit", "400", "400")], prompt=True)
        while (report := scheduler.pop_ready()) is not None:
            if isinstance(report, StateReport):
                sent_at = fake_clock.monotonic()
        if sent_at is not None:
            break
        fake_clock.advance(0.1)
    assert sent_at is not None and sent_at - offered_at == pytest.approx(30.0, abs=1.01), "promoted after 30 s"


def test_a_reserve_outside_the_burst_is_refused(fake_clock: FakeClock) -> None:
    with pytest.raises(ValueError, match=r"reserve must be in 0\.\.9"):
        ReportScheduler(TokenBucket(fake_clock, rate_per_s=0.8, burst=10), reserve=10)
    with pytest.raises(ValueError, match="promote_after_s"):
        ReportScheduler(TokenBucket(fake_clock, rate_per_s=0.8, burst=10), promote_after_s=0)


def test_a_failed_report_is_requeued_only_where_nothing_newer_arrived(fake_clock: FakeClock) -> None:
    scheduler = ReportScheduler(TokenBucket(fake_clock, rate_per_s=1, burst=10))
    scheduler.offer_status("default", "gpu0", [Twin("temperature", "", "60"), Twin("power_usage", "", "100")])
    failed = scheduler.pop_ready()
    assert isinstance(failed, StatusReport)
    scheduler.offer_status("default", "gpu0", [Twin("temperature", "", "62")])
    scheduler.requeue(failed)
    again = scheduler.pop_ready()
    assert isinstance(again, StatusReport)
    assert {t.name: t.reported for t in again.twins} == {"temperature": "62", "power_usage": "100"}

    scheduler.offer_state("default", "gpu0", "online")
    failed_state = scheduler.pop_ready()
    assert isinstance(failed_state, StateReport)
    scheduler.offer_state("default", "gpu0", "offline")
    scheduler.requeue(failed_state)
    assert scheduler.pop_ready() == StateReport("default", "gpu0", "offline")


def test_forgetting_a_device_drops_its_pending_reports(fake_clock: FakeClock) -> None:
    scheduler = ReportScheduler(TokenBucket(fake_clock, rate_per_s=1, burst=10))
    scheduler.offer_status("default", "gpu0", [Twin("temperature", "", "60")])
    scheduler.offer_state("default", "gpu0", "online")
    scheduler.forget("default", "gpu0")
    assert scheduler.pending == 0
    assert scheduler.wait_s() is None
    assert scheduler.pop_ready() is None


def test_eight_gpus_reporting_every_second_for_an_hour_stay_within_edgecores_limit(fake_clock: FakeClock) -> None:
    """8 devices offer twins every second and a state every 30 s for an hour of fake time; every 100 ms the
    sender takes what the budget allows. EdgeCore's own bucket (1/s, burst 100) must never run dry, and every
    report sent must carry the newest value offered for that device."""
    scheduler = ReportScheduler(TokenBucket(fake_clock, rate_per_s=0.8, burst=10))
    edge_tokens, edge_at = 100.0, fake_clock.monotonic()
    latest: dict[str, str] = {}
    sent_per_device: dict[str, int] = {}
    sent_times: list[float] = []
    window_s = 3600
    for tick in range(window_s * 10):
        if tick % 10 == 0:
            second = tick // 10
            for d in range(8):
                value = str(second * 10 + d)
                latest[f"gpu{d}"] = value
                scheduler.offer_status("default", f"gpu{d}", [Twin("temperature", "", value)])
                if second % 30 == d:
                    scheduler.offer_state("default", f"gpu{d}", "online")
        while (report := scheduler.pop_ready()) is not None:
            now = fake_clock.monotonic()
            edge_tokens = min(100.0, edge_tokens + (now - edge_at))
            edge_at = now
            assert edge_tokens >= 1.0, f"EdgeCore would refuse a call at t={now}"
            edge_tokens -= 1.0
            sent_times.append(now)
            if isinstance(report, StatusReport):
                assert report.twins[0].reported == latest[report.name], "a stale value was sent"
                sent_per_device[report.name] = sent_per_device.get(report.name, 0) + 1
        fake_clock.advance(0.1)
    assert len(sent_times) <= 0.8 * window_s + 10
    assert len(sent_times) >= 0.8 * window_s - 1
    # no 100 s window holds more than the burst plus the refill
    for i in range(len(sent_times)):
        j = i
        while j < len(sent_times) and sent_times[j] - sent_times[i] < 100:
            j += 1
        assert j - i <= 10 + 80 + 1
    # round-robin: every GPU gets its share (states take 8/30 of the calls)
    counts = sorted(sent_per_device.values())
    assert len(counts) == 8
    assert counts[-1] - counts[0] <= 1
    assert scheduler.pending <= 16
