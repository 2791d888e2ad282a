"""Storage: what the mapper keeps on disk in its data directory.

Owns: the SQLite telemetry buffer (``buffer``), the desired-state store (``store``), the data directory's
creation and modes (``datadir``), moving a corrupt SQLite file aside (``sqlitefiles``). The only edge package
that imports sqlite3.
Must not import: KubeEdge, the outbox, processes, status, the root."""
