"""Push: a Device's property data sent where its ``pushMethod`` / ``dbMethod`` says, besides the twins.

Owns the destination writers, one module per method, each ``make_writer(method, secrets, *, timeout_s)`` returning
a ``mapper.shared.push.PushWriter``: ``influxdb2`` (HTTP ``/api/v2/write``), ``redis`` (its own small RESP client),
``mysql`` (PyMySQL), ``tdengine`` (refused: nothing here to test it against). See docs/push.md.
The writers import only ``mapper.shared.push``, ``mapper.errors``, ``mapper.clock``, the stdlib and their client
library, and not each other. Must not import: storage, KubeEdge, processes, status, the root."""
