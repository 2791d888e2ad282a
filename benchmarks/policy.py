"""Local thermal policy vs a naive threshold controller on one simulated hour of a hot, oscillating workload.

Setup: one simulated H100 (``mapper.edge.gpu.simnvml``) on a fake clock, the ``oscillating`` scenario (utilisation
swings 10..100 % on a 120 s period) with poor cooling (``set_cooling(3.0)``: the temperature swings between
about 63 and 87 C, where the GPU's own SwThermalSlowdown holds it). One control cycle per simulated second:
read temperature and utilisation through the pynvml surface, decide, set the power limit when it changes.

Controllers, all in the same process on identical simulators:

* ``none``: no controller (the GPU's own thermal slowdown only);
* ``naive`` (the baseline): above maxTemp cap at the GPU's minimum, at or below it restore the default; no
  hysteresis, no cool-down, no change interval;
* ``policy``: ``mapper.edge.control.policy.decide`` with the default config (maxTemp 85, releaseTemp 80,
  coolDownPeriod 5m, step 10 %, minChangeInterval 30 s), acting through the power cap;
* ``policy_clocks``: the same config with ``thermalThrottling.actuator: clocks``: the same hysteresis, acting
  through the locked SM clock (``nvmlDeviceSetGpuLockedClocks``, upper lock stepped 10 % down per step, snapped to
  a supported clock) instead of the power cap.

Figures per controller: reaction time after crossing maxTemp (from the last sample at or below maxTemp to the
cap change, so 1 s means "in the first cycle that saw the heat"; first crossing, mean and max over the
crossings that got a reaction while still hot), number of cap changes, seconds above maxTemp, seconds with a thermal
slowdown bit set (the GPU throttling itself), energy (J, from the energy counter) and work done (sum of
utilisation x SM clock / max clock, in full-speed GPU seconds). The last line printed is one JSON object with
every figure and the policy/naive ratios.

Run: ``.venv/bin/python benchmarks/policy.py [--seconds 3600] [--cooling 3.0]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mapper.clock import FakeClock
from mapper.edge.control.policy import PolicyConfig, PolicyContext, PolicyState, decide, parse_policies
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.model import Constraints

THERMAL_SLOWDOWN_BITS = 0x20 | 0x40  # SwThermalSlowdown | HwThermalSlowdown


@dataclass
class Reading:
    now_s: float
    temperature_c: int
    utilization_pct: int
    power_limit_w: float


#: A controller: the reading -> the power limit it wants now (watts), or (watts, upper SM clock lock in MHz or
#: None for unlocked).
Controller = Callable[[Reading], float | tuple[float, int | None]]


def no_controller(default_w: float) -> Controller:
    return lambda r: default_w


def naive_controller(max_temp_c: float, min_w: float, default_w: float) -> Controller:
    return lambda r: min_w if r.temperature_c > max_temp_c else default_w


def policy_clock_controller(config: PolicyConfig, constraints: Constraints) -> Controller:
    """The policy with the clocks actuator: the reconciler's part is the lock at the decision's clock cap."""
    state = PolicyState()

    def control(r: Reading) -> tuple[float, int | None]:
        nonlocal state
        ctx = PolicyContext(constraints=constraints, current_power_limit_w=r.power_limit_w, uuid="bench")
        values = {"temperature": r.temperature_c, "utilization_gpu": r.utilization_pct, "power_limit": r.power_limit_w}
        state, decision = decide(state, values, ctx, config, r.now_s)
        caps = [lim.clock_max_mhz for lim in decision.limits if lim.clock_max_mhz is not None]
        return r.power_limit_w, min(caps) if caps else None

    return control


def policy_controller(config: PolicyConfig, constraints: Constraints) -> Controller:
    state = PolicyState()
    default_w = constraints.power_limit_default_w or 0.0

    def control(r: Reading) -> float:
        nonlocal state
        ctx = PolicyContext(constraints=constraints, current_power_limit_w=r.power_limit_w, uuid="bench")
        values = {"temperature": r.temperature_c, "utilization_gpu": r.utilization_pct, "power_limit": r.power_limit_w}
        state, decision = decide(state, values, ctx, config, r.now_s)
        cap = decision.power_limit_w
        if cap is not None:
            return cap
        # No policy cap: restore the pre-policy limit when the last cap just went away, else leave the GPU be.
        if decision.restore_power_limit_w is not None:
            return decision.restore_power_limit_w
        return r.power_limit_w if r.power_limit_w else default_w

    return control


def run(make: Callable[[Constraints], Controller], seconds: int, cooling: float, max_temp_c: float) -> dict[str, Any]:
    clock = FakeClock()
    sim = SimNvml(1, "H100", clock=clock.monotonic, scenario="oscillating")
    sim.nvmlInit()
    sim.set_cooling(None, cooling)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    lo_mw, hi_mw = sim.nvmlDeviceGetPowerManagementLimitConstraints(h)
    mem_mhz = sim.nvmlDeviceGetSupportedMemoryClocks(h)[0]
    graphics = tuple(sorted(sim.nvmlDeviceGetSupportedGraphicsClocks(h, mem_mhz), reverse=True))
    constraints = Constraints(
        power_limit_min_w=lo_mw / 1000,
        power_limit_max_w=hi_mw / 1000,
        power_limit_default_w=sim.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000,
        graphics_clocks_mhz=graphics,
    )
    controller = make(constraints)
    sm_max = sim.nvmlDeviceGetMaxClockInfo(h, 1)
    energy0_mj = sim.nvmlDeviceGetTotalEnergyConsumption(h)

    changes = above_s = slowdown_s = 0
    work = 0.0
    was_above = False
    crossings: list[float] = []  # times of crossings still waiting for a reaction
    cap_at_crossing: list[float] = []
    reactions: list[float] = []
    unanswered = 0
    lock_mhz: int | None = None
    for _ in range(seconds):
        clock.advance(1.0)
        now = clock.monotonic()
        temp = sim.nvmlDeviceGetTemperatureV(h, 0)
        util = sim.nvmlDeviceGetUtilizationRates(h).gpu
        limit_w = sim.nvmlDeviceGetPowerManagementLimit(h) / 1000
        reasons = sim.nvmlDeviceGetCurrentClocksEventReasons(h)
        work += util / 100 * sim.nvmlDeviceGetClockInfo(h, 1) / sm_max
        above = temp > max_temp_c
        above_s += above
        slowdown_s += bool(reasons & THERMAL_SLOWDOWN_BITS)
        if above and not was_above:
            # The crossing happened after the previous (cool) sample: measure from there, an upper bound.
            crossings.append(now - 1.0)
            cap_at_crossing.append(limit_w)
        if not above and was_above and crossings:
            unanswered += len(crossings)
            crossings.clear()
            cap_at_crossing.clear()
        was_above = above

        wanted = controller(Reading(now, temp, util, limit_w))
        target_w, target_mhz = (wanted, lock_mhz) if isinstance(wanted, float | int) else wanted
        target_w = round(target_w)
        reacted = False
        if round(target_w * 1000) != round(limit_w * 1000):
            sim.nvmlDeviceSetPowerManagementLimit(h, round(target_w * 1000))
            changes += 1
            reacted = bool(crossings) and target_w < cap_at_crossing[0]
        if target_mhz != lock_mhz:
            if target_mhz is None:
                sim.nvmlDeviceResetGpuLockedClocks(h)
            else:
                # as the reconciler does: the highest supported clock at or below the cap
                snapped = max((c for c in graphics if c <= target_mhz), default=min(graphics))
                sim.nvmlDeviceSetGpuLockedClocks(h, min(graphics), snapped)
            reacted = bool(crossings) and target_mhz is not None and (lock_mhz is None or target_mhz < lock_mhz)
            lock_mhz = target_mhz
            changes += 1
        if reacted:
            reactions.extend(now - t for t in crossings)
            crossings.clear()
            cap_at_crossing.clear()
    energy_j = (sim.nvmlDeviceGetTotalEnergyConsumption(h) - energy0_mj) / 1000
    return {
        "first_reaction_s": reactions[0] if reactions else None,
        "mean_reaction_s": round(sum(reactions) / len(reactions), 2) if reactions else None,
        "max_reaction_s": max(reactions) if reactions else None,
        "crossings": len(reactions) + unanswered + len(crossings),
        "unanswered_crossings": unanswered,
        "cap_changes": changes,
        "above_max_temp_s": above_s,
        "thermal_slowdown_s": slowdown_s,
        "energy_j": round(energy_j, 1),
        "work_gpu_s": round(work, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=3600, help="simulated seconds (1 s cycles)")
    parser.add_argument("--cooling", type=float, default=3.0, help="thermal resistance factor (3.0 = poor cooling)")
    args = parser.parse_args(argv)
    config = PolicyConfig()
    clocks_config = parse_policies({"thermalThrottling": {"actuator": "clocks"}})
    max_temp = config.thermal.max_temp_c

    started = time.perf_counter()
    results = {
        "none": run(lambda c: no_controller(c.power_limit_default_w or 0.0), args.seconds, args.cooling, max_temp),
        "naive": run(
            lambda c: naive_controller(max_temp, c.power_limit_min_w or 0.0, c.power_limit_default_w or 0.0),
            args.seconds,
            args.cooling,
            max_temp,
        ),
        "policy": run(lambda c: policy_controller(config, c), args.seconds, args.cooling, max_temp),
        "policy_clocks": run(lambda c: policy_clock_controller(clocks_config, c), args.seconds, args.cooling, max_temp),
    }
    wall_s = time.perf_counter() - started
    for name, figures in results.items():
        print(f"{name:>13}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), file=sys.stderr)

    naive, policy = results["naive"], results["policy"]

    def ratio(key: str, over: dict[str, Any] = naive, of: dict[str, Any] = policy) -> float | None:
        a, b = of[key], over[key]
        return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None

    keys = ("cap_changes", "above_max_temp_s", "thermal_slowdown_s", "energy_j", "work_gpu_s")

    print(
        json.dumps(
            {
                "benchmark": "policy",
                "sim_cost": "none",  # simulated physics on a fake clock: no figure is a cost of NVML calls
                "simulated_s": args.seconds,
                "cooling": args.cooling,
                "gpu": "H100",
                "scenario": "oscillating",
                "results": results,
                "ratio_policy_over_naive": {k: ratio(k) for k in keys},
                "ratio_policy_clocks_over_policy": {
                    k: ratio(k, over=policy, of=results["policy_clocks"]) for k in keys
                },
                "wall_s": round(wall_s, 2),
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
