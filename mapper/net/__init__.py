"""Network adapters both processes use.

Owns: the MQTT session (``mqtt``: one paho session driven from the event loop), the bounded HTTP server core with
liveness (``http``), a small asyncio HTTP client for the push destinations (``httpclient``), the exporter-toolkit
web config (``webconfig``: TLS, client certificates, basic auth).
Must not import: ``mapper.edge``, ``mapper.bridge``, ``mapper.wire``."""
