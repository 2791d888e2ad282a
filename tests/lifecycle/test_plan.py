"""The lifecycle plan on its own (no processes, no root): a seed always gives the same world and steps, every
action of the issue's list is drawn, and a step's arguments name what it acts on (so a cut-down list still runs)."""

from __future__ import annotations

import collections

from tests.lifecycle.harness import Run
from tests.lifecycle.plan import NAMES, config_for, generate


def test_a_seed_gives_the_same_world_and_steps_every_time() -> None:
    for seed in (1, 17, 499):
        assert config_for(seed) == config_for(seed)
        assert generate(config_for(seed), 25) == generate(config_for(seed), 25)
    assert generate(config_for(1), 25) != generate(config_for(2), 25)


def test_every_action_is_drawn_and_every_world_occurs_over_the_ci_seeds_and_the_long_form() -> None:
    kinds: collections.Counter[str] = collections.Counter()
    worlds = set()
    for seed in range(1, 501):
        cfg = config_for(seed)
        worlds.add((cfg.kind, cfg.source, cfg.bridges))
        for step in generate(cfg, 25):
            kinds[step.kind] += 1
            assert hasattr(Run, f"step_{step.kind}"), step.kind
            if step.kind in ("add", "remove", "readd", "rename", "set", "unset", "typo_value", "typo_file"):
                assert step.args[0] in NAMES
    actions = {name.removeprefix("step_") for name in dir(Run) if name.startswith("step_")}
    assert set(kinds) == actions, f"never drawn: {actions - set(kinds)}"
    assert {(k, s, b) for k in ("nvml", "jetson") for s in ("edgecore", "folder") for b in (1, 2)} == worlds
    ci = {config_for(seed).kind for seed in range(1, 31)} | {config_for(seed).source for seed in range(1, 31)}
    assert {"nvml", "jetson", "edgecore", "folder"} <= ci, "the CI form's 30 seeds cover every kind and source"
