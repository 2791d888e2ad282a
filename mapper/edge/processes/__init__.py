"""Who uses each GPU: processes, containers and pods, and the energy attributed to each.

Owns: process -> container -> pod (``workloads``), the energy split (``attribution``), the leak detector
(``leak``), one GPU's process sample made into workloads (``monitor``) and the process cycle (``loop``).
Must not import: storage, status, the root."""
