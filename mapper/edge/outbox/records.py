"""The records the outbox and the telemetry buffer exchange, spelled once.

``StoredBatch`` is one buffered telemetry batch (or status message): the shipper hands it to the buffer to store,
the buffer hands it back to be sent, the buffer tool reads it. ``CompactionRow`` is what compaction reads of a
stored batch without its payload. The outbox's loops see the buffer through their Protocols
(``mapper.edge.outbox.shipper.BufferLike``, ``mapper.edge.outbox.compact.CompactableBuffer``), never the buffer
itself; the buffer (``mapper.edge.storage.buffer``) imports this module to build and take these records.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mapper.wire.telemetry import BatchFormatError, decode_batch


@dataclass(frozen=True, init=False)
class StoredBatch:
    """One telemetry batch, or one status message, in the buffer.

    The writer gives ``seq`` and ``ts_first_ms`` (the buffer checks them and keeps the stream and
    ``ts_last_ms``); a row read back has them in its payload only, so they are None there and read from the
    payload the first time they are asked for (one decode of this batch): ``seq`` -1 and ``ts_first_ms`` =
    ``ts_last_ms`` when the payload is not a batch this mapper reads. ``id`` is the buffer's row id, 0 until it is
    stored. A status message has ``boot_id`` "" and ``seq`` -1."""

    device: str
    uuid: str
    boot_id: str
    ts_last_ms: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    #: Broker URL for a property's own ``pushMethod.mqtt.address``; "" = the mapper's default broker.
    address: str
    id: int
    #: (seq, ts_first_ms) as the writer gave them; None: in the payload only.
    given: tuple[int, int] | None

    def __init__(
        self,
        device: str,
        uuid: str,
        boot_id: str,
        seq: int | None,
        ts_first_ms: int | None,
        ts_last_ms: int,
        topic: str,
        payload: bytes,
        qos: int = 1,
        retain: bool = False,
        address: str = "",
        *,
        id: int = 0,
    ) -> None:
        if (seq is None) != (ts_first_ms is None):
            raise ValueError(f"batch {device}: give both seq and ts_first_ms, or neither (read from the payload)")
        given = None if seq is None or ts_first_ms is None else (seq, ts_first_ms)
        for name, value in (
            ("device", device),
            ("uuid", uuid),
            ("boot_id", boot_id),
            ("ts_last_ms", ts_last_ms),
            ("topic", topic),
            ("payload", payload),
            ("qos", qos),
            ("retain", retain),
            ("address", address),
            ("id", id),
            ("given", given),
        ):
            object.__setattr__(self, name, value)

    @cached_property
    def _header(self) -> tuple[int, int]:
        return self.given if self.given is not None else peek_header(self.payload, self.ts_last_ms)

    @property
    def seq(self) -> int:
        """The batch's sequence number (-1: a status message, or a payload that is not a batch this mapper reads)."""
        return self._header[0]

    @property
    def ts_first_ms(self) -> int:
        """The batch's first sample time (``ts_last_ms`` where the payload is not a batch this mapper reads)."""
        return self._header[1]


def peek_header(payload: bytes, ts_last_ms: int) -> tuple[int, int]:
    """(seq, ts_first_ms) of a stored payload, by decoding it; (-1, ``ts_last_ms``) when it is not a batch."""
    try:
        decoded = decode_batch(payload)
    except (BatchFormatError, ValueError):
        return -1, ts_last_ms
    return decoded.seq, decoded.ts_first_ms


@dataclass(frozen=True)
class CompactionRow:
    """What compaction needs of a stored batch without reading its payload."""

    id: int
    #: The buffer's stream (device, uuid, boot id, topic, QoS, retain, broker) the batch belongs to.
    stream: int
    ts_last_ms: int
    size: int
    #: A merged batch already (format version 3 or 4).
    merged: bool
    #: In its cold form already: a merged batch of the format compaction writes when a slot is over (version 4).
    cold: bool = False
