"""What goes over MQTT, as both ends read it.

Owns: the telemetry batch codec (``telemetry``) and its zstd dictionaries (``dictionaries``), every topic
(``topics``), the device state message (``state``) and the EventBus JSON (``eventbus``).
Must not import: ``mapper.edge``, ``mapper.bridge``, ``mapper.net``; no network or storage library."""
