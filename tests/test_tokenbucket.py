"""The one token bucket (``mapper.clock.TokenBucket``) on fake time: its rate, its burst, refill, debt, and the
even pacing the replay's byte-rate cap gets from it. Its users (EdgeCore's call budget, the door on inbound
messages, the shipper) are tested in their own files."""

from __future__ import annotations

import pytest

from mapper.clock import FakeClock, TokenBucket


def test_bucket_starts_full_then_refills_at_its_rate(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(fake_clock, rate_per_s=0.5, burst=3)
    assert [bucket.try_take() for _ in range(4)] == [True, True, True, False]
    assert bucket.wait_s() == pytest.approx(2.0)
    fake_clock.advance(1.9)
    assert not bucket.try_take()
    fake_clock.advance(0.1)
    assert bucket.try_take()


def test_bucket_never_holds_more_than_its_burst(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(fake_clock, rate_per_s=1.0, burst=2)
    fake_clock.advance(1000)
    assert bucket.tokens == 2


def test_a_forced_take_puts_the_bucket_in_debt_that_later_takes_repay(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(fake_clock, rate_per_s=1.0, burst=1)
    assert bucket.try_take()
    bucket.take_forced()
    assert bucket.wait_s() == pytest.approx(2.0)
    fake_clock.advance(1.5)
    assert not bucket.try_take()


@pytest.mark.parametrize(("rate", "burst"), [(0, 10), (-1, 10), (1, 0)])
def test_bucket_refuses_a_nonsense_budget(fake_clock: FakeClock, rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        TokenBucket(fake_clock, rate_per_s=rate, burst=burst)


def test_a_take_of_several_tokens_and_one_that_must_leave_a_reserve(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(fake_clock, rate_per_s=2.0, burst=10)
    assert bucket.try_take(4)  # 6 left
    assert not bucket.try_take(1, keep=6), "would leave 5 of a reserve of 6"
    assert bucket.try_take(1, keep=5)  # 5 left
    assert bucket.tokens == 5
    # 7 tokens leaving 3: 5 more needed at 2 a second.
    assert bucket.wait_s(7, keep=3) == pytest.approx(2.5)
    fake_clock.advance(2.4)
    assert not bucket.try_take(7, keep=3)
    fake_clock.advance(0.1)
    assert bucket.try_take(7, keep=3) and bucket.tokens == pytest.approx(3.0)


def test_time_that_does_not_move_adds_no_tokens(fake_clock: FakeClock) -> None:
    bucket = TokenBucket(fake_clock, rate_per_s=100.0, burst=1)
    bucket.take_forced(5)
    assert [bucket.tokens for _ in range(3)] == [-4.0, -4.0, -4.0]
    assert bucket.wait_s() == pytest.approx(0.05)


def test_burst_one_with_forced_takes_paces_messages_evenly_and_idle_time_saves_nothing(fake_clock: FakeClock) -> None:
    # As the shipper sends: wait until the last message is paid for, then take the message's bytes.
    rate = 1000.0
    bucket = TokenBucket(fake_clock, rate_per_s=rate, burst=1)
    start = fake_clock.monotonic()
    sizes = [300, 1200, 50, 700]
    sent_at = []
    for nbytes in sizes:
        fake_clock.advance(bucket.wait_s())
        sent_at.append(fake_clock.monotonic() - start)
        bucket.take_forced(nbytes)
    # Each message goes when the bytes before it have had their time at the rate: 0, 0.3, 1.5, 1.55 s.
    expected = [sum(sizes[:i]) / rate for i in range(len(sizes))]
    assert sent_at == pytest.approx(expected)
    # A long pause: the next message goes at once, and the one after it still waits for its predecessor.
    fake_clock.advance(3600)
    assert bucket.wait_s() == 0.0
    bucket.take_forced(400)
    assert bucket.wait_s() == pytest.approx(0.4)
