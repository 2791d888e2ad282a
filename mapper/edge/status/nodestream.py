"""The node stream: the mapper's own series (``gpu_mapper_*``) into the telemetry stream, for the bridge.

A cloud Prometheus usually cannot scrape an edge node; the telemetry stream is how the node's data reaches it.
Every ``cycle_s`` (the report cycle, 20 s by default) ``NodeStream`` takes the snapshot ``/metrics`` shows and adds
one sample of ``node_series`` (``mapper.edge.status.series``: the same series, named by ``mapper.shared.naming``;
each sample's name and labels are one telemetry series name, ``naming.sample_key``) to a ``BatchEncoder`` of the
device ``naming.NODE_DEVICE`` (no uuid), and hands each batch it cuts (every ``window_s``; the first sample alone at
once, so that the cloud sees a started mapper without waiting) to the shipper for
``gpu-mapper/{node}/metrics`` (``mapper.wire.topics.node_metrics_topic``). From there it is a stream like a
GPU's: committed to the buffer, replayed oldest first after an outage, compacted while it waits, deduplicated by
``(node, device, boot id, seq)``. So the cloud has the mapper's health over an outage too, once the link is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

from mapper.clock import Clock
from mapper.edge.status.series import node_series
from mapper.edge.status.stats import MapperSnapshot
from mapper.shared import naming
from mapper.shared.model import Sample, Value
from mapper.wire.telemetry import BatchCodec, BatchEncoder, EncodedBatch, Route
from mapper.wire.topics import node_metrics_topic

#: A batch of the node stream holds this many samples (its window is this many cycles, at least the telemetry
#: window): the series names cost most of a batch, so a batch of three costs hardly more than a batch of one.
SAMPLES_PER_BATCH = 3


def node_values(snap: MapperSnapshot) -> dict[str, Value]:
    """One sample of the node stream: every series of the mapper itself by its telemetry name (ints stay ints:
    the batch codec packs them tighter than floats)."""
    out: dict[str, Value] = {}
    for _, name, labels, value in node_series(snap):
        out[naming.sample_key(name, labels)] = int(value) if value.is_integer() else value
    return out


class NodeStream:
    """``snapshot``: the mapper's snapshot now; ``submit``: the shipper's (stores a batch for its route)."""

    def __init__(
        self,
        node: str,
        boot_id: str,
        snapshot: Callable[[], MapperSnapshot],
        submit: Callable[[EncodedBatch, Route | None], object],
        *,
        clock: Clock,
        cycle_s: float,
        window_s: float,
        fmt: Literal["binary", "json"] = "binary",
        qos: int = 1,
        codec: BatchCodec | None = None,
    ) -> None:
        if not cycle_s > 0:
            raise ValueError(f"node stream cycle_s must be > 0, got {cycle_s!r}")
        self.snapshot = snapshot
        self.submit = submit
        self.clock = clock
        self.cycle_s = cycle_s
        self.route = Route("", node_metrics_topic(node), qos, False)
        self.encoder = BatchEncoder(node, naming.NODE_DEVICE, "", boot_id, window_s=window_s, fmt=fmt, codec=codec)
        self.samples = 0
        self.batches = 0

    def sample(self) -> None:
        """One sample of the mapper's own series now; a batch it completes goes to the shipper."""
        snap = self.snapshot()
        now_ms = self.clock.wall_ms()
        self.encoder.add(Sample("", snap.taken_at_ms or now_ms, node_values(snap)))
        self.samples += 1
        self._submit(self.encoder.flush() if self.samples == 1 else self.encoder.flush_due(now_ms))

    def flush(self) -> None:
        """What was sampled but not cut yet, as one batch (at shutdown)."""
        self._submit(self.encoder.flush())

    def _submit(self, batch: EncodedBatch | None) -> None:
        if batch is not None:
            self.batches += 1
            self.submit(batch, self.route)

    async def run(self, beat: Callable[[str, float], None]) -> None:
        """Sample every ``cycle_s`` until cancelled."""
        while True:
            beat("node-stream", self.cycle_s)
            self.sample()
            await asyncio.sleep(self.cycle_s)
