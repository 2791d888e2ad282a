"""The vocabulary both processes speak.

Owns: the property catalog and domain types (``model``), the Prometheus naming table (``naming``) and the
config-file parsers and settings both commands read.
Must not import: anything of ``mapper`` but ``errors`` and ``clock``; no third-party I/O library."""
