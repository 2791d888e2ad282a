"""A test whose real part is missing skips on a developer's machine and fails under CI (``CI=true``)."""

from __future__ import annotations

import pytest

from tests.realparts import available, in_ci, require


@pytest.mark.parametrize(("value", "ci"), [("true", True), ("TRUE", True), ("", False), ("false", False), ("1", False)])
def test_ci_is_the_ci_variable_set_to_true(monkeypatch: pytest.MonkeyPatch, value: str, ci: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci() is ci


def test_a_missing_part_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"the CRDs are not here \(CI=true"):
        require(False, "the CRDs are not here")
    with pytest.raises(pytest.fail.Exception, match="the CRDs are not here"):
        available(False, "the CRDs are not here")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="the CRDs are not here"):
        require(False, "the CRDs are not here")
    assert available(False, "the CRDs are not here") is False


def test_a_part_that_is_here_neither_fails_nor_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("true", ""):
        monkeypatch.setenv("CI", value)
        require(True, "unused")
        assert available(True, "unused") is True
