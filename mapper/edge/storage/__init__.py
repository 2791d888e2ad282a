"""Storage: what the mapper keeps on disk in its data directory.

Owns: the SQLite telemetry buffer (``buffer``), the push buffer (``pushbuffer``: what the push destinations have
not taken yet; the push loops' ``PushStore``), the desired-state store (``store``), the data directory's
creation and modes (``datadir``), moving a corrupt SQLite file aside (``sqlitefiles``). The only edge package
that imports sqlite3. It implements the outbox's Protocols over the outbox's record type (``outbox.records``).
Must not import: KubeEdge, processes, status, the root."""
