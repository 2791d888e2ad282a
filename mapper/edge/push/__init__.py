"""Push: a Device's property data sent where its ``pushMethod`` / ``dbMethod`` says, besides the twins (docs/push.md).

Owns: reading a property's methods (``spec``: one push and one DB method, every field checked, a bad one refused
alone), the framework's formats (``wire``), the router that picks one sample per report cycle for each destination
and supervises their tasks (``router``), a destination's own loop over the push buffer (``destination``: kept
through outages, replayed in order, refusals dropped by rule), and the writers: ``http``, ``otel`` (OTLP/HTTP
protobuf), ``mqtttext`` (the framework's text messages), ``influxdb2``, ``redis`` (its own small RESP client),
``mysql`` (PyMySQL), ``tdengine`` (refused: nothing here to test it against), made by ``writers``. Each writer is a
``mapper.shared.push.PushWriter``; the DB writers' ``make_writer(method, secrets, *, timeout_s)`` import only
``mapper.shared.push``, ``mapper.errors``, ``mapper.clock``, the ``address`` parser, the stdlib and their client
library, and not each other. The push buffer (SQLite) is handed in (``destination.PushStore``).
Must not import: storage, KubeEdge, processes, status, the root."""
