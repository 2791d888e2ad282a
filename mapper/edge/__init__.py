"""The edge side: the mapper process (``gpu-mapper run``), one per edge node.

Owns: the composition root (``app``: builds every part from the settings, runs and supervises the tasks),
which GPU family serves the node (``backends``), the mapper's settings (``config``), and one package per concern,
top to bottom (each imports only the ones below it; import-linter checks it):
``status`` (snapshot, ``/metrics`` ``/status``, housekeeping) > ``processes`` (who uses each GPU) >
``kubeedge`` (DMI, EventBus, Device files, bindings, twin reports) | ``storage`` (SQLite buffer and store, the
data dir, which implement the outbox's Protocols) > ``outbox`` (where a batch or ack goes) | ``push`` (a Device's
push and DB methods) > ``control``
(collect, desired state, reconcile, policies, the health loop) | ``gpu`` (NVML, Jetson, simulators) >
``health`` (results, XIDs, host checks) > ``config``.
Must not import: ``mapper.bridge``, ``mapper.tools``, ``mapper.cli``."""
