"""Control: what the mapper does with each GPU, every cycle.

Owns: the collect loop (``collect``: one task samples every GPU, runs each GPU's step), desired state per source
(``desired``), the level-triggered reconciler (``reconcile``: validate, apply, read back), the local policies
(``policy``: thermal, power saving, health) and the health loop (``healthloop``: driver checks, CUDA probe,
recovery). Works on the ``GpuBackend`` Protocol of ``mapper.shared.model``.
Must not import: a GPU backend (``mapper.edge.gpu``), KubeEdge, the outbox, storage, status, or any third-party I/O
library (pynvml, grpc, paho, sqlite3, prometheus_client)."""
