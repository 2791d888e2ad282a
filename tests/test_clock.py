"""The grid the periodic loops wake on."""

from __future__ import annotations

import pytest

from mapper.clock import next_on_grid


@pytest.mark.parametrize(
    ("now_s", "period_s", "slack_s", "expected"),
    [
        (1000.0, 1.0, 0.0, 1001.0),  # on a grid point: the next one
        (1000.3, 1.0, 0.0, 1001.0),
        (1000.97, 1.0, 0.05, 1002.0),  # a hair before a point counts for it
        (1000.94, 1.0, 0.05, 1001.0),
        (1003.0, 5.0, 0.0, 1005.0),  # every period on the same grid: 5 s points are also 1 s points
        (1000.0, 0.04, 0.05, pytest.approx(1000.04)),  # slack above half a period counts as half
    ],
)
def test_next_on_grid(now_s: float, period_s: float, slack_s: float, expected: float) -> None:
    assert next_on_grid(now_s, period_s, slack_s) == expected
