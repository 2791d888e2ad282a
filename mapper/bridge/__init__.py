"""The cloud side: ``gpu-mapper bridge``, which reads the mappers' telemetry stream and state messages from MQTT
and writes them into Prometheus by remote write.

Owns: the bridge process (``app``), decoded batches -> series (``core``), its settings (``config``), remote write
on the wire and its spool (``remotewrite``), its own ``/metrics`` ``/healthz`` ``/readyz`` (``metrics``).
Must not import: ``mapper.edge`` (nothing of the mapper runs in the cloud), nor ``mapper.tools`` or ``mapper.cli``.
Speaks to the edge only through ``mapper.wire`` (what goes over MQTT) and ``mapper.shared`` (the catalog and the
Prometheus names)."""
