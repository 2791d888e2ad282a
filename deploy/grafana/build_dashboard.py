# ruff: noqa: E501  (long PromQL and descriptions read better on one line)
"""Builds deploy/grafana/gpu-mapper.json:  .venv/bin/python deploy/grafana/build_dashboard.py > deploy/grafana/gpu-mapper.json

tests/test_deploy.py fails when the committed JSON differs from what this prints, and when an expression uses a
metric name that mapper/edge/status/metrics.py does not emit.

Every expression selects one source, `job="$job"` (the "Source" variable: a single value, the first by default):
a Prometheus that both scrapes the mappers (its scrape job's name) and receives `gpu-mapper bridge`'s remote write
(job="gpu-mapper-bridge") holds every series twice, and the dashboard shows one copy (docs/operations.md).
The mapper's own series are selected by `node`, the label they carry both ways (a bridged series has no `instance`).

With --preview it writes the dashboard into deploy/grafana/preview.html instead (the page that draws the panels
without Grafana; tests/test_deploy.py checks it holds this dashboard).
"""

import json
import pathlib
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}
J = 'job="$job"'
N = f'{{{J}, node=~"$node"}}'
G = f'{{{J}, node=~"$node", uuid=~"$gpu"}}'
M = N
panels = []
y = 0
pid = 0


def row(title):
    global y, pid
    pid += 1
    panels.append(
        {
            "type": "row",
            "title": title,
            "id": pid,
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            "panels": [],
        }
    )
    y += 1


def ts(title, targets, unit, x, w=12, h=8, desc="", extra=None):
    global pid
    pid += 1
    p = {
        "type": "timeseries",
        "title": title,
        "id": pid,
        "datasource": DS,
        "description": desc,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}}, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {"datasource": DS, "refId": chr(65 + i), "expr": e, "legendFormat": legend}
            for i, (e, legend) in enumerate(targets)
        ],
    }
    if extra:
        p["fieldConfig"]["defaults"].update(extra)
    panels.append(p)


def stat(title, expr, unit, x, w=6, h=4, legend=""):
    global pid
    pid += 1
    panels.append(
        {
            "type": "stat",
            "title": title,
            "id": pid,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value",
            },
            "targets": [{"datasource": DS, "refId": "A", "expr": expr, "legendFormat": legend}],
        }
    )


row("Node")
stat("GPUs", f"count by (node) (gpu_info{N})", "none", 0, legend="{{node}}")
stat("Power draw", f"sum by (node) (gpu_power_usage_watts{N})", "watt", 6, legend="{{node}}")
stat("Power cap", f"sum by (node) (gpu_power_limit_enforced_watts{N})", "watt", 12, legend="{{node}}")
stat("Hottest GPU", f"max by (node) (gpu_temperature_celsius{N})", "celsius", 18, legend="{{node}}")
y += 4
ts(
    "Node power: draw vs cap",
    [
        (f"sum by (node) (gpu_power_usage_watts{N})", "{{node}} draw"),
        (f"sum by (node) (gpu_power_limit_enforced_watts{N})", "{{node}} cap"),
    ],
    "watt",
    0,
    desc="Sum over the node's GPUs of the board power draw and of the enforced power limits.",
)
ts(
    "Node energy rate",
    [
        (f"sum by (node) (rate(gpu_energy_consumption_joules_total{N}[5m]))", "{{node}}"),
    ],
    "watt",
    12,
    desc="Average power from the energy counter (joules per second).",
)
y += 8
row("Per GPU")
ts(
    "Power: draw vs cap",
    [
        (f"gpu_power_usage_watts{G}", "{{device}} draw"),
        (f"gpu_power_limit_enforced_watts{G}", "{{device}} enforced cap"),
        (f"gpu_power_limit_desired_watts{G}", "{{device}} desired cap"),
    ],
    "watt",
    0,
    desc="Board power draw, the cap in force, and the cap the cloud asked for (a lower enforced cap means a local policy overrides it).",
)
ts(
    "Temperature",
    [
        (f"gpu_temperature_celsius{G}", "{{device}}"),
        (f"gpu_memory_temperature_celsius{G}", "{{device}} memory"),
        (f"gpu_temperature_slowdown_threshold_celsius{G}", "{{device}} slowdown"),
    ],
    "celsius",
    12,
)
y += 8
ts(
    "Utilisation",
    [
        (f"gpu_utilization_ratio{G}", "{{device}} gpu"),
        (f"gpu_memory_utilization_ratio{G}", "{{device}} memory"),
    ],
    "percentunit",
    0,
    extra={"min": 0, "max": 1},
)
ts(
    "Memory used",
    [
        (f"gpu_memory_used_bytes{G}", "{{device}} used"),
        (f"gpu_memory_total_bytes{G}", "{{device}} total"),
    ],
    "bytes",
    12,
)
y += 8
ts(
    "Clocks",
    [
        (f"gpu_clock_sm_hertz{G}", "{{device}} SM"),
        (f"gpu_clock_memory_hertz{G}", "{{device}} memory"),
        (f"gpu_clock_sm_max_hertz{G}", "{{device}} SM max"),
        (f"gpu_locked_clock_max_hertz{G} > 0", "{{device}} locked max"),
    ],
    "hertz",
    0,
)
ts(
    "Throttle reasons (clock event reasons active)",
    [
        (
            f'gpu_clock_event_reason_active{{{J}, node=~"$node", uuid=~"$gpu", reason!="gpu_idle"}} == 1',
            "{{device}} {{reason}}",
        ),
    ],
    "none",
    12,
    desc="Why the clocks are held back: sw_power_cap (power limit), sw/hw_thermal_slowdown (heat), hw_slowdown, ...",
    extra={"min": 0, "max": 1},
)
y += 8
ts(
    "XID errors (last hour)",
    [
        (f"increase(gpu_xid_errors_total{G}[1h])", "{{device}} XID {{xid}}"),
    ],
    "none",
    0,
)
ts(
    "ECC errors and P-state",
    [
        (f"gpu_ecc_errors_uncorrected_total{G}", "{{device}} uncorrected"),
        (f"gpu_ecc_errors_corrected_total{G}", "{{device}} corrected"),
        (f"gpu_pstate{G}", "{{device}} pstate"),
    ],
    "none",
    12,
)
y += 8
row("Pods (who uses the GPU)")
ts(
    "GPU power by pod",
    [
        (f"sum by (namespace, pod) (gpu_pod_power_watts{G})", "{{namespace}}/{{pod}}"),
        (f"sum by (node) (gpu_idle_power_watts{G})", "{{node}} idle"),
    ],
    "watt",
    0,
    desc="Each pod's share of the GPUs' power by SM time (docs/processes.md), and the idle part given to no pod.",
)
ts(
    "GPU memory by pod",
    [
        (f"sum by (namespace, pod) (gpu_pod_memory_used_bytes{G})", "{{namespace}}/{{pod}}"),
        (f"gpu_process_memory_leak_suspected{G} == 1", "leak suspected: pid {{pid}} {{namespace}}/{{pod}}"),
    ],
    "bytes",
    12,
)
y += 8
ts(
    "GPU energy by pod (last hour)",
    [
        (
            f"sum by (namespace, pod) (increase(gpu_pod_energy_joules_total{G}[1h]))",
            "{{namespace}}/{{pod}}",
        ),
    ],
    "joule",
    0,
)
ts(
    "SM share by pod",
    [
        (
            f"sum by (namespace, pod) (gpu_pod_sm_utilization_ratio{G})",
            "{{namespace}}/{{pod}}",
        ),
    ],
    "percentunit",
    12,
    extra={"min": 0},
)
y += 8
row("gpu-mapper")
ts(
    "Offline buffer backlog",
    [
        (f"gpu_mapper_buffer_bytes{M}", "{{node}} buffered"),
        (f"gpu_mapper_buffer_max_bytes{M}", "{{node}} cap"),
    ],
    "bytes",
    0,
    w=8,
)
ts(
    "Oldest unsent batch and replay",
    [
        (f"gpu_mapper_buffer_oldest_unsent_age_seconds{M}", "{{node}} oldest unsent age"),
    ],
    "s",
    8,
    w=8,
)
ts(
    "Telemetry drops and publishes",
    [
        (
            f"sum by (node, reason) (rate(gpu_mapper_buffer_dropped_batches_total{M}[5m]))",
            "{{node}} dropped ({{reason}})",
        ),
        (f"rate(gpu_mapper_telemetry_published_batches_total{M}[5m])", "{{node}} published"),
    ],
    "ops",
    16,
    w=8,
)
y += 8
ts(
    "Links",
    [
        (f"gpu_mapper_mqtt_connected{M}", "{{node}} MQTT connected"),
        (f"gpu_mapper_dmi_registered{M}", "{{node}} EdgeCore registered"),
        (f"increase(gpu_mapper_mqtt_reconnects_total{M}[10m])", "{{node}} MQTT reconnects / 10m"),
    ],
    "none",
    0,
    w=8,
)
ts(
    "DMI calls to EdgeCore",
    [
        (
            f"sum by (node, method, result) (rate(gpu_mapper_dmi_rpcs_total{M}[5m]))",
            "{{node}} {{method}} {{result}}",
        ),
    ],
    "reqps",
    8,
    w=8,
    desc="EdgeCore allows about 1 call/s per node for every mapper together.",
)
ts(
    "Collect duration (p50, p99)",
    [
        (
            f"histogram_quantile(0.5, sum by (node, le) (rate(gpu_mapper_collect_duration_seconds_bucket{M}[5m])))",
            "{{node}} p50",
        ),
        (
            f"histogram_quantile(0.99, sum by (node, le) (rate(gpu_mapper_collect_duration_seconds_bucket{M}[5m])))",
            "{{node}} p99",
        ),
    ],
    "s",
    16,
    w=8,
)
y += 8
ts(
    "Desired state: actions, drift re-applies, rejections",
    [
        (
            f"sum by (node, property, result) (increase(gpu_mapper_reconcile_actions_total{M}[10m]))",
            "{{node}} {{property}} {{result}}",
        ),
        (
            f"sum by (node, property) (increase(gpu_mapper_drift_reapplies_total{M}[10m]))",
            "{{node}} drift {{property}}",
        ),
        (
            f"sum by (node, reason) (increase(gpu_mapper_desired_rejections_total{M}[10m]))",
            "{{node}} rejected {{reason}}",
        ),
    ],
    "none",
    0,
)
ts(
    "Local policies",
    [
        (f"gpu_mapper_policy_overrides_active{M}", "{{node}} {{policy}} overriding"),
        (
            f"sum by (node, policy, action) (increase(gpu_mapper_policy_events_total{M}[10m]))",
            "{{node}} {{policy}} {{action}}",
        ),
    ],
    "none",
    12,
)
y += 8

dashboard = {
    "title": "gpu-mapper: KubeEdge GPUs",
    "uid": "gpu-mapper",
    "description": "GPUs of KubeEdge edge nodes as reported by gpu-mapper (power, temperature, utilisation, clocks, throttle reasons) and the mapper itself (buffer backlog, links, desired state, policies), scraped or through gpu-mapper bridge (the Source variable picks one).",
    "tags": ["gpu", "kubeedge", "gpu-mapper"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "graphTooltip": 1,
    "refresh": "30s",
    "time": {"from": "now-6h", "to": "now"},
    "templating": {
        "list": [
            {
                "name": "datasource",
                "type": "datasource",
                "query": "prometheus",
                "label": "Data source",
                "current": {},
                "hide": 0,
                "refresh": 1,
            },
            {
                "name": "job",
                "type": "query",
                "label": "Source",
                "description": "Where the series come from: the Prometheus job that scrapes the mappers, or gpu-mapper-bridge (the telemetry stream). One at a time, so that a store that has both shows each GPU once.",
                "datasource": DS,
                "query": {"query": "label_values(gpu_info, job)", "refId": "job"},
                "definition": "label_values(gpu_info, job)",
                "multi": False,
                "includeAll": False,
                "refresh": 2,
                "current": {},
                "sort": 1,
            },
            {
                "name": "node",
                "type": "query",
                "label": "Node",
                "datasource": DS,
                "query": {"query": 'label_values(gpu_info{job="$job"}, node)', "refId": "node"},
                "definition": 'label_values(gpu_info{job="$job"}, node)',
                "multi": True,
                "includeAll": True,
                "refresh": 2,
                "current": {},
                "sort": 1,
            },
            {
                "name": "gpu",
                "type": "query",
                "label": "GPU (uuid)",
                "datasource": DS,
                "query": {"query": 'label_values(gpu_info{job="$job", node=~"$node"}, uuid)', "refId": "gpu"},
                "definition": 'label_values(gpu_info{job="$job", node=~"$node"}, uuid)',
                "multi": True,
                "includeAll": True,
                "refresh": 2,
                "current": {},
                "sort": 1,
            },
        ]
    },
    "annotations": {"list": []},
    "panels": panels,
}


def embed(page: str, board: dict) -> str:
    """``page`` (preview.html) with ``board`` as the JSON of its ``<script id="dashboard">`` element."""
    head, sep, rest = page.partition('<script id="dashboard" type="application/json">\n')
    _, end, tail = rest.partition("\n</script>")
    if not sep or not end:
        raise SystemExit('preview.html has no <script id="dashboard" type="application/json"> element')
    return head + sep + json.dumps(board, indent=1).replace("</", "<\\/") + end + tail


if "--preview" in sys.argv[1:]:
    preview = pathlib.Path(__file__).resolve().parent / "preview.html"
    preview.write_text(embed(preview.read_text(), dashboard))
else:
    print(json.dumps(dashboard, indent=2))
