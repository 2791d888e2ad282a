"""The naive exporter that benchmarks/overhead.py runs beside the mapper: a plain loop over the simulated GPUs.

Every second, for each of the same 8 simulated GPUs (same profile, seed and scenario as the mapper's
``--sim 8``), it reads every catalog property through pynvml-surface calls on ``SimNvml`` (one call per value,
as a hand-written exporter does) and publishes ONE JSON message per value with QoS 1 over paho
(``naive/<node>/<uuid>/<property>``). No batching, no buffer, no metrics: the baseline the mapper is compared to.

Run by overhead.py: ``python benchmarks/overhead_naive.py --port P [--gpus 8] [--cost h200] [--seconds S]``; also
usable by hand. ``--cost``: the simulated NVML's cost profile (the same as the mapper's in overhead.py).
``--real`` (overhead.py ``--real``): every GPU of this machine through the real pynvml made read-only
(``tests/readonly_nvml.py``: every setter refused; ``--readonly-report FILE`` collects what was refused). Prints
one JSON line (messages sent) when it stops (after ``--seconds``, or on SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def readers(nvml: Any) -> list[tuple[str, Callable[[Any], Any]]]:
    """(property, read(handle) -> JSON value): the mapper's NVML catalog, one pynvml call per value."""
    n = nvml

    def field(field_id: int) -> Callable[[Any], Any]:
        def read(h: Any) -> Any:
            item = n.nvmlDeviceGetFieldValues(h, [field_id])[0]
            if int(item.nvmlReturn) != 0:
                raise n.NVMLError(int(item.nvmlReturn))
            return item.value.siVal

        return read

    return [
        ("uuid", lambda h: n.nvmlDeviceGetUUID(h)),
        ("product_name", lambda h: n.nvmlDeviceGetName(h)),
        ("utilization_gpu", lambda h: n.nvmlDeviceGetUtilizationRates(h).gpu),
        ("utilization_memory", lambda h: n.nvmlDeviceGetUtilizationRates(h).memory),
        ("memory_used", lambda h: n.nvmlDeviceGetMemoryInfo(h).used),
        ("memory_total", lambda h: n.nvmlDeviceGetMemoryInfo(h).total),
        ("temperature", lambda h: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
        ("temperature_memory", field(n.NVML_FI_DEV_MEMORY_TEMP)),
        (
            "temperature_slowdown",
            lambda h: n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        ),
        (
            "temperature_shutdown",
            lambda h: n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
        ),
        ("fan_speed", lambda h: n.nvmlDeviceGetFanSpeed(h)),
        ("power_usage", lambda h: n.nvmlDeviceGetPowerUsage(h) / 1000.0),
        ("energy_consumption", lambda h: n.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0),
        ("power_limit_enforced", lambda h: n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
        ("power_limit_min", lambda h: n.nvmlDeviceGetPowerManagementLimitConstraints(h)[0] / 1000.0),
        ("power_limit_max", lambda h: n.nvmlDeviceGetPowerManagementLimitConstraints(h)[1] / 1000.0),
        ("power_limit_default", lambda h: n.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0),
        ("power_limit", lambda h: n.nvmlDeviceGetPowerManagementLimit(h) / 1000.0),
        ("clock_sm", lambda h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
        ("clock_memory", lambda h: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)),
        ("clock_sm_max", lambda h: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)),
        ("clock_event_reasons", lambda h: n.nvmlDeviceGetCurrentClocksEventReasons(h)),
        ("pstate", lambda h: n.nvmlDeviceGetPerformanceState(h)),
        ("pcie_tx", lambda h: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES) * 1024),
        ("pcie_rx", lambda h: n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES) * 1024),
        (
            "ecc_errors_corrected",
            lambda h: n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC),
        ),
        (
            "ecc_errors_uncorrected",
            lambda h: n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
        ),
        ("remapped_rows_uncorrectable", lambda h: n.nvmlDeviceGetRemappedRows(h)[1]),
        ("remapped_rows_pending", lambda h: bool(n.nvmlDeviceGetRemappedRows(h)[2])),
        ("persistence_mode", lambda h: n.nvmlDeviceGetPersistenceMode(h) == 1),
        ("compute_mode", lambda h: n.nvmlDeviceGetComputeMode(h)),
    ]


def main() -> None:
    import paho.mqtt.client as paho

    from mapper.edge.gpu.simnvml import SimNvml

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="MQTT broker port on 127.0.0.1")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--profile", default="H100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenario", default="inference")
    parser.add_argument("--cost", default="none", help="the simulated NVML's cost profile: none or h200")
    parser.add_argument("--node", default="edge-1")
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: until SIGTERM)")
    parser.add_argument("--real", action="store_true", help="this machine's GPUs, real pynvml, read-only")
    parser.add_argument("--readonly-report", default=None, help="with --real: append refused setters to this file")
    args = parser.parse_args()
    if args.gpus < 1 or args.interval_s <= 0:
        parser.error("--gpus must be >= 1 and --interval-s > 0")

    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    nvml: Any
    if args.real:
        from tests.readonly_nvml import real_pynvml

        nvml, _guard = real_pynvml(args.readonly_report)
    else:
        nvml = SimNvml(args.gpus, args.profile, seed=args.seed, scenario=args.scenario, cost=args.cost)
    nvml.nvmlInit()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    uuids = [nvml.nvmlDeviceGetUUID(h) for h in handles]
    reads = readers(nvml)

    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"naive-{args.node}")
    client.max_inflight_messages_set(100)
    client.connect("127.0.0.1", args.port)
    client.loop_start()
    sent = errors = 0
    started = time.monotonic()
    next_at = started
    while not stop and (args.seconds <= 0 or time.monotonic() - started < args.seconds):
        for uuid, handle in zip(uuids, handles, strict=True):
            for prop, read in reads:
                try:
                    value = read(handle)
                except nvml.NVMLError:
                    errors += 1
                    continue
                doc = {"node": args.node, "uuid": uuid, "property": prop, "value": value, "ts": time.time()}
                client.publish(f"naive/{args.node}/{uuid}/{prop}", json.dumps(doc), qos=1)
                sent += 1
        next_at += args.interval_s
        time.sleep(max(0.0, next_at - time.monotonic()))
    client.loop_stop()
    client.disconnect()
    print(
        json.dumps(
            {
                "sent": sent,
                "read_errors": errors,
                "seconds": round(time.monotonic() - started, 1),
                "sim_cost": None if args.real else nvml.cost_profile,
                "hardware": "real" if args.real else "simulator",
            }
        )
    )


if __name__ == "__main__":
    main()
