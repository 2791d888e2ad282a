"""Status: what the mapper says about itself.

Owns: the snapshot's values (``stats``), the snapshot built on demand from the parts (``source``), the text views
(``view``: ``gpu-mapper status``, the console table), ``/metrics`` ``/healthz`` ``/readyz`` ``/status``
(``metrics``, on the HTTP core of ``mapper.net.http``) and housekeeping (status file, config reload).
Must not import: the root (``mapper.edge.app``, ``backends``) or ``mapper.bridge``."""
