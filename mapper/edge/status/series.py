"""The mapper's own series (``gpu_mapper_*``: ``mapper.shared.naming.NODE_FAMILIES``) in a snapshot, pure.

``node_series`` is the one list of them: the mapper's ``/metrics`` shows it (``mapper.edge.status.metrics``, labelled
with the node), and the node stream carries it to the cloud (``mapper.edge.status.nodestream``; the bridge labels
it with the node of the batch). So a series of the mapper itself is the same whether it was scraped or bridged.
"""

from __future__ import annotations

from collections.abc import Mapping

from mapper.edge.status.stats import MapperSnapshot
from mapper.shared import naming
from mapper.shared.naming import NodeSample, histogram_samples, node_samples


def _keyed(counts: Mapping[str, int]) -> dict[tuple[str, ...], float]:
    return {(k,): float(v) for k, v in counts.items()}


def _pairs(counts: Mapping[tuple[str, str], int]) -> dict[tuple[str, ...], float]:
    return {tuple(k): float(v) for k, v in counts.items()}


def node_series(snap: MapperSnapshot) -> list[NodeSample]:
    """Every sample of the mapper's own families in ``snap``, in ``NODE_FAMILIES`` order: plain gauges always,
    labelled counters and gauges for the label values they have counted (none before the first)."""
    n = naming
    s = snap
    values: list[tuple[naming.Family, Mapping[tuple[str, ...], float] | float]] = [
        (n.BUILD_INFO, {(s.version, s.mode): 1.0}),
        (n.GPUS, len(s.gpus)),
        (n.BUFFER_BYTES, s.buffer_bytes),
        (n.BUFFER_BATCHES, s.buffer_batches),
        (n.BUFFER_MAX_BYTES, s.buffer_max_bytes),
        (n.BUFFER_OLDEST_AGE, s.buffer_oldest_age_s or 0.0),
        (n.BUFFER_DROPPED, _keyed(s.buffer_drops)),
        (n.BUFFER_DROPPED_SAMPLES, _keyed(s.buffer_dropped_samples)),
        (n.BUFFER_MEMORY_BATCHES, s.buffer_memory_batches),
        # (always a sample, so that a store fed by the bridge alone has the series: 0 with no reason while nothing
        # runs degraded)
        (n.DEGRADED, {(why,): 1.0 for why in s.degraded} or {("",): 0.0}),
        (n.REPLAY_REMAINING_BATCHES, s.replay_remaining_batches),
        (n.REPLAY_REMAINING_BYTES, s.replay_remaining_bytes),
        (n.PUBLISHED_BATCHES, s.telemetry_published_batches),
        (n.PUBLISHED_BYTES, s.telemetry_published_bytes),
        (n.MQTT_ENABLED, 1 if s.mqtt_enabled else 0),
        (n.MQTT_CONNECTED, 1 if s.mqtt_connected else 0),
        (n.MQTT_RECONNECTS, s.mqtt_reconnects),
        (n.MQTT_INBOUND_DROPPED, _keyed(s.mqtt_inbound_dropped)),
        (n.MQTT_INBOUND_DEFERRED, s.mqtt_inbound_deferred),
        (n.DMI_REGISTERED, 1 if s.dmi_registered else 0),
        (n.STANDALONE, 1 if s.mode == "standalone" else 0),
        (n.DMI_RPCS, _pairs(s.dmi_rpcs)),
        (n.RECONCILE_ACTIONS, _pairs(s.reconcile_actions)),
        (n.DRIFT_REAPPLIES, _keyed(s.drift_reapplies)),
        (n.DESIRED_REJECTIONS, _keyed(s.desired_rejections)),
        (n.POLICY_OVERRIDES_ACTIVE, _keyed(s.policy_overrides_active)),
        (n.POLICY_EVENTS, _pairs(s.policy_events)),
    ]
    out: list[NodeSample] = []
    for family, v in values:
        out.extend(node_samples(family, v))
    for family, hist in (
        (n.COLLECT_DURATION, s.collect_duration),
        (n.COLLECT_LATENESS, s.collect_lateness),
        (n.COLLECT_BEHIND, s.collect_behind),
    ):
        out.extend(histogram_samples(family, hist.cumulative(), hist.sum_s))
    out.extend(node_samples(n.COLLECT_ERRORS, _keyed(s.collect_errors)))
    out.extend(node_samples(n.PROCESS_ERRORS, _keyed(s.process_errors)))
    out.extend(node_samples(n.CONFIG_ERRORS, _keyed(s.config_errors)))
    out.extend(node_samples(n.CONFIG_REFUSED, _keyed(_standing(s))))
    return out


def _standing(s: MapperSnapshot) -> dict[str, int]:
    """The refusals standing now, by source; every source that ever refused one has a value (0 once fixed)."""
    out = dict.fromkeys(s.config_errors, 0)
    for c in s.config_refused:
        out[c.source] = out.get(c.source, 0) + 1
    return out
