"""The GPU memory leak detector on fake time: a leak, a plateau, a sawtooth that is not a leak."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from mapper.edge.processes.leak import LeakConfig, LeakDetector, LeakEvent

GIB = 1 << 30
UUID = "GPU-0000"


def _run(
    detector: LeakDetector,
    memory_at: Callable[[float], int | None],
    seconds: float,
    step_s: float = 5.0,
    start_s: float = 0.0,
) -> list[LeakEvent]:
    events: list[LeakEvent] = []
    t = start_s
    while t <= start_s + seconds:
        events += detector.observe(UUID, {42: memory_at(t)}, t)
        t += step_s
    return events


def test_a_steady_leak_is_suspected_once() -> None:
    detector = LeakDetector(LeakConfig(window_s=600.0, threshold_bytes=GIB))
    events = _run(detector, lambda t: 2 * GIB + int(t / 600.0 * 1.5 * GIB), 1200.0)
    assert [e.action for e in events] == ["leak-suspected"]
    assert events[0].pid == 42 and events[0].growth_bytes >= GIB
    assert events[0].ts_s >= 600.0  # not before a whole window was seen
    assert detector.suspected(UUID) == [42]


def test_growth_below_the_threshold_is_not_a_leak() -> None:
    detector = LeakDetector(LeakConfig(window_s=600.0, threshold_bytes=GIB))
    assert _run(detector, lambda t: 2 * GIB + int(t / 600.0 * 0.5 * GIB), 1800.0) == []


def test_a_plateau_after_growth_clears_and_never_fires_alone() -> None:
    detector = LeakDetector(LeakConfig(window_s=600.0, threshold_bytes=GIB))
    # Grows 3 GiB over 15 min (a leak), then stays flat: cleared within one window of the plateau.
    events = _run(detector, lambda t: GIB + int(min(t, 900.0) / 900.0 * 3 * GIB), 2400.0)
    actions = [(e.action, e.ts_s) for e in events]
    assert [a for a, _ in actions] == ["leak-suspected", "leak-cleared"]
    assert 900.0 < actions[1][1] <= 900.0 + 600.0
    # A model that loads 6 GiB in its first minute and then holds it: never a leak.
    fresh = LeakDetector(LeakConfig(window_s=600.0, threshold_bytes=GIB))
    assert _run(fresh, lambda t: int(min(t, 60.0) / 60.0 * 6 * GIB), 3600.0) == []


def test_a_sawtooth_is_not_a_leak() -> None:
    detector = LeakDetector(LeakConfig(window_s=600.0, threshold_bytes=GIB))
    # A caching allocator: climbs 4 GiB over 100 s, then frees back to 1 GiB, forever.
    assert _run(detector, lambda t: GIB + int((t % 100.0) / 100.0 * 4 * GIB), 3600.0) == []


def test_an_exiting_suspect_is_cleared_and_forgotten() -> None:
    detector = LeakDetector(LeakConfig(window_s=300.0, threshold_bytes=GIB))
    events = _run(detector, lambda t: int(t / 300.0 * 2 * GIB), 400.0)
    assert [e.action for e in events] == ["leak-suspected"]
    gone = detector.observe(UUID, {}, 405.0)
    assert [(e.action, e.reason) for e in gone] == [("leak-cleared", "process exited")]
    assert detector.suspected(UUID) == []


def test_unknown_memory_and_disabled_detector_say_nothing() -> None:
    detector = LeakDetector(LeakConfig(window_s=60.0, threshold_bytes=1))
    assert _run(detector, lambda t: None, 300.0) == []
    off = LeakDetector(LeakConfig(enabled=False, window_s=60.0, threshold_bytes=1))
    assert _run(off, lambda t: int(t * GIB), 300.0) == []


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [({"window_s": 0.0}, "window_s"), ({"threshold_bytes": 0}, "threshold_bytes"), ({"segments": 1}, "segments")],
)
def test_bad_config_is_refused_by_name(kwargs: dict[str, float], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        LeakConfig(**kwargs)  # type: ignore[arg-type]


def _reference_events(config: LeakConfig, series: list[tuple[float, int]]) -> list[tuple[str, float, int]]:
    """The detector's rule written plainly (every sample of the window, one pass per observation)."""
    kept: list[tuple[float, int]] = []
    suspected = False
    out: list[tuple[str, float, int]] = []
    n, window = config.segments, config.window_s
    for now, used in series:
        kept.append((now, used))
        while len(kept) > 1 and now - kept[1][0] >= window:
            kept.pop(0)
        start = now - window
        growth: int | None = None
        if kept[0][0] <= start + 1e-9:
            floors: list[int | None] = [None] * n
            for ts, u in kept:
                i = min(n - 1, max(0, int((ts - start) / window * n)))
                floors[i] = u if floors[i] is None else min(u, floors[i])  # type: ignore[type-var]
            known = [f for f in floors if f is not None]
            if len(known) == n:
                rising = all(b > a for a, b in itertools.pairwise(known))
                growth = known[-1] - known[0] if rising else 0
        leaking = growth is not None and growth >= config.threshold_bytes
        if leaking and not suspected:
            suspected = True
            out.append(("leak-suspected", now, growth or 0))
        elif not leaking and suspected and growth is not None:
            suspected = False
            out.append(("leak-cleared", now, growth))
    return out


def test_the_detector_decides_as_the_plain_rule_over_random_memory_and_timing() -> None:
    import random

    actions: list[str] = []
    for seed in range(12):
        rng = random.Random(seed)
        window = rng.choice([60.0, 300.0, 600.0])
        config = LeakConfig(window_s=window, threshold_bytes=GIB // 4, segments=rng.randint(2, 8))
        t, used = 0.0, 2 * GIB
        series = []
        for _ in range(600):
            t += rng.choice([1.0, 2.5, 5.0, 5.0, 5.0, 7.3])
            step = rng.choice([-1, 0, 1, 1, 2]) * (8 << 20)
            used = max(0, used + step - (GIB // 2 if rng.random() < 0.01 else 0))
            series.append((t, used))
        detector = LeakDetector(config)
        got = [(e.action, e.ts_s, e.growth_bytes) for now, u in series for e in detector.observe(UUID, {7: u}, now)]
        assert got == _reference_events(config, series), f"seed {seed}"
        actions += [a for a, _, _ in got]
    # The random series exercise both decisions.
    assert actions.count("leak-suspected") >= 3 and actions.count("leak-cleared") >= 3
