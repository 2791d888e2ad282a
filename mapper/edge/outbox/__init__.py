"""The outbox: where a batch, an ack or an event goes once the mapper has it.

Owns: each GPU's telemetry stream (``streams``), store-then-publish with ordered replay (``shipper``), backlog
compaction (``compact``), acks and policy events (``publish``). It sees the buffer only through Protocols.
Must not import: storage (the SQLite buffer is handed in), KubeEdge, processes, status, the root, sqlite3."""
