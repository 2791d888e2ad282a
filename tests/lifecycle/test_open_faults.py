"""The open faults a lifecycle run reports instead of failing on (``known_open_fault``): each is matched only by what
its own violation shows, so that no other violation of the same invariant passes as one of them."""

from __future__ import annotations

from tests.lifecycle.harness import Outcome, Violation
from tests.lifecycle.plan import Step, config_for
from tests.lifecycle.runner import known_open_fault

LOST = (
    "{} of 10 published samples not in Prometheus after 20 s ({} of them published within 5 s after a broker restart)"
)
TYPO_THEN_RENAME = [
    Step("add", ("spare", 1, "500")),
    Step("typo_value", ("spare", "abc")),
    Step("rename", ("spare", "x")),
]


def outcome(invariant: str, message: str, steps: list[Step] | None = None) -> Outcome:
    v = Violation(invariant, message)
    v.step = len(steps or [None]) - 1
    return Outcome(config_for(1), steps or [], v)


def test_samples_lost_only_just_after_a_broker_restart_are_the_shared_subscription_fault() -> None:
    assert known_open_fault(outcome("delivery", LOST.format(5, 5))) == "broker-restart-shared-subscription"


def test_a_sample_lost_away_from_any_broker_restart_fails_the_run() -> None:
    assert known_open_fault(outcome("delivery", LOST.format(5, 4))) == ""
    assert known_open_fault(outcome("delivery", "3 samples twice in Prometheus, e.g. x: [1.0, 2.0]")) == ""


def test_a_sample_written_again_under_the_gpus_identity_labels_is_that_fault() -> None:
    message = "10 samples twice in Prometheus, e.g. (...): [1.0, 1.0], in series that differ in gpu: ['0', None]"
    assert known_open_fault(outcome("delivery", message)) == "written-again-with-identity"


def test_the_restore_race_needs_a_refused_value_of_the_device_before_its_removal_or_rename() -> None:
    late = "desired value not in force: GPU 1 (GPU-1, Device x): power_limit 500, expected 700"
    assert known_open_fault(outcome("gpu-setting", late, TYPO_THEN_RENAME)) == "restore-race-after-refused-value"
    no_typo = [Step("add", ("spare", 1, "500")), Step("rename", ("spare", "x"))]
    assert known_open_fault(outcome("gpu-setting", late, no_typo)) == ""
    other_device = [Step("typo_value", ("gpu-a", "abc")), Step("rename", ("spare", "x"))]
    assert known_open_fault(outcome("gpu-setting", late, other_device)) == ""


def test_bad_input_that_changed_a_gpu_is_never_an_open_fault() -> None:
    changed = "bad input changed a GPU setting: GPU 1 (GPU-1, Device x): power_limit 300, expected 500"
    assert known_open_fault(outcome("gpu-setting", changed, TYPO_THEN_RENAME)) == ""
    assert known_open_fault(outcome("stream-identity", "seq 0 published twice")) == ""
