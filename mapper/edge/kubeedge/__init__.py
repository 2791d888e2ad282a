"""KubeEdge: everything the mapper says to and hears from EdgeCore and the cloud about Devices.

Owns: DMI v1beta1 (``dmi``: client, server, conversion, rate limit), the Devices and models this mapper owns
(``registry``), standalone Device files (``devicefiles``), Devices on their GPUs and EventBus deltas
(``binding``), twin and state reports (``report``), the per-device limit on inbound messages (``doorlimit``).
Must not import: the outbox, storage, processes, status, the root."""
