"""Real parts a test needs that a machine may lack (the KubeEdge CRD schemas in ``../shared/kubeedge/crds``,
``promtool``).

Where one is absent a developer's run skips the tests that need it and stays useful; under CI (``CI=true``, which
``.ci/run`` sets and CI services set themselves) those tests FAIL instead, naming what is missing: a CI run that
skipped them would be green without having run them."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def require(present: bool, what: str) -> None:
    """Return when the part is here; otherwise fail under CI, skip elsewhere, with ``what`` as the reason."""
    if present:
        return
    if in_ci():
        pytest.fail(f"{what} (CI=true: a test that needs it fails rather than skips)", pytrace=False)
    pytest.skip(what)


def available(present: bool, what: str) -> bool:
    """For a test that checks more where the part is here: whether it is; under CI its absence fails the test."""
    if not present and in_ci():
        require(present, what)
    return present
